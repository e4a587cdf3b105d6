"""Executes one step's plan (`scheduler.SchedulerOutput`) through the model and samples:
packs every scheduled sequence's new tokens into a single [1, T] batch, writes their
keys/values into the paged cache, attends over it, and returns a `ModelRunnerOutput` (sampled
token ids, logprobs, prompt logprobs). It reads the sequences and never changes them; the output
processor applies the results. So a failed execution leaves nothing half-applied and can be
retried (the KV slots it wrote are rewritten with the same values).

Sliding-window layers (Mistral, Qwen) pass their window to every attention path; blocks wholly
outside every window stay allocated for now (correct, not yet economical).

The shared model is used as is, through its two hooks: `positions` (each token's position in its
own sequence) and `attention_fn`, which here scatters the new K/V into their cache slots and calls
`tessera.kernels.paged_attention` (Triton on CUDA, the PyTorch reference on CPU). On CPU the
reference handles one sequence per call, which makes a 32-sequence decode step 32 x layers tiny
SDPA calls; there, single-token (decode) sequences, and speculative rows (by equal length),
instead go through `decode_attention` in groups of up to 8 of similar length (one gather + one SDPA per group, tested against the
reference; the groups and their masks are formed once per step, not per layer; a layer takes the
rows in group order with one index_select and returns them with another) and only prefill chunks
use the reference. Only the rows
that are sampled (the last token of each sequence that finished its prompt, and prompt positions
of requests that asked for prompt logprobs) go through the output head.

Speculative decoding: a sequence scheduled with draft tokens computes its newest token and the k
drafts in one row of 1 + k tokens (through the prefill path, which is causal within the row);
its k + 1 logits rows go to `sampler.verify`, which accepts a prefix of the drafts and adds one
token. The K/V written for rejected drafts stay in slots past the sequence's computed length,
where nothing reads them, until later tokens overwrite them (the output processor rolls the
computed length back and returns blocks that only held rejected drafts).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tessera.common.errors import UserError
from tessera.common.model import Transformer
from tessera.common.model_config import ModelConfig
from tessera.inference.core.scheduler import SchedulerOutput
from tessera.inference.core.sequence import TokenLogprob
from tessera.inference.sample.sampler import Sampler, token_logprob, verify
from tessera.kernels import paged_attention

if TYPE_CHECKING:
    from tessera.inference.worker.compiled import CompiledForward
    from tessera.inference.worker.cuda_graphs import DecodeGraphs

log = logging.getLogger("tessera.inference")


# --kv-cache-dtype (vLLM's names) -> storage dtype; "auto" stores the model's dtype. fp8 keys and
# values are stored as x / scale, clamped to the format's largest finite value (a cast of a larger
# number would give NaN in e4m3fn, inf in e5m2), and read back as stored * scale in the model's
# dtype inside attention, so only the cache is fp8. The scale is per tensor (one for all keys, one
# for all values): 1.0, vLLM's default without --calculate-kv-scales, since no checkpoint this
# engine reads carries KV scales. Activations of the models served here are far inside e4m3's
# range (|x| <= 448); its 3 mantissa bits give a relative rounding error of at most 2^-4 per value.
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Storage dtype of the KV cache for --kv-cache-dtype `name` and model dtype `dtype`; refuses
    (one line) e4m3 on a GPU whose Triton has no e4m3 conversions (before compute capability 8.9)."""
    if name == "auto":
        return dtype
    kv = KV_CACHE_DTYPES[name]
    if kv == torch.float8_e4m3fn and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise UserError(f"--kv-cache-dtype {name}: float8_e4m3fn needs a GPU of compute capability 8.9 or newer "
                        f"(this one: {'.'.join(map(str, torch.cuda.get_device_capability(device)))}); use "
                        "--kv-cache-dtype fp8_e5m2 or auto")
    return kv


def local_kv_heads(cfg: ModelConfig, tp: int = 1) -> int:
    """Key/value heads one tensor rank holds: its 1/tp share, or one when tp > kv_heads (each head
    is then replicated on tp / kv_heads ranks, executor.py)."""
    return max(1, cfg.kv_heads // tp)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
    """Bytes one block takes across all layers (K and V) on one tensor rank, stored in `dtype`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * local_kv_heads(cfg, tp) * cfg.head_dim * itemsize


def store_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float = 1.0) -> None:
    """cache[slots] = x in the cache's storage dtype: a plain cast, or for fp8 x / scale clamped to
    the format (written through a uint8 view: PyTorch's CPU index_copy_ has no fp8 kernel)."""
    if cache.dtype == x.dtype:
        cache.index_copy_(0, slots, x)
        return
    if cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        cache.index_copy_(0, slots, x.to(cache.dtype))
        return
    if scale != 1.0:
        x = x.float() / scale
    fmax = torch.finfo(cache.dtype).max
    cache.view(torch.uint8).index_copy_(0, slots, x.clamp(-fmax, fmax).to(cache.dtype).view(torch.uint8))


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached keys or values (a gathered window) back in the compute dtype `dtype`."""
    if x.dtype == dtype:
        return x
    return x.to(dtype) if scale == 1.0 else (x.float() * scale).to(dtype)


# Decode sequences per gather + SDPA call. Sorted by length and taken 8 at a time, each group's
# window is only as wide as its own longest sequence, and its K/V copy (8 x window x heads x dim)
# stays in cache for SDPA: on a 2-core CPU, llama-20m, 32 sequences of 20-190 tokens, one call
# for all took 4.8-15.8 ms per layer (the strided SDPA over a 19 MB window thrashes), groups of
# 8 took 1.5-1.8 ms.
DECODE_GROUP = 8


@dataclass
class DecodeGroup:
    """Decode sequences attended in one call: their packed rows and their gathered window. Each
    has `num_q` new tokens (1; with speculative decoding 1 + k: its newest token and k drafts)."""

    rows: torch.Tensor  # long [S * num_q]: rows of the packed batch, sequence by sequence
    blocks: torch.Tensor  # long [S * width]: pool blocks, row-major by sequence
    width: int  # blocks per sequence in the window
    block_size: int  # slots per block: the window is width * block_size positions
    seq_lens: torch.Tensor  # [S]: tokens in the cache, the new ones included
    num_q: int = 1
    # Additive float masks (0 visible, -inf not), built by the first layer that needs one and
    # shared by the rest of the step: key (sliding window, query heads per KV head, dtype).
    masks: dict[tuple[int | None, int, torch.dtype], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        return self.rows.numel()

    def mask(self, window: int | None, heads_per_kv: int, dtype: torch.dtype) -> torch.Tensor:
        """[S, 1, num_q * heads_per_kv (1 when num_q is 1), width * block_size]: the cached positions
        each query sees. Query i of a sequence sits at position seq_len - num_q + i and sees positions up
        to its own (with a sliding window only the last `window` of them); the rest of the window is
        padding. Queries are folded as `decode_attention` folds them (t * heads_per_kv + g)."""
        key = (window, heads_per_kv, dtype)
        mask = self.masks.get(key)
        if mask is None:
            dev = self.seq_lens.device
            last = self.seq_lens[:, None] - self.num_q + torch.arange(self.num_q, device=dev)[None, :]
            pos = torch.arange(self.width * self.block_size, device=dev)
            visible = pos <= last[:, :, None]
            if window is not None:
                visible &= pos > (last - window)[:, :, None]
            if self.num_q > 1:
                visible = visible.repeat_interleave(heads_per_kv, dim=1)
            mask = torch.zeros(visible.shape, dtype=dtype, device=dev).masked_fill_(~visible, float("-inf"))
            mask = self.masks[key] = mask[:, None]
        return mask


def decode_group(rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                 num_q: int = 1) -> DecodeGroup:
    width = -(-int(seq_lens.max()) // block_size)
    blocks = block_tables[:, :width].reshape(-1).long()
    return DecodeGroup(rows=rows.reshape(-1), blocks=blocks, width=width, block_size=block_size, seq_lens=seq_lens,
                       num_q=num_q)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
                     scale: float, sliding_window: int | None = None,
                     kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Attention of the new tokens of each sequence over its cached keys/values (a group at once).

    q [S * num_q, H, D]; caches [blocks, block_size, Hkv, D]. Gathers each sequence's blocks into
    a padded [S, width*block_size] window (index_select on the flat block list is ~3x faster on CPU
    than advanced indexing by the table) and masks the padding and, for several new tokens, the
    positions after each, and with a sliding `window` the positions more than `sliding_window`
    before each (`DecodeGroup.mask`, once per step). An fp8 cache is dequantized (`kv_scales`: the
    K and V scales) after the gather, so only the window is converted. Returns [S * num_q, H, D].

    Grouped-query heads are folded into the query length: the H / Hkv query heads that share a KV
    head attend as H / Hkv queries of one head ([S, Hkv, num_q * H/Hkv, D] against [S, Hkv, W, D]),
    so SDPA's CPU flash kernel reads each K/V block once for all of them. Measured (issue #18;
    llama-25m shapes: 8 query / 2 KV heads x 64, blocks of 16, a group of 8 sequences, context
    64/256/512, 1 thread, A/B alternating in one process on the loaded 2-core CPU, ratio of
    medians; results equal to 3e-7..7e-7): 0.56x / 0.60x / 0.58x of the previous path
    (SDPA with enable_gqa and a bool mask); SDPA alone 0.53x, and the float mask saves the two
    `where` SDPA ran per call to convert a bool one. With the masks made once per step and the
    rows reordered once per layer (`DecodeSplit`), the whole decode forward (llama-25m, merged
    and oneDNN-packed as served; 8 / 32 / 64 sequences at context 64-128 and 256-512; thread CPU
    time, so the load's descheduling drops out; A/B alternating in one process, median of 40 pair
    ratios; an A/A run read 0.99x-1.01x) took 0.94x / 0.86x, 0.92x / 0.87x and 0.93x / 0.90x of
    the previous code's, logits within 1.7e-6 (normwise). Rejected: gathering K and V with one
    index_select over the layer's [2, blocks, ...] pool (0.92x at 8 sequences, context 64, but 2x
    the time of two gathers at 64 sequences, context 256-512: the K and V windows then sit a
    power of two apart and SDPA's paired reads of them conflict in cache).

    Reading K/V in place instead of this gather was measured and rejected (issue #18; llama-25m
    decode shapes: 8 query / 2 KV heads x 64, blocks of 16, batch 8/32/64, context 64-512, groups of
    8, 1 thread, A/B alternating in one process on the 2-core CPU while shared by 7 agents, ratio of
    medians; results equal to 3e-7..6e-7):
    - per-block SDPA with an online-softmax merge (one S-block index_select, two matmuls and the
      running max/sum per block column): 2.1x-3.7x this path's time, from the ops per block column;
    - an inductor-compiled kernel that fuses the gather into its reductions (indirect loads from the
      pool, no copy): 0.63x-1.49x, no consistent gain, and 1-4 minutes of compiling per new shape
      class at startup.
    The gather is 5-8% of a step (benchmarks/serving_profile.py); a C++ paged kernel is the way to it.
    """
    _, num_heads, head_dim = q.shape
    num_seqs, num_q = group.seq_lens.shape[0], group.num_q
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    window = group.width * block_size
    k = k_cache.index_select(0, group.blocks).view(num_seqs, window, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, group.blocks).view(num_seqs, window, num_kv_heads, head_dim).transpose(1, 2)
    k, v = dequantize_kv(k, q.dtype, kv_scales[0]), dequantize_kv(v, q.dtype, kv_scales[1])
    assert block_size == group.block_size, (block_size, group.block_size)
    mask = group.mask(sliding_window, per_kv, q.dtype)
    if num_q == 1:
        out = F.scaled_dot_product_attention(q.view(num_seqs, num_kv_heads, per_kv, head_dim), k, v,
                                             attn_mask=mask, scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim)
    # Query t of a sequence, head kv * per_kv + g -> query t * per_kv + g of KV head kv.
    q = q.view(num_seqs, num_q, num_kv_heads, per_kv, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.reshape(num_seqs, num_kv_heads, num_q * per_kv, head_dim), k, v,
                                         attn_mask=mask, scale=scale)
    out = out.view(num_seqs, num_kv_heads, num_q, per_kv, head_dim).transpose(1, 2)
    return out.reshape(num_seqs * num_q, num_heads, head_dim)


def batched_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`decode_attention` for sequences given by their tables [S, >= W] and lengths [S] (the new
    token included, its K/V already written), in groups of DECODE_GROUP sorted by length."""
    out = torch.empty_like(q)
    for group in decode_groups(block_tables, seq_lens, k_cache.shape[1], torch.arange(q.shape[0], device=q.device)):
        out[group.rows] = decode_attention(q[group.rows], k_cache, v_cache, group, scale)
    return out


def decode_groups(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                  rows: torch.Tensor, num_q: int = 1) -> list[DecodeGroup]:
    """Split decode sequences into groups of DECODE_GROUP by ascending length; rows [S] or
    [S, num_q] (each sequence's new tokens). Up to DECODE_GROUP sequences are one group, in their
    order (the window is as wide as the longest either way)."""
    if seq_lens.shape[0] <= DECODE_GROUP:
        return [decode_group(rows, block_tables, seq_lens, block_size, num_q)]
    order = torch.argsort(seq_lens, stable=True)
    return [decode_group(rows[idx], block_tables[idx], seq_lens[idx], block_size, num_q)
            for idx in order.split(DECODE_GROUP)]


@dataclass
class DecodeSplit:
    """Which packed rows are decode tokens (grouped path) and which are prefill chunks (kernel).

    Attention takes the rows in `order` (each decode group's rows, group by group, then the
    prefill rows), so each group's queries are one slice, and its output goes back to the packed
    order through `inverse`; both None when `order` is the packed order itself (one group, in
    order, before any prefill row): one index_select each way per layer in place of an index
    and an index_put per group."""

    decode_groups: list[DecodeGroup]
    prefill_tables: torch.Tensor
    prefill_lens: torch.Tensor
    prefill_starts: torch.Tensor
    order: torch.Tensor | None = None
    inverse: torch.Tensor | None = None


@dataclass
class ModelRunnerOutput:
    """What one executed plan produced, by request id."""

    # The new tokens of each sequence that sampled: one, or with speculation the accepted drafts
    # and one more.
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # for those that asked, per token
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # new prompt positions
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its computation failed

    def update(self, other: ModelRunnerOutput) -> None:
        for mine, theirs in ((self.sampled, other.sampled), (self.logprobs, other.logprobs),
                             (self.prompt_logprobs, other.prompt_logprobs), (self.failed, other.failed)):
            mine.update(theirs)


@dataclass
class StepInputs:
    tokens: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    slot_mapping: torch.Tensor  # [T] flat slot of each new token in the pool
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    logits_rows: torch.Tensor  # [R] rows of the packed batch that go through the head
    split: DecodeSplit | None = None  # CPU only, when the step has a decode row


@dataclass
class BatchSeq:
    """What the forward needs of one scheduled sequence (all a tensor-parallel worker is sent):
    its new tokens, the position of the first, its block table, and `num_q`: its new tokens when
    it decodes (1, or 1 + k drafts), 0 for a prefill chunk."""

    tokens: list[int]
    start: int
    block_table: list[int]
    num_q: int

    @property
    def num_new(self) -> int:
        return len(self.tokens)


def batch_seqs(plan: SchedulerOutput) -> list[BatchSeq]:
    return [BatchSeq(s.tokens(), s.start, s.block_table, s.num_new if s.num_new == 1 or s.spec_token_ids else 0)
            for s in plan.scheduled]


class ModelRunner:
    """Executes plans on one device (`forward`); under tensor parallel the engine uses
    `executor.TensorParallelRunner`, which keeps `execute` (sampling on the driver) and sends
    `forward` to the workers, each of which runs a ModelRunner over its shard."""

    # Pure decode steps go through bucket-padded CUDA graphs when the engine sets this
    # (cuda_graphs.py); everything else runs eagerly below.
    decode_graphs: DecodeGraphs | None = None
    # On CPU the layer stack runs through inductor when the engine sets this (compiled.py).
    compiled: CompiledForward | None = None
    # (the pool, per layer its K/V views): `_layer_kv`, rebuilt when the pool is replaced.
    _kv_views: tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]] | None = None

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1, kv_dtype: torch.dtype | None = None):
        cfg = model.cfg
        self.model = model
        self.cfg = cfg
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # One allocation for the whole pool: [layer, K/V, block, slot, kv_head, head_dim]; under
        # tensor parallel this rank's key/value heads only (those of its query heads), stored in
        # `kv_dtype` (default: the model's; fp8 with --kv-cache-dtype) with per-tensor K and V scales.
        self.kv = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, local_kv_heads(cfg, tp_size), cfg.head_dim,
                              device=device, dtype=kv_dtype or dtype)
        self.kv_scales = (1.0, 1.0)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self._step: StepInputs | None = None
        # The Triton kernel handles mixed batches in one launch; only CPU needs the split.
        self.batch_decodes = device.type == "cpu"
        self.sampler = Sampler()

    def _layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of one layer's pools, made once per pool rather than once per layer and step:
        K and V [blocks, block_size, Hkv, D] and the same as [slots, Hkv, D]. Made outside inference
        mode: a view made inside it could not be written outside it (a forward without it)."""
        views = self._kv_views
        if views is None or views[0] is not self.kv:
            layers = []
            with torch.inference_mode(False):
                for kv in self.kv:
                    k, v = kv[0], kv[1]
                    layers.append((k, v, k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])))
            views = self._kv_views = (self.kv, layers)
        return views[1][layer]

    def _attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        step = self._step
        assert step is not None
        k_cache, v_cache, flat_k, flat_v = self._layer_kv(layer)
        k_scale, v_scale = self.kv_scales
        store_kv(flat_k, step.slot_mapping, k[0], k_scale)
        store_kv(flat_v, step.slot_mapping, v[0], v_scale)
        split = step.split
        window = self.cfg.window(layer)
        if split is None:
            out = paged_attention(q[0], k_cache, v_cache, step.block_tables, step.seq_lens,
                                  step.query_start_loc, self.scale, window, k_scale=k_scale, v_scale=v_scale)
            return out.unsqueeze(0)
        q = q[0] if split.order is None else q[0].index_select(0, split.order)
        outs = []
        start = 0
        for group in split.decode_groups:
            end = start + group.num_rows
            outs.append(decode_attention(q[start:end], k_cache, v_cache, group, self.scale, window, self.kv_scales))
            start = end
        if start < q.shape[0]:
            outs.append(paged_attention(q[start:], k_cache, v_cache, split.prefill_tables, split.prefill_lens,
                                        split.prefill_starts, self.scale, window, k_scale=k_scale, v_scale=v_scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if split.inverse is not None:
            out = out.index_select(0, split.inverse)
        return out.unsqueeze(0)

    def _split(self, num_q: list[int], starts: list[int], tables: torch.Tensor, lens: torch.Tensor) -> DecodeSplit:
        """num_q: per sequence, its new tokens when it decodes (1, or 1 + k drafts), else 0."""
        dev = self.device
        pre = [i for i, n in enumerate(num_q) if n == 0]
        pre_rows: list[int] = []
        pre_starts = [0]
        for i in pre:
            pre_rows.extend(range(starts[i], starts[i + 1]))
            pre_starts.append(len(pre_rows))
        groups: list[DecodeGroup] = []
        for q_len in sorted(set(num_q) - {0}):  # speculative rows of equal length go together
            dec = [i for i, n in enumerate(num_q) if n == q_len]
            dec_t = torch.tensor(dec, dtype=torch.long, device=dev)
            rows = torch.tensor([list(range(starts[i], starts[i] + q_len)) for i in dec], dtype=torch.long, device=dev)
            groups.extend(decode_groups(tables[dec_t], lens[dec_t], self.block_size, rows, q_len))
        pre_t = torch.tensor(pre, dtype=torch.long, device=dev)
        order = torch.cat([g.rows for g in groups] + [torch.tensor(pre_rows, dtype=torch.long, device=dev)])
        identity = torch.arange(order.shape[0], device=dev)
        inverse = None
        if torch.equal(order, identity):
            order = None
        else:
            inverse = torch.empty_like(order)
            inverse[order] = identity
        return DecodeSplit(
            decode_groups=groups,
            prefill_tables=tables[pre_t], prefill_lens=lens[pre_t],
            prefill_starts=torch.tensor(pre_starts, dtype=torch.int32, device=dev),
            order=order, inverse=inverse,
        )

    def prepare(self, batch: list[BatchSeq], logits_rows: list[int]) -> StepInputs:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        bs = self.block_size
        for s in batch:
            start, n, table = s.start, s.num_new, s.block_table
            tokens.extend(s.tokens)
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            seq_lens.append(start + n)
            starts.append(starts[-1] + n)
        width = max(len(s.block_table) for s in batch)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch]
        dev = self.device
        inputs = StepInputs(
            tokens=torch.tensor([tokens], dtype=torch.long, device=dev),
            positions=torch.tensor([positions], dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=dev),
        )
        num_q = [s.num_q for s in batch]
        if self.batch_decodes and any(num_q):
            inputs.split = self._split(num_q, starts, inputs.block_tables, inputs.seq_lens)
        return inputs

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the plan, then sample each sequence that reached its last token and compute
        the prompt logprobs asked for."""
        rows: list[int] = []
        sample: list[tuple[int, int]] = []  # (index in plan, logits row)
        prompt_lp: list[tuple[int, int, int, int]] = []  # (index in plan, first position, last, first row)
        speculative: list[tuple[int, int]] = []  # (index in plan, first of its k + 1 logits rows)
        offset = 0
        for i, s in enumerate(plan.scheduled):
            seq = s.seq
            if seq.params.prompt_logprobs:
                # Position p predicts prompt token p+1; record each position once (recompute
                # after preemption must not duplicate).
                first = max(s.start, len(seq.prompt_logprobs))
                last = min(s.end, len(seq.prompt_ids) - 1)
                if first < last:
                    prompt_lp.append((i, first, last, len(rows)))
                    rows.extend(range(offset + first - s.start, offset + last - s.start))
            if s.spec_token_ids:
                k = len(s.spec_token_ids)
                speculative.append((i, len(rows)))
                rows.extend(range(offset + s.num_new - k - 1, offset + s.num_new))
            elif s.completes_prompt and seq.params.max_tokens > 0:
                sample.append((i, len(rows)))
                rows.append(offset + s.num_new - 1)
            offset += s.num_new
        out = ModelRunnerOutput()
        logits = self.forward(plan, rows)
        if prompt_lp:
            logprobs = torch.log_softmax(logits, dim=-1)
            for i, first, last, row in prompt_lp:
                seq = plan.scheduled[i].seq
                out.prompt_logprobs[seq.request_id] = [
                    token_logprob(logprobs[row + p - first], seq.prompt_ids[p + 1], seq.params.logprobs or 0)
                    for p in range(first, last)]
        if sample:
            seqs = [plan.scheduled[i].seq for i, _ in sample]
            tokens, lps, failed = self.sampler(seqs, logits[[r for _, r in sample]])
            for j, seq in enumerate(seqs):
                if j in failed:
                    log.error("request %s: sampling failed: %s: %s", seq.request_id, type(failed[j]).__name__, failed[j])
                    out.failed[seq.request_id] = "internal error while sampling this request"
                    continue
                out.sampled[seq.request_id] = [tokens[j]]
                if lps[j] is not None:
                    out.logprobs[seq.request_id] = [lps[j]]
        for i, row in speculative:
            s = plan.scheduled[i]
            seq = s.seq
            block = logits[row:row + len(s.spec_token_ids) + 1]
            try:
                new = verify(seq, s.spec_token_ids, s.spec_probs, block)
            except Exception as exc:
                log.error("request %s: verifying draft tokens failed: %s: %s", seq.request_id, type(exc).__name__, exc)
                out.failed[seq.request_id] = "internal error while sampling this request"
                continue
            out.sampled[seq.request_id] = new
            if seq.params.logprobs is not None:
                lp = torch.log_softmax(block[:len(new)], dim=-1)
                out.logprobs[seq.request_id] = [token_logprob(lp[j], t, seq.params.logprobs) for j, t in enumerate(new)]
        return out

    def forward(self, plan: SchedulerOutput, logits_rows: list[int]) -> torch.Tensor:
        """Forward the step; returns fp32 logits [len(logits_rows), vocab]."""
        return self.forward_batch(batch_seqs(plan), logits_rows)

    def forward_batch(self, batch: list[BatchSeq], logits_rows: list[int]) -> torch.Tensor:
        """fp32 logits [len(logits_rows), vocab rows]; under tensor parallel this rank's vocabulary
        slice [len(logits_rows), vocab rows / tp] (the worker gathers them)."""
        if self.decode_graphs is not None and self.decode_graphs.bucket(batch) is not None:
            return self.decode_graphs.forward(batch, logits_rows)  # pure decode: padded, replayed
        self._step = self.prepare(batch, logits_rows)
        try:
            if self.compiled is not None:
                hidden = self.compiled(self, self._step.tokens, self._step.positions)
            else:
                hidden = self.model(self._step.tokens, positions=self._step.positions,
                                    attention_fn=self._attention, return_hidden=True)
        finally:
            step, self._step = self._step, None
        rows = hidden[0].index_select(0, step.logits_rows)
        weight = self.model.output_weight()
        # Padded vocabulary rows at -inf: never sampled.
        return self.model.logits(rows, weight, vocab_start=self.tp_rank * weight.shape[0]).float()
