"""The hybrid kind's model runner: the layer stack of `HybridModel` over a paged KV cache for its
attention layers and the state pool (pool.py) for its Mamba layers.

One step packs every scheduled sequence's new tokens into one [1, T] row, as ModelRunner does, so
prefill chunks and decode tokens share the step (continuous batching). Attention, MLP and MoE
layers run over the whole row (attention through ModelRunner's paged path, by the layer's place
among the attention layers). A Mamba layer runs per kind of row: the decode tokens of all
sequences in one `MambaMixer.step` over their states, each prefill chunk through the chunked scan
from its sequence's state (zero at position 0), leaving the state after its last token: chunked
prefill carries the state from chunk to chunk. The states are written back to the pool after the
step succeeds (see pool.py). A tensor-parallel worker writes them back when its forward returns
(the sampler is on the driver; a worker that fails ends the engine, executor.py).

Pure decode steps go through the bucket-padded forward of cuda_graphs.py (`--padded-decode`;
captured as CUDA graphs on a GPU): every row one token, attention through the paged kernel, and
each Mamba layer gathers its rows' states from the pool by a static slot-index buffer (padding
rows: the pool's scratch slot, read as zeros) into one buffer of the largest bucket's rows, which
every bucket shares, and advances the copies inside the forward. The copies of every row are
scattered back after sampling succeeds, as in the eager path, so a failed step leaves the pool as
it was; padding rows write the scratch slot and nothing else.

Speculative decoding is refused for hybrid models (llm_engine.py): a rejected draft would have
advanced the Mamba states past the accepted tokens. The forward is not compiled on CPU
(`eager_reason`).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F

from tessera.common.models.hybrid.config import HybridConfig
from tessera.common.models.hybrid.mamba import MambaMixer, MambaState
from tessera.inference.core.scheduler import SchedulerOutput
from tessera.inference.sample.sampler import Sampler
from tessera.inference.worker.batch import BatchSeq, ModelRunnerOutput, StepInputs, copy_in
from tessera.inference.worker.cuda_graphs import GraphSpec
from tessera.inference.worker.model_runner import ModelRunner, undivided
from tessera.inference.worker.state.pool import StatePool, state_bytes_per_sequence

__all__ = ["HybridRunner", "hybrid_block_bytes", "tensor_parallel_problem"]


def hybrid_block_bytes(cfg: HybridConfig, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
    """Bytes one KV block takes over the attention layers only (0 for an all-Mamba model)."""
    layers = cfg.pattern.count("*")
    if not layers:
        return 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * block_size * max(1, (cfg.kv_heads or 1) // tp) * (cfg.attention_head_dim or 1) * itemsize


def tensor_parallel_problem(tp: int, cfg: HybridConfig) -> str | None:
    """Why `cfg` cannot be served split over `tp` ranks (a phrase), or None. The kind's parallel plan
    splits Mamba heads and groups, attention heads (key/value heads too: never replicated here),
    the MLP width and the vocabulary (not padded for hybrid models) over the ranks."""
    m = cfg.mamba
    counts = [("Mamba heads (mamba.num_heads)", m.num_heads if m else None),
              ("Mamba groups (mamba.num_groups)", m.num_groups if m else None),
              ("attention heads", cfg.num_heads if "*" in cfg.pattern else None),
              ("key/value heads", cfg.kv_heads if "*" in cfg.pattern else None),
              ("MLP width", cfg.ffn_hidden_size if "-" in cfg.pattern else None),
              ("vocabulary rows", cfg.vocab_size)]
    return undivided(tp, counts)


class HybridRunner(ModelRunner):
    eager_reason = ("the hybrid stack runs its Mamba layers per sequence over the state pool, outside the compiled "
                    "causal-LM forward (worker/state/runner.py)")
    supports_speculative = False  # a rejected draft would leave the Mamba states past the accepted tokens
    tensor_parallel_problem = staticmethod(tensor_parallel_problem)  # the loader asks, through kinds.py

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1, kv_dtype: torch.dtype | None = None,
                 state_slots: int = 1):
        hybrid: HybridConfig = model.cfg
        self.model = model
        self.hybrid = hybrid
        self.cfg = hybrid.layer_config()  # what ModelRunner's attention path reads (no sliding windows)
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tp_rank, self.tp_size = tp_rank, tp_size
        attention = [i for i, s in enumerate(hybrid.pattern) if s == "*"]
        self.attention_index = {layer: j for j, layer in enumerate(attention)}  # global layer -> KV pool layer
        head_dim = hybrid.attention_head_dim or 1
        # Under tensor parallel this rank's key/value heads (the loader has checked tp divides them).
        self.kv = torch.zeros(len(attention), 2, num_blocks, block_size, max(1, (hybrid.kv_heads or 1) // tp_size),
                              head_dim, device=device, dtype=kv_dtype or dtype)
        self.kv_scales = (1.0, 1.0)
        self.scale = 1.0 / math.sqrt(head_dim)
        self.batch_decodes = device.type == "cpu"
        self.sampler = Sampler()
        # From the mixers as built: under tensor parallel the rank's heads and channels (its 1/tp).
        self.states = StatePool(model, state_slots, device, dtype)
        self.state_bytes = self.states.nbytes // state_slots
        self._defer = False  # inside execute: write the states back once sampling has succeeded too
        self._pending: list[tuple[int, torch.Tensor, MambaState]] | None = None

    block_bytes = staticmethod(hybrid_block_bytes)

    @staticmethod
    def state_bytes_per_sequence(cfg: HybridConfig, dtype: torch.dtype, tp: int = 1) -> int:
        return state_bytes_per_sequence(cfg, dtype) // tp  # the plan gives each rank 1/tp of heads and channels

    @classmethod
    def serving_kwargs(cls, prep) -> dict:
        return {"state_slots": prep.batch_hint}  # max_num_seqs: one slot per sequence that can run

    def use_decode_graphs(self, spec: GraphSpec) -> None:
        """Pure decode steps through bucket-padded forwards (`_padded_logits`, captured on CUDA)."""
        scratch = self.states.add_scratch_slot()
        biggest = max(spec.sizes)
        # Static per-row inputs of the Mamba layers, beside DecodeGraphs' own: the rows' state slots
        # and whether each starts at position 0 (reads zeros). Padding rows: the scratch slot, fresh.
        self._graph_slots = torch.full((biggest,), scratch, dtype=torch.long, device=self.device)
        self._graph_fresh = torch.ones(biggest, dtype=torch.bool, device=self.device)
        # The copies every bucket's forward advances, as rows of one buffer of the largest bucket's
        # rows: a captured graph's tensors stay alive, so a buffer per bucket would hold sum(sizes)
        # sequences' states beside the pool.
        self._graph_buffers = self.states.buffers(biggest)
        self._graph_states: dict[int, list[tuple[int, MambaState]]] = {}  # bucket -> advanced copies per layer
        self.decode_graphs = self._graphs_of(spec, self._padded_logits)

    def state_summary(self) -> str:
        scratch = "" if self.states.scratch is None else " + 1 scratch slot (padded decode)"
        return (f"state pool {self.states.slots} sequences{scratch} x {self.state_bytes / 1024:.1f} KiB "
                f"({len(self.states.layers)} Mamba layers; fixed per sequence)")

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self._defer, self._pending = True, None
        try:
            out = super().execute(plan)
        finally:
            self._defer = False
        self._commit()
        return out

    def _commit(self) -> None:
        for layer, slots, state in self._pending or ():
            self.states.scatter(layer, slots, state)
        self._pending = None

    def forward_batch(self, batch: list[BatchSeq], logits_rows: list[int]) -> torch.Tensor:
        if any(s.state_slot < 0 for s in batch) and self.states.layers:
            raise ValueError("a sequence of a hybrid model was scheduled without a state slot")
        graphs = self.decode_graphs
        size = None if graphs is None else graphs.bucket(batch)
        if size is not None:  # a pure decode step: padded (and replayed on CUDA)
            pad = size - len(batch)
            copy_in(self._graph_slots[:size], torch.tensor([s.state_slot for s in batch] + [self.states.scratch] * pad))
            copy_in(self._graph_fresh[:size], torch.tensor([s.start == 0 for s in batch] + [True] * pad))
            logits = graphs.forward(batch, logits_rows)
            slots = self._graph_slots[:size]  # every row's, padding rows' too: fixed shapes
            self._pending = [(layer, slots, state) for layer, state in self._graph_states[size]]
        else:
            logits = self._eager_logits(batch, logits_rows)
        if not self._defer:  # called alone (not through execute): the step is done
            self._commit()
        return logits

    def _eager_logits(self, batch: list[BatchSeq], logits_rows: list[int]) -> torch.Tensor:
        step = self.prepare(batch, logits_rows)
        qsl = step.query_start_loc.tolist()
        slots = torch.tensor([s.state_slot for s in batch], dtype=torch.long, device=self.device)
        fresh = [s.start == 0 for s in batch]
        fresh_mask = torch.tensor(fresh, device=self.device) if any(fresh) else None
        decodes = [i for i, s in enumerate(batch) if s.num_new == 1]
        pending = []

        def mamba(layer: int, mixer: MambaMixer, x: torch.Tensor) -> torch.Tensor:
            state = self.states.gather(layer, slots, fresh_mask)
            pending.append((layer, slots, state))
            return self._mamba(mixer, x, state, qsl, decodes)
        logits = self._stack(step, mamba)
        self._pending = pending
        return logits

    def _padded_logits(self, step: StepInputs) -> torch.Tensor:
        """fp32 logits of every row of a padded decode step (what DecodeGraphs runs and captures):
        no host reads; the Mamba layers' advanced copies are kept by bucket for `_commit`."""
        size = step.seq_lens.shape[0]
        slots, fresh = self._graph_slots[:size], self._graph_fresh[:size]
        advanced = []

        def mamba(layer: int, mixer: MambaMixer, x: torch.Tensor) -> torch.Tensor:
            buf = self._graph_buffers[layer]
            rows = MambaState({k: v[:size] for k, v in buf.conv.items()}, buf.ssm[:size])
            state = self.states.gather(layer, slots, fresh, out=rows)
            advanced.append((layer, state))
            return mixer.step(x[0], state).unsqueeze(0)
        logits = self._stack(step, mamba)
        self._graph_states[size] = advanced  # on CUDA the captured run's: the tensors each replay writes
        return logits

    def _stack(self, step: StepInputs, mamba) -> torch.Tensor:
        """The layer stack over the step, Mamba layers through `mamba(layer, mixer, x)`; fp32 logits
        of step.logits_rows (None: every row)."""
        model = self.model
        attention = partial(self._attention, step)
        h = model.embed_tokens(step.tokens)
        for name, block in model.layers.items():
            x = block.norm(h.to(block.norm.weight.dtype))
            if block.symbol == "M":
                out = mamba(int(name), block.mixer, x)
            elif block.symbol == "*":
                out = block.mixer(x, None, attention, None)
            else:
                out = block.mixer(x)
            h = (h.float() if block.residual_in_fp32 else h) + out
        h = model.final_norm(h.to(model.final_norm.weight.dtype))
        rows = h[0] if step.logits_rows is None else h[0].index_select(0, step.logits_rows)
        return F.linear(rows, model.output_weight()).float()

    @staticmethod
    def _mamba(mixer: MambaMixer, x: torch.Tensor, state: MambaState, qsl: list[int],
               decodes: list[int]) -> torch.Tensor:
        """One Mamba layer over the packed row x [1, T, d]; advances `state` (one entry per sequence)."""
        n = len(qsl) - 1
        if len(decodes) == n:  # a pure decode step: one token per sequence, in row order
            return mixer.step(x[0], state).unsqueeze(0)
        out = torch.empty_like(x)
        if decodes:
            idx = torch.tensor(decodes, device=x.device)
            rows = torch.tensor([qsl[i] for i in decodes], device=x.device)
            sub = MambaState({k: v.index_select(0, idx) for k, v in state.conv.items()}, state.ssm.index_select(0, idx))
            out[0].index_copy_(0, rows, mixer.step(x[0].index_select(0, rows), sub).to(out.dtype))
            for k, v in sub.conv.items():
                state.conv[k].index_copy_(0, idx, v.to(state.conv[k].dtype))
            state.ssm.index_copy_(0, idx, sub.ssm)
        chosen = set(decodes)
        for i in range(n):
            if i in chosen:
                continue
            a, b = qsl[i], qsl[i + 1]
            sub = MambaState({k: v[i:i + 1] for k, v in state.conv.items()}, state.ssm[i:i + 1])
            out[:, a:b] = mixer(x[:, a:b], None, sub)
            for k, v in sub.conv.items():
                state.conv[k][i:i + 1] = v
            state.ssm[i:i + 1] = sub.ssm
        return out

    def _attention(self, step: StepInputs, layer: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
        return super()._attention(step, self.attention_index[layer], q, k, v)
