"""The model runner of a multi-head latent attention model (DeepSeek-V3): a latent KV cache.

Per token and layer the cache keeps only what MLA derives every key and value from: the normed
compressed KV (kv_lora_rank) and the rotated RoPE key (qk_rope_head_dim), one vector shared by all
heads, in the paged blocks the decoder's block manager hands out (prefix caching, preemption and
speculative rollback unchanged). Its pool is [layer, block, slot, 1, kv_lora_rank + rope]: an MQA
cache of one head whose keys are the whole latent and whose values are its first kv_lora_rank
dimensions, so the decoder's attention code reads it unchanged. Under tensor parallel every rank
keeps the whole latent (it is shared by the heads), as vLLM does.

Attention (attention.py computes the projections):
  - decode rows (one token, or 1 + k speculative) attend with absorbed queries over the latents:
    on CPU through the grouped gather + SDPA path (decode_attention.py), on CUDA through the
    Triton paged-attention kernel, which takes a value width equal to the key width, so its
    output's RoPE columns are dropped;
  - a single-token step built without a split (the persistent decode batch on CUDA, the padded
    forward that cuda_graphs.py replays or runs uncaptured) is all decode rows: one
    paged-attention call over the step's own tables, lengths and slots, fixed shapes and no host
    read, so it can be captured; padding rows attend over the scratch block only;
  - prefill chunks up-project their sequence's cached latents (earlier chunks and the new one) to
    full heads and attend causally, one sequence at a time (PyTorch SDPA on either device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.inference.worker.batch import BatchSeq, StepInputs
from tessera.inference.worker.cuda_graphs import GraphSpec
from tessera.inference.worker.decode_attention import DecodeSplit, decode_attention, decode_split
from tessera.inference.worker.kv_cache import dequantize_kv, store_kv
from tessera.inference.worker.latent.attention import LatentAttention, install
from tessera.inference.worker.model_runner import ModelRunner
from tessera.kernels import paged_attention


def latent_width(cfg) -> int:
    return cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim


def full_kv_bytes_per_token(cfg, dtype: torch.dtype, tp: int = 1) -> int:
    """What the same model would keep per token on one tensor rank with full K/V: each local
    head's key (nope + rope) and value, every layer."""
    m = cfg.mla
    itemsize = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * max(1, cfg.num_heads // tp) * (m.qk_head_dim + m.v_head_dim) * itemsize


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


class LatentRunner(ModelRunner):
    eager_reason = "its latent attention is not in the compiled forward"

    @staticmethod
    def prepare_model(model) -> None:
        install(model)  # before pack_linears: absorption reads kv_b_proj's plain weight

    @classmethod
    def block_bytes(cls, cfg, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
        """(kv_lora_rank + qk_rope_head_dim) x cached layers x dtype size per token, on every tensor rank."""
        return cls.cache_layers(cfg) * block_size * latent_width(cfg) * torch.empty((), dtype=dtype).element_size()

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1, kv_dtype: torch.dtype | None = None):
        cfg = model.cfg
        # The base class's K/V pool is sized 0 blocks; this runner's pool is the latent one.
        super().__init__(model, 0, block_size, device, dtype, tp_rank, tp_size, kv_dtype)
        self.num_blocks = num_blocks
        self.kv = torch.zeros(self.cache_layers(cfg), num_blocks, block_size, 1, latent_width(cfg), device=device,
                              dtype=kv_dtype or dtype)
        self.batch_decodes = True  # decode and prefill rows attend differently on every device
        # Decode groups through the paged-attention dispatcher (Triton on CUDA) rather than the
        # CPU's gather + SDPA.
        self.kernel_decode = device.type == "cuda"
        self.kv_dtype = self.kv.dtype
        self.dtype = dtype

    # Set by a proposer whose drafts read the target's hidden states (spec_decode.MTPProposer): request id ->
    # (first position, final-normed hidden states [n, d]) of the rows each sequence computed last step.
    step_hidden: dict[str, tuple[int, torch.Tensor]] | None = None

    @staticmethod
    def cache_layers(cfg) -> int:
        return cfg.num_layers

    def execute(self, plan):
        # A step that raised after its forward (the engine then retries its sequences one at a
        # time) left its hidden rows behind: no later step may take them as its own.
        self._kept = None
        if self.decode_graphs is not None:
            self.decode_graphs.rows = 0
        out = super().execute(plan)
        if self.step_hidden is not None and (kept := self.take_hidden()) is not None:
            offset = 0
            for s in plan.scheduled:
                self.step_hidden[s.seq.request_id] = (s.start, kept[offset:offset + s.num_new])
                offset += s.num_new
        return out

    _kept: torch.Tensor | None = None
    # With decode graphs and MTP modules: the final-normed hidden rows of the padded forward, a
    # static buffer written inside it (a replayed graph runs no Python, so `_hidden` cannot keep them).
    _graph_hidden: torch.Tensor | None = None
    _in_graph = False

    def take_hidden(self) -> torch.Tensor | None:
        """The last step's final-normed hidden rows [T, d] in its packed order (once step_hidden is
        set): an eager forward's own, or a replayed one's copied out of the static buffer; None
        when it kept none."""
        kept, self._kept = self._kept, None
        graphs = self.decode_graphs
        if kept is None and graphs is not None and graphs.rows:
            kept = self._graph_hidden[:graphs.rows].clone()  # the next replay overwrites the buffer
        if graphs is not None:
            graphs.rows = 0
        return kept

    def _hidden(self, step: StepInputs) -> torch.Tensor:
        hidden = super()._hidden(step)
        if self._in_graph:
            if self._graph_hidden is not None:
                self._graph_hidden[:hidden.shape[1]].copy_(hidden[0])
        elif self.step_hidden is not None:
            self._kept = hidden[0]
        return hidden

    _hidden.same_single_token_forward = True  # type: ignore[attr-defined]  # keeps what it returns, changes nothing

    def use_decode_graphs(self, spec: GraphSpec) -> None:
        """ModelRunner's decode graphs, over `_graph_logits`: with MTP modules (a draft reads the
        target's hidden rows) the padded forward also writes its hidden rows to a static buffer."""
        if getattr(self.cfg, "mtp", None) is not None:
            self._graph_hidden = torch.zeros(max(spec.sizes), self.cfg.hidden_size, device=self.device,
                                             dtype=self.dtype)
        self.decode_graphs = self._graphs_of(spec, self._graph_logits)

    def _graph_logits(self, step: StepInputs) -> torch.Tensor:
        """The padded forward DecodeGraphs runs (and captures)."""
        self._in_graph = True
        try:
            return self._logits(step)
        finally:
            self._in_graph = False

    def state_summary(self) -> str:
        """The startup line's cache words: how many tokens the latent pool holds, and how many the
        same bytes would hold as full K/V."""
        cfg = self.cfg
        tokens = self.num_blocks * self.block_size
        per_token = self.block_bytes(cfg, 1, self.kv_dtype, self.tp_size)
        full = self.num_blocks * self.block_size * per_token // full_kv_bytes_per_token(cfg, self.kv_dtype, self.tp_size)
        return (f"latent KV cache ({cfg.mla.kv_lora_rank} + {cfg.mla.qk_rope_head_dim} values per token and layer): "
                f"{tokens} tokens, {full} with full K/V ({tokens / max(full, 1):.1f}x)")

    def prepare(self, batch: list[BatchSeq], logits_rows: list[int]) -> StepInputs:
        inputs = super().prepare(batch, logits_rows)
        if inputs.split is None:  # a step of prefill chunks only
            starts = inputs.query_start_loc.tolist()
            inputs.split = decode_split([0] * len(batch), starts, inputs.block_tables, inputs.seq_lens,
                                        self.block_size)
        return inputs

    prepare.same_single_token_forward = True  # type: ignore[attr-defined]  # adds a split to prefill-only steps

    def _layer_latent(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's pool [blocks, block_size, 1, L + R] and as slots [slots, 1, L + R] (made
        outside inference mode, as ModelRunner._layer_kv says why)."""
        views = self._kv_views
        if views is None or views[0] is not self.kv:
            with torch.inference_mode(False):
                views = self._kv_views = (self.kv, [(kv, kv.view(-1, *kv.shape[2:])) for kv in self.kv])
        return views[1][layer]

    def _attention(self, step: StepInputs, layer: int, attn: LatentAttention, q_nope: torch.Tensor,
                   q_rope: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """The new tokens' latents into their slots, then attention of every row: [T, H, v]."""
        cache, flat = self._layer_latent(layer)
        store_kv(flat, step.slot_mapping, latent[:, None])
        rank = attn.m.kv_lora_rank
        split: DecodeSplit | None = step.split
        if split is None:  # a single-token step, every row one decode token (module docstring)
            o = paged_attention(attn.absorb(q_nope, q_rope), cache, cache, step.block_tables, step.seq_lens,
                                step.query_start_loc, attn.scale)
            return attn.unabsorb(o[..., :rank])
        if split.order is not None:
            q_nope, q_rope = q_nope.index_select(0, split.order), q_rope.index_select(0, split.order)
        outs = []
        start = 0
        for group in split.decode_groups:
            end = start + group.num_rows
            q = attn.absorb(q_nope[start:end], q_rope[start:end])
            if self.kernel_decode:
                tables = group.blocks.view(-1, group.width).to(torch.int32)
                starts = torch.arange(0, group.num_rows + 1, group.num_q, dtype=torch.int32, device=cache.device)
                o = paged_attention(q, cache, cache, tables, group.seq_lens, starts, attn.scale)
            else:
                o = decode_attention(q, cache, cache, group, attn.scale)
            outs.append(attn.unabsorb(o[..., :rank]))
            start = end
        if start < q_nope.shape[0]:
            outs.append(self._prefill(cache, attn, q_nope[start:], q_rope[start:], split))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if split.inverse is None else out.index_select(0, split.inverse)

    # Latent attention of the same StepInputs: DecodeBatch's (with its CPU split or none) and the
    # padded ones of DecodeGraphs, so steady decode steps take their inputs from the persistent batch.
    _attention.same_single_token_forward = True  # type: ignore[attr-defined]

    def _prefill(self, cache: torch.Tensor, attn: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor,
                 split: DecodeSplit) -> torch.Tensor:
        """Each prefill chunk over its sequence's cached latents, up-projected: [rows, H, v]."""
        q = torch.cat((q_nope, q_rope), dim=-1)
        # CPU flash attention wants 4-D inputs of one head width: the narrower of q/k and v is
        # zero-padded (zeros add nothing to a dot product; padded value columns are cut off after).
        v_dim = attn.m.v_head_dim
        width = max(q.shape[-1], v_dim)
        qs = _pad(q, width)
        bounds = split.prefill_starts.tolist()
        lens = split.prefill_lens.tolist()
        outs = []
        for i, kv_len in enumerate(lens):
            q0, q1 = bounds[i], bounds[i + 1]
            blocks = split.prefill_tables[i, :-(-kv_len // self.block_size)].long()
            latent = cache.index_select(0, blocks).view(-1, cache.shape[-1])[:kv_len]
            k, v = attn.expand(dequantize_kv(latent, q.dtype))
            k = _pad(k, width)
            q_len = q1 - q0
            mask = None  # a whole prompt: plain causal
            if q_len != kv_len:  # a later chunk sees every earlier position; additive float (CPU flash takes it)
                hidden = (torch.arange(kv_len, device=q.device)[None, :]
                          > torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None])
                mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
            o = F.scaled_dot_product_attention(qs[None, q0:q1].transpose(1, 2), k[None].transpose(1, 2),
                                               _pad(v, width)[None].transpose(1, 2), attn_mask=mask,
                                               is_causal=mask is None, scale=attn.scale)
            outs.append(o[0].transpose(0, 1)[..., :v_dim])
        return outs[0] if len(outs) == 1 else torch.cat(outs)
