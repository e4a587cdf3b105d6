"""Executes a step of an encoder-decoder (T5) over the paged cache of cache.py.

A step may mix sequences whose encoder runs now (their first step, or a recompute after preemption:
the encoder input padded into one batch, and every decoder layer's cross-attention keys/values
written once into the sequence's first P slots) with decoding sequences. Then one packed decoder
pass: each new decoder token's self-attention keys/values go to its slot, and attention gathers the
sequence's slots through its block table. T5's attention cannot use the paged kernel: the decoder's
self-attention adds a relative-position bias per (query, key) and neither attention scales by
1/sqrt(d); so keys/values are gathered into a padded [sequences, keys] batch and attended with SDPA
and an additive mask (bias, causality, padding) built once per step and shared by the layers.

Like ModelRunner, it reads the step's `BatchSeq`s and never changes anything else: a failed step
can be retried. Eager only (no CUDA graphs, no inductor). Under tensor parallel (executor.py) each
rank runs this runner over its shard (the kind's plan: heads, MLP, relative-bias tables by heads,
the shared embedding and head by vocabulary rows) and caches the keys/values of its heads; it is
sent what one process's runner reads (the new tokens, the block table, the prompt's length), and
rank 0 gathers the vocabulary slices for the driver to sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tessera.common.errors import UserError
from tessera.common.models.encoder_decoder.model import relative_bucket
from tessera.inference.sample.sampler import Sampler
from tessera.inference.worker.batch import BatchSeq, right_padded
from tessera.inference.worker.kv_cache import dequantize_kv, store_kv
from tessera.inference.worker.model_runner import ModelRunner, undivided


@dataclass
class _Step:
    """One step's decoder batch, packed ([T] rows) and padded ([S, Q] queries; keys as the [S, B]
    blocks gathered for each sequence, B x block_size key rows)."""

    tokens: torch.Tensor  # [1, T] decoder input ids
    slots: torch.Tensor  # [T] each new token's self-attention slot
    q_index: torch.Tensor  # [S, Q] row in the packed batch of each padded query (0 where padding)
    q_valid: torch.Tensor  # bool [S, Q]
    self_blocks: torch.Tensor  # [S, B] the blocks holding each sequence's decoder keys (0 where padding)
    self_mask: torch.Tensor  # [S, H, Q, B x block_size] additive: relative bias, causal and padding masks
    cross_blocks: torch.Tensor  # [S, B'] the blocks holding its encoder positions' keys
    cross_mask: torch.Tensor  # [S, 1, 1, B' x block_size] additive: padding


def tensor_parallel_problem(tp: int, cfg) -> str | None:
    """Why a T5 config cannot be served split over `tp` ranks (a phrase), or None: the plan
    (encoder_decoder/parallelize.py) splits the heads, the MLP width and the vocabulary (never
    padded: exports keep T5's own row count)."""
    return undivided(tp, [("attention heads", cfg.num_heads), ("MLP width (d_ff)", cfg.d_ff),
                          ("vocabulary rows", cfg.vocab_size)])


class EncoderDecoderRunner(ModelRunner):
    eager_reason = "an encoder-decoder's step runs eagerly (its attention gathers paged keys with T5's position bias)"
    supports_speculative = False
    speculative_refusal = "not built for an encoder-decoder's runner"
    scores_prompts = False  # the prompt is the encoder's input: nothing predicts its tokens
    # Without --max-model-len: T5's pretraining input length (what vLLM takes from n_positions); its
    # relative positions take any length, so --max-model-len may raise it.
    default_max_model_len = 512
    tensor_parallel_problem = staticmethod(tensor_parallel_problem)  # the loader asks, through kinds.py

    @staticmethod
    def block_bytes(cfg, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
        """Bytes of one block on one rank: every decoder layer's K and V of its heads (self- or
        cross-attention share a slot's size)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_decoder_layers * block_size * (cfg.num_heads // tp) * cfg.d_kv * itemsize

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1, kv_dtype: torch.dtype | None = None):
        cfg = model.cfg
        self.model, self.cfg, self.device, self.dtype = model, cfg, device, dtype
        self.block_size, self.num_blocks = block_size, num_blocks
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.heads = cfg.num_heads // tp_size  # this rank's (the plan splits heads and the bias table by them)
        self.kv = torch.zeros(cfg.num_decoder_layers, 2, num_blocks * block_size, self.heads, cfg.d_kv,
                              device=device, dtype=kv_dtype or dtype)
        self.kv_scales = (1.0, 1.0)
        self.sampler = Sampler()

    def use_decode_graphs(self, spec) -> None:
        raise UserError("--padded-decode: an encoder-decoder's decode step has no padded (CUDA-graph) forward; drop "
                        "the flag")

    def forward_batch(self, batch: list[BatchSeq], logits_rows: list[int]) -> torch.Tensor:
        """fp32 logits for `logits_rows` (rows of the packed new tokens, as ModelRunner.execute counts
        them: the last row of a sequence is its newest decoder token); under tensor parallel this
        rank's vocabulary slice. A sequence's known tokens are its prompt then its outputs, so position
        p >= P - 1 feeds decoder position d = p - P + 1 the token at p (d = 0: the start token), and a
        first step (start 0) carries the whole prompt: all a tensor-parallel worker is sent."""
        bs = self.block_size
        start_id = self.cfg.decoder_start_token_id
        enc_seqs: list[tuple[list[int], list[int]]] = []  # (prompt, table) of sequences whose encoder runs now
        tokens: list[int] = []
        slots: list[int] = []
        spans: list[tuple[int, int, int, list[int]]] = []  # (P, first decoder position, count, table)
        row_map: dict[int, int] = {}  # plan row -> decoder row
        plan_row = 0
        for b in batch:
            p, table = b.prompt_len, b.block_table
            if b.start == 0:
                enc_seqs.append((b.tokens[:p], table))
            d0, d1 = max(0, b.start - p + 1), b.start + b.num_new - p + 1
            for d in range(d0, d1):
                row = p - 1 + d - b.start
                row_map[plan_row + row] = len(tokens)
                tokens.append(start_id if d == 0 else b.tokens[row])
                slot = p + d
                slots.append(table[slot // bs] * bs + slot % bs)
            spans.append((p, d0, d1 - d0, table))
            plan_row += b.num_new
        with torch.inference_mode():
            if enc_seqs:
                self._encode(enc_seqs)
            step = self._step(tokens, slots, spans)
            hidden = self._decode(step)
            rows = torch.tensor([row_map[r] for r in logits_rows], dtype=torch.long, device=self.device)
            return self.model.head(hidden.index_select(0, rows)).float()

    def _slots(self, table: list[int], first: int, count: int) -> list[int]:
        bs = self.block_size
        return [table[i // bs] * bs + i % bs for i in range(first, first + count)]

    def _encode(self, seqs: list[tuple[list[int], list[int]]]) -> None:
        """The encoder over the new sequences' prompts (right-padded), then each decoder layer's
        cross-attention K/V of every real position into the sequence's first slots."""
        ids, mask = right_padded([prompt for prompt, _ in seqs], self.device)
        enc = self.model.encode(ids, mask.long() if len(seqs) > 1 else None)
        rows = enc[mask]  # [sum P, d]: real positions only, in sequence order
        slots = torch.tensor([s for prompt, table in seqs for s in self._slots(table, 0, len(prompt))],
                             dtype=torch.long, device=self.device)
        h, d = self.heads, self.cfg.d_kv
        for layer, blk in enumerate(self.model.decoder.blocks):
            _, k, v = blk.cross_attn.project(rows[None])
            store_kv(self.kv[layer, 0], slots, k[0].view(-1, h, d), self.kv_scales[0])
            store_kv(self.kv[layer, 1], slots, v[0].view(-1, h, d), self.kv_scales[1])

    def _step(self, tokens: list[int], slots: list[int], spans: list[tuple[int, int, int, list[int]]]) -> _Step:
        """Queries padded per sequence; keys gathered by whole blocks (a few large copies rather than
        one per slot): the decoder's start at slot P, P % block_size into its first block."""
        dev, bs = self.device, self.block_size
        s_count = len(spans)
        num_q = max(n for _, _, n, _ in spans)
        self_nb = max(-(-(p % bs + d0 + n) // bs) for p, d0, n, _ in spans)
        cross_nb = max(-(-p // bs) for p, _, _, _ in spans)
        q_index = torch.zeros(s_count, num_q, dtype=torch.long)
        q_valid = torch.zeros(s_count, num_q, dtype=torch.bool)
        q_pos = torch.zeros(s_count, num_q, dtype=torch.long)
        offset = torch.zeros(s_count, 1, 1, dtype=torch.long)
        self_blocks = torch.zeros(s_count, self_nb, dtype=torch.long)
        cross_blocks = torch.zeros(s_count, cross_nb, dtype=torch.long)
        p_len = torch.zeros(s_count, 1, dtype=torch.long)
        row = 0
        for i, (p, d0, n, table) in enumerate(spans):
            q_index[i, :n] = torch.arange(row, row + n)
            q_valid[i, :n] = True
            q_pos[i, :n] = torch.arange(d0, d0 + n)
            offset[i] = p % bs
            own = table[p // bs:-(-(p + d0 + n) // bs)]
            self_blocks[i, :len(own)] = torch.tensor(own)
            cross = table[:-(-p // bs)]
            cross_blocks[i, :len(cross)] = torch.tensor(cross)
            p_len[i] = p
            row += n
        k_pos = torch.arange(self_nb * bs)[None, None, :] - offset  # [S, 1, K]: decoder position of each key row
        rel = k_pos - q_pos[:, :, None]  # [S, Q, K]
        buckets = relative_bucket(rel, False, self.cfg.relative_attention_num_buckets,
                                  self.cfg.relative_attention_max_distance).to(dev)
        bias = self.model.decoder.relative_attention_bias(buckets).permute(0, 3, 1, 2).to(self.dtype)  # [S, H, Q, K]
        allowed = (k_pos >= 0) & (rel <= 0)
        neg = torch.finfo(self.dtype).min
        self_mask = bias.masked_fill(~allowed[:, None].to(dev), neg)
        cross_mask = torch.zeros(s_count, 1, 1, cross_nb * bs, dtype=self.dtype).masked_fill(
            (torch.arange(cross_nb * bs)[None, :] >= p_len)[:, None, None, :], neg)
        return _Step(tokens=torch.tensor([tokens], dtype=torch.long, device=dev),
                     slots=torch.tensor(slots, dtype=torch.long, device=dev), q_index=q_index.to(dev),
                     q_valid=q_valid.to(dev), self_blocks=self_blocks.to(dev), self_mask=self_mask,
                     cross_blocks=cross_blocks.to(dev), cross_mask=cross_mask.to(dev))

    def _attend(self, step: _Step, q: torch.Tensor, layer: int, blocks: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] packed -> [T, H, D]: each sequence's queries over the keys/values of its blocks."""
        s_count, shape = blocks.shape[0], (self.num_blocks, self.block_size, *self.kv.shape[-2:])
        k = self.kv[layer, 0].view(shape).index_select(0, blocks.view(-1)).view(s_count, -1, *shape[-2:])
        v = self.kv[layer, 1].view(shape).index_select(0, blocks.view(-1)).view(s_count, -1, *shape[-2:])
        k, v = dequantize_kv(k, q.dtype, self.kv_scales[0]), dequantize_kv(v, q.dtype, self.kv_scales[1])
        qs = q[step.q_index]  # [S, Q, H, D]
        out = F.scaled_dot_product_attention(qs.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=1.0)
        return out.transpose(1, 2)[step.q_valid]

    def _decode(self, step: _Step) -> torch.Tensor:
        """The decoder over the step's new tokens: final-normed hidden states [T, d]."""
        h, d = self.heads, self.cfg.d_kv
        x = self.model.shared(step.tokens)

        def self_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            store_kv(self.kv[layer, 0], step.slots, k[0], self.kv_scales[0])
            store_kv(self.kv[layer, 1], step.slots, v[0], self.kv_scales[1])
            return self._attend(step, q[0], layer, step.self_blocks, step.self_mask)[None]

        for layer, blk in enumerate(self.model.decoder.blocks):
            x = x + blk.self_attn(blk.self_norm(x), None, attention_fn=self_attention)
            a = blk.cross_attn
            q = a.project(blk.cross_norm(x))[0].view(-1, h, d)
            x = x + a.o_proj(self._attend(step, q, layer, step.cross_blocks, step.cross_mask).reshape(1, -1, h * d))
            x = x + blk.mlp(blk.mlp_norm(x))
        return self.model.decoder.final_norm(x)[0]
