"""CUDA graphs for decode steps: captured once per batch-size bucket, replayed every step.

A decode step of a small model on a GPU is host-bound: the layers' few hundred kernel launches
take longer to issue from Python than the GPU takes to run them (issue #18 measured TPOT 12.6 ms at
64 sequences for llama-160m on an H100, whose weights read in ~0.1 ms). A CUDA graph records the
launches of one forward and replays them with one call. As in vLLM, only pure decode steps (every
scheduled sequence brings exactly one new token) go through graphs; prefill, chunked prefill,
mixed steps and speculative rows (1 + k tokens) run eagerly.

Shape of the replayed forward. A graph fixes every tensor's shape and address, so:
- the batch is padded to the next captured size ("bucket": by default vLLM's
  `cudagraph_capture_sizes`, 1, 2, 4, 8, 16, 24, ... up to max_num_seqs);
- the inputs live in static buffers sized for the largest bucket and are copied in before each
  replay: token ids, positions, slot mapping, seq lens, query start offsets (0..B, fixed), and
  block tables padded to the most blocks a sequence can hold (max_model_len / block_size);
- padding rows are sequences of one token at position 0 whose block table is the scratch block,
  a pool block that the BlockManager never hands out (the engine reserves the pool's last one):
  their K/V land there and nowhere else, and their logits rows are never read;
- the logits of every row go to a static fp32 buffer; the rows asked for are copied out after
  the replay.
The forward in between is the model runner's own (`ModelRunner._attention` with the paged-attention
kernel, never the CPU grouping by sequence length): it must not synchronise with the host
(`.item()`, `.tolist()`, data-dependent shapes). The Triton paged-attention kernel numbers its
query tiles without reading seq_lens back and sizes its KV splits from the block table's width,
so it is capturable. Dynamic RoPE scaling (`int(positions.max())`) and mixture-of-experts layers
(expert counts `.tolist()`) read values back and are not; such models decode eagerly.
A hybrid model's Mamba layers read their states from the state pool by a static
slot-index buffer that its runner fills beside these (worker/state/runner.py); not yet measured
on GPUs, so captured only when `--cuda-graph-sizes` asks.

`capture=False` runs the same padded forward without capturing ("padded eager"): on CPU this is
how the tests show that padding, buckets and the scratch block give the outputs of the unpadded
engine; on CUDA it isolates a capture problem from a padding one.

Every bucket's graph is captured on one private memory pool, largest first, so the smaller graphs
reuse the largest's intermediate memory (replays never overlap: one engine step at a time).
Tensor parallel: each worker builds its own `DecodeGraphs` over its shard and its share of the KV
pool (the scratch block is the same block id in every rank's pool) and, on CUDA, captures its
buckets in the same order as the others, so the NCCL all-reduces inside are captured in lockstep;
the driver's scheduler, sampler and block manager are unchanged. Not measured on GPUs yet, so under
tensor parallel graphs are captured only when `--cuda-graph-sizes` asks (the default stays eager);
the padded path itself is tested under gloo on CPU.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tessera.common.errors import UserError
from tessera.inference.worker.batch import BatchSeq, StepInputs, copy_in

if TYPE_CHECKING:
    from tessera.common.models.causal_lm.config import ModelConfig
    from tessera.inference.config import EngineConfig

log = logging.getLogger("tessera.inference")


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's default capture sizes (1, 2, 4, then every 8 up to 256, then every 16) up to
    max_num_seqs, with max_num_seqs itself last so that every decode batch has a bucket."""
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, max_num_seqs + 1, 16)]
    sizes = [s for s in sizes if s < max_num_seqs]
    return [*sizes, max_num_seqs]


def parse_capture_sizes(values: list[str]) -> list[int]:
    """--cuda-graph-sizes '1 2 4 8' or '1,2,4,8' -> sorted distinct sizes (one line when wrong)."""
    sizes = []
    for text in values:
        for part in text.replace(",", " ").split():
            if not (part.isascii() and part.isdigit()) or int(part) < 1:
                raise UserError(f"--cuda-graph-sizes: {part!r} is not a positive integer; give batch sizes such "
                                "as '1 2 4 8 16'")
            sizes.append(int(part))
    if not sizes:
        raise UserError("--cuda-graph-sizes: give at least one batch size, e.g. '1 2 4 8 16'")
    return sorted(set(sizes))


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest capture size that holds `num_seqs` sequences; None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def decode_graph_mode(cfg: EngineConfig, device: torch.device, model_cfg: ModelConfig | None = None) -> str:
    """'capture', 'padded' (the padded forward without capture) or 'off', after `check_cuda_graphs`.

    Default: capture on CUDA with one device and a capturable model, else off."""
    if cfg.enforce_eager:
        return "off"
    if cfg.padded_decode:
        return "padded"
    if device.type != "cuda":
        return "off"
    if cfg.tensor_parallel > 1 and cfg.cuda_graph_sizes is None:
        log.info("tensor parallel: decode steps run eagerly (--cuda-graph-sizes captures graphs in every worker; "
                 "not yet measured on GPUs, so not the default)")
        return "off"
    reason = uncapturable(model_cfg)
    if reason is not None:
        log.info("%s: decode steps run eagerly", reason)
        return "off"
    if getattr(model_cfg, "kind", None) == "hybrid" and cfg.cuda_graph_sizes is None:
        log.info("hybrid model: decode steps run eagerly (--cuda-graph-sizes captures them; the Mamba decode step "
                 "is not yet measured under capture on GPUs, so not the default)")
        return "off"
    return "capture"


def has_moe_layers(model_cfg) -> bool:
    """Whether any layer routes tokens to experts (which groups them by expert on the host). A causal
    LM's moe config may leave every layer dense (DeepSeek's first_k_dense); a hybrid pattern places
    its MoE layers (E), and any moe section of it is taken as having them."""
    if getattr(model_cfg, "moe", None) is None:
        return False
    if not hasattr(model_cfg, "is_moe_layer"):
        return True
    return any(model_cfg.is_moe_layer(i) for i in range(model_cfg.num_layers))


def uncapturable(model_cfg: ModelConfig | None) -> str | None:
    """Why this model's decode forward cannot be captured (it reads values back on the host), or None."""
    if model_cfg is None:
        return None
    kind = getattr(model_cfg, "kind", "causal_lm")
    if kind not in ("causal_lm", "hybrid"):  # hybrid: its Mamba layers gather states by slot (state/runner.py)
        return f"model kind {kind!r} has no CUDA-graph decode path yet"
    if has_moe_layers(model_cfg):
        return "the mixture-of-experts layers group tokens by expert on the host (counts read back)"
    scaling = getattr(model_cfg, "rope_scaling", None)
    if scaling is not None and scaling.rope_type == "dynamic":
        return "dynamic RoPE scaling reads the longest position back on the host"
    return None


def check_cuda_graphs(cfg: EngineConfig, device: torch.device, model_cfg: ModelConfig | None = None) -> None:
    """Refuse, in one line, graph settings this engine cannot honour (before any weight loads;
    again with the model's config once it is known)."""
    if cfg.cuda_graph_sizes is None or cfg.padded_decode:  # the padded forward runs anywhere, uncaptured
        return
    if device.type != "cuda":
        raise UserError(f"--cuda-graph-sizes: CUDA graphs need a CUDA device, and this engine runs on {device.type}; "
                        "drop the flag")
    reason = uncapturable(model_cfg)
    if reason is not None:
        raise UserError(f"--cuda-graph-sizes: this model cannot be captured ({reason}); drop the flag")


@dataclass
class GraphSpec:
    """What a model runner needs to build its `DecodeGraphs` (sent as JSON to tensor-parallel workers)."""

    sizes: list[int]
    max_blocks: int  # block table width: max_model_len / block_size
    scratch_block: int  # the pool block padding rows write to (the pool's last; the BlockManager never has it)
    capture: bool  # False: the padded forward runs eagerly


class DecodeGraphs:
    """Bucket-padded decode forwards, replayed from CUDA graphs (capture=True) or run eagerly on the
    same static buffers (capture=False). `run(step)` is the forward replayed: the step's logits of
    every row (`step.logits_rows` None), [rows, vocab_rows] in the model's dtype (the runner's)."""

    def __init__(self, spec: GraphSpec, device: torch.device, block_size: int, vocab_rows: int,
                 run: Callable[[StepInputs], torch.Tensor]):
        self.run = run
        self.device = device
        self.block_size = block_size
        self.sizes = sorted(spec.sizes)
        self.scratch = spec.scratch_block
        self.max_blocks = spec.max_blocks
        self.capture = spec.capture
        self.replays: Counter[int] = Counter()  # bucket -> decode steps it served (replayed or padded eager)
        self.rows = 0  # the real rows of the last step served (a runner that reads more than logits: latent/)
        dev, biggest, bs = device, self.sizes[-1], block_size
        # Static inputs, sized for the largest bucket; a padding row is token 0 at position 0 whose
        # K/V go to the scratch block's first slot and whose table is the scratch block.
        self.ids = torch.zeros(3, biggest, dtype=torch.long, device=dev)  # tokens, positions, slots
        self.ids[2].fill_(self.scratch * bs)
        self.seq_lens = torch.ones(biggest, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((biggest, self.max_blocks), self.scratch, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(biggest + 1, dtype=torch.int32, device=dev)
        self.logits = torch.zeros(biggest, vocab_rows, dtype=torch.float32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.capture:
            self._capture_all()

    # ---- which steps ------------------------------------------------------------------------
    def bucket(self, batch: list[BatchSeq]) -> int | None:
        """The bucket this step replays, or None when it must run eagerly (not a pure decode step,
        or more sequences than the largest bucket)."""
        if not batch or any(len(s.tokens) != 1 or len(s.block_table) > self.max_blocks for s in batch):
            return None
        return bucket_for(len(batch), self.sizes)

    # ---- one step ---------------------------------------------------------------------------
    def prepare(self, batch: list[BatchSeq], size: int) -> None:
        """Copy the step's inputs into the static buffers, padding rows size - len(batch)."""
        bs, pad = self.block_size, size - len(batch)
        width = max(len(s.block_table) for s in batch)
        ids = torch.tensor([[s.tokens[0] for s in batch] + [0] * pad,
                            [s.start for s in batch] + [0] * pad,
                            [s.block_table[s.start // bs] * bs + s.start % bs for s in batch] + [self.scratch * bs] * pad])
        lens = torch.tensor([s.start + 1 for s in batch] + [1] * pad, dtype=torch.int32)
        # Columns past a table's own blocks keep earlier steps' values: no kernel reads past seq_len.
        tables = torch.tensor([s.block_table + [self.scratch] * (width - len(s.block_table)) for s in batch]
                              + [[self.scratch] * width] * pad, dtype=torch.int32)
        self.ids[:, :size].copy_(ids)
        self.seq_lens[:size].copy_(lens)
        self.block_tables[:size, :width].copy_(tables)

    def step_bucket(self, num_seqs: int, width: int) -> int | None:
        """The bucket of a single-token step (batch.DecodeBatch) of `num_seqs` rows whose tables are
        `width` blocks wide, or None when it must run eagerly."""
        return None if width > self.max_blocks else bucket_for(num_seqs, self.sizes)

    def prepare_step(self, step: StepInputs, size: int) -> None:
        """Copy a host-built single-token step into the static buffers, padding rows to `size`
        (one copy per buffer, as `prepare` makes from BatchSeqs)."""
        n, bs = step.seq_lens.shape[0], self.block_size
        width = step.block_tables.shape[1]
        on_host = step.tokens.device.type == "cpu"  # else sampled on the device by the step before (async scheduling)
        ids = torch.zeros(3, size, dtype=torch.long)
        if on_host:
            ids[0, :n] = step.tokens[0]
        ids[1, :n], ids[2, :n] = step.positions[0], step.slot_mapping
        ids[2, n:] = self.scratch * bs
        lens = torch.ones(size, dtype=torch.int32)
        lens[:n] = step.seq_lens
        tables = torch.full((size, width), self.scratch, dtype=torch.int32)
        tables[:n] = step.block_tables
        copy_in(self.ids[:, :size], ids)
        if not on_host:
            self.ids[0, :n].copy_(step.tokens[0])
        copy_in(self.seq_lens[:size], lens)
        copy_in(self.block_tables[:size, :width], tables)

    def forward_step(self, step: StepInputs, size: int) -> torch.Tensor:
        """fp32 logits of every row of a host-built single-token step, replayed in bucket `size`."""
        self.prepare_step(step, size)
        self._replay(size)
        self.rows = step.seq_lens.shape[0]
        return self.logits[:step.seq_lens.shape[0]].clone()  # a copy: the next step overwrites the buffer

    def _replay(self, size: int) -> None:
        if self.capture:
            self.graphs[size].replay()
        else:
            self._run(size)
        self.replays[size] += 1

    def forward(self, batch: list[BatchSeq], logits_rows: list[int]) -> torch.Tensor:
        """fp32 logits [len(logits_rows), vocab] of a pure decode batch that has a bucket."""
        size = self.bucket(batch)
        assert size is not None
        self.prepare(batch, size)
        self._replay(size)
        self.rows = len(batch)
        if len(logits_rows) == len(batch) and logits_rows == list(range(len(batch))):
            return self.logits[:len(batch)].clone()  # every row in order (no index to send the device)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=self.logits.device)
        return self.logits.index_select(0, rows)  # a copy: the next step overwrites the buffer

    def _run(self, size: int) -> None:
        """The padded forward over the first `size` rows of the static buffers: what is captured."""
        step = StepInputs(  # split None: every row through paged_attention, no host-side grouping
            tokens=self.ids[0:1, :size], positions=self.ids[1:2, :size], slot_mapping=self.ids[2, :size],
            block_tables=self.block_tables[:size], seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[:size + 1], logits_rows=None,
        )
        self.logits[:size].copy_(self.run(step))

    # ---- capture ----------------------------------------------------------------------------
    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Warm up (Triton compiles, cuBLAS picks its kernels) and capture every bucket, largest
        first, on one memory pool. The static buffers hold padding rows only, so capture writes
        nothing but the scratch block."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for size in reversed(self.sizes):
                self._run(size)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self._run(size)
            except Exception as exc:
                raise RuntimeError(f"capturing the decode step of batch size {size} as a CUDA graph failed "
                                   f"({type(exc).__name__}: {exc}); serve with --enforce-eager") from exc
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)
