"""T5 (transformers' `T5ForConditionalGeneration`) on Tessera's shared layers: the self-attention
and MLP of every kind (`Attention`, `MLP`), RMS norm without mean or bias (`RMSNorm`), attention
through `BidirectionalAttention` with T5's relative position bias and no 1/sqrt(d) scaling (T5
folds it into the init). Each stack keeps one relative-bias table (transformers keeps it on the
stack's first layer and shares it; the HF adapter maps the name). Cross-attention is the shared
attention layer's projections over the encoder's output (`T5Block.cross`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.common.layers.attention import BidirectionalAttention
from tessera.common.layers.mlp import MLP
from tessera.common.layers.norms import RMSNorm
from tessera.common.layers.self_attention import Attention
from tessera.common.models.build import build_on_meta
from tessera.common.models.encoder_decoder.config import T5Config

# Parameters with one row per vocabulary entry (split by vocabulary rows under tensor parallel).
VOCAB_PARAMS = ("shared.weight", "lm_head.weight")


def relative_bucket(rel: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of each (key - query) offset: exact for small offsets, log-spaced up to max_distance."""
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets += (rel > 0).long() * num_buckets
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    exact = num_buckets // 2
    small = rel < exact
    large = exact + (torch.log(rel.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(small, rel, large)


class T5Block(nn.Module):
    def __init__(self, cfg: T5Config, decoder: bool, index: int):
        super().__init__()
        lc, eps = cfg.layer_config(), cfg.layer_norm_epsilon
        self.self_attn = Attention(lc, index, causal=decoder)
        self.self_norm = RMSNorm(cfg.d_model, eps)
        self.cross_attn = Attention(lc, index, causal=False) if decoder else None
        self.cross_norm = RMSNorm(cfg.d_model, eps) if decoder else None
        self.mlp, self.mlp_norm = MLP(lc), RMSNorm(cfg.d_model, eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def cross(self, x: torch.Tensor, enc: torch.Tensor, mask: BidirectionalAttention) -> torch.Tensor:
        """Cross-attention: queries from the decoder, keys and values from the encoder's output."""
        a = self.cross_attn
        assert a is not None
        b, n = x.shape[0], x.shape[1]
        q = a.q_proj(x).view(b, n, -1, a.head_dim)
        k = a.k_proj(enc).view(b, enc.shape[1], -1, a.head_dim)
        v = a.v_proj(enc).view(b, enc.shape[1], -1, a.head_dim)
        return a.o_proj(a.core(q, k, v, mask).reshape(b, n, -1))

    def forward(self, x: torch.Tensor, mask: BidirectionalAttention, enc: torch.Tensor | None = None,
                cross_mask: BidirectionalAttention | None = None) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.self_norm(x), None, attn_mask=mask))
        if self.cross_norm is not None:
            assert enc is not None and cross_mask is not None
            x = x + self.dropout(self.cross(self.cross_norm(x), enc, cross_mask))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class T5Stack(nn.Module):
    def __init__(self, cfg: T5Config, decoder: bool):
        super().__init__()
        self.cfg, self.decoder = cfg, decoder
        n = cfg.num_decoder_layers if decoder else cfg.num_layers
        self.relative_attention_bias = nn.Embedding(cfg.relative_attention_num_buckets, cfg.num_heads)
        self.blocks = nn.ModuleList(T5Block(cfg, decoder, i) for i in range(n))
        self.final_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)
        self.dropout = nn.Dropout(cfg.dropout)
        self.sequence_shards = 1  # > 1 under sequence parallel: x holds 1/shards of the sequence

    def position_bias(self, q_len: int, k_len: int, q_offset: int = 0) -> torch.Tensor:
        """[1, heads, q_len, k_len] relative-position bias (for the heads this rank's table holds);
        queries at positions q_offset.. (a decoder step's), keys at 0..k_len-1; causal masking
        is added separately."""
        dev = self.relative_attention_bias.weight.device
        q_pos = torch.arange(q_offset, q_offset + q_len, device=dev)
        rel = torch.arange(k_len, device=dev)[None, :] - q_pos[:, None]
        b = relative_bucket(rel, not self.decoder, self.cfg.relative_attention_num_buckets,
                            self.cfg.relative_attention_max_distance)
        return self.relative_attention_bias(b).permute(2, 0, 1)[None]

    def self_mask(self, n: int, mask: torch.Tensor | None, dtype: torch.dtype) -> BidirectionalAttention:
        bias = self.position_bias(n, n).to(dtype)
        if self.decoder:
            causal = torch.ones(n, n, dtype=torch.bool, device=bias.device).triu(1)
            bias = bias.masked_fill(causal, torch.finfo(dtype).min)
        return BidirectionalAttention(mask, bias, scale=1.0)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, enc: torch.Tensor | None = None,
                enc_mask: torch.Tensor | None = None) -> torch.Tensor:
        attn = self.self_mask(x.shape[1] * self.sequence_shards, mask, x.dtype).built_for(x)
        cross = BidirectionalAttention(enc_mask, None, scale=1.0).built_for(x) if enc is not None else None
        x = self.dropout(x)
        for blk in self.blocks:
            x = blk(x, attn, enc, cross)
        return self.dropout(self.final_norm(x))


class T5Model(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.cfg = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder, self.decoder = T5Stack(cfg, False), T5Stack(cfg, True)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @property
    def layers(self) -> dict[str, T5Block]:
        """Every block, the encoder's then the decoder's, by name: what block-wise wrappers
        (the trainer's activation recompute) walk. Not a module attribute: names stay the HF-mapped ones."""
        return {f"{name}.{i}": blk for name, stack in (("encoder", self.encoder), ("decoder", self.decoder))
                for i, blk in enumerate(stack.blocks)}

    def shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        dec = labels.new_full(labels.shape, self.cfg.decoder_start_token_id)
        dec[:, 1:] = labels[:, :-1]
        return dec.masked_fill(dec == -100, self.cfg.pad_token_id)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(self.shared(input_ids), attention_mask)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (this rank's vocabulary slice under tensor parallel); T5 scales the head's input
        by d_model**-0.5, v1.1 does not."""
        if self.cfg.scales_head:
            h = h * self.cfg.d_model ** -0.5
        return F.linear(h, self.shared.weight) if self.lm_head is None else self.lm_head(h)

    def hidden(self, input_ids, decoder_input_ids=None, attention_mask=None, decoder_attention_mask=None,
               labels=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """The decoder's final hidden states (before the head)."""
        enc = self.encode(input_ids, attention_mask)
        if decoder_input_ids is None:
            decoder_input_ids = self.shift_right(labels)
        return self.decoder(self.shared(decoder_input_ids), decoder_attention_mask, enc, attention_mask)

    def forward(self, input_ids, decoder_input_ids=None, attention_mask=None, decoder_attention_mask=None,
                labels=None):  # type: ignore[no-untyped-def]
        """(logits, loss or None), as T5ForConditionalGeneration computes them."""
        logits = self.head(self.hidden(input_ids, decoder_input_ids, attention_mask, decoder_attention_mask, labels))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        return logits, loss

    @torch.no_grad()
    def init_weights(self, gen: torch.Generator) -> None:
        """T5's init (transformers' T5PreTrainedModel._init_weights, factor `initializer_factor`):
        normal with std 1 for the embedding, d_model**-0.5 for the untied head, inputs' fan-in
        (q: d_model x d_kv) for the projections; norms at 1. Module by module in `init_order`."""
        modules = dict(self.named_modules())
        for name in self.init_order():
            self.init_module(name, modules[name], gen)

    def init_order(self) -> list[str]:
        """The modules with parameters in the order T5's init draws them (embedding, head, then
        each stack's relative bias and blocks: attention q, k, v, o, the MLP's inputs, then its
        output); what sharded initialisation (trainer/parallel/sharded_init.py) replays."""
        order = ["shared"] + (["lm_head"] if self.lm_head is not None else [])
        for stack in ("encoder", "decoder"):
            order += [f"{stack}.relative_attention_bias", f"{stack}.final_norm"]
            for i, blk in enumerate(getattr(self, stack).blocks):
                b = f"{stack}.blocks.{i}"
                for attn in ("self_attn", "cross_attn") if blk.cross_attn is not None else ("self_attn",):
                    order += [f"{b}.{attn}.{proj}" for proj in ("q_proj", "k_proj", "v_proj", "o_proj")]
                order += [f"{b}.mlp.{lin}" for lin in (("gate_proj", "up_proj") if blk.mlp.gated else ("up_proj",))]
                order += [f"{b}.mlp.down_proj"] + [f"{b}.{n}" for n in ("self_norm", "cross_norm", "mlp_norm")
                                                   if getattr(blk, n) is not None]
        return order

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module, generator: torch.Generator | None = None) -> None:
        """Initialise one module's own parameters, `name` being its name in the whole model (a
        module alone at its global shape, as sharded initialisation materialises it)."""
        f, d, dkv, h = self.cfg.initializer_factor, self.cfg.d_model, self.cfg.d_kv, self.cfg.num_heads
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
            return
        std = {"shared": f, "q_proj": f * (d * dkv) ** -0.5, "o_proj": f * (h * dkv) ** -0.5,
               "down_proj": f * self.cfg.d_ff ** -0.5}.get(leaf, f * d ** -0.5)  # lm_head, bias, k, v, MLP inputs
        module.weight.normal_(0.0, std, generator=generator)


def build_model(cfg: T5Config, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int | None = 0) -> T5Model:
    """Built on the meta device, materialised on `device`, initialised in place from `seed`
    (None: left for a checkpoint): tessera.common.models.build.build_on_meta."""
    return build_on_meta(lambda: T5Model(cfg), device, dtype, seed)


def model_tensor_shapes(cfg: T5Config) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = T5Model(cfg)
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}
