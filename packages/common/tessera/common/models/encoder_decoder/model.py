"""T5 (transformers' `T5ForConditionalGeneration`): relative position buckets whose bias is made in
each stack's first layer and shared by the rest, RMS norm without mean or bias (the shared
RMSNorm), no 1/sqrt(d) attention scaling (T5 folds it into the init), cross-attention in the decoder."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.common.layers.norms import RMSNorm
from tessera.common.models.encoder_decoder.config import T5Config


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


class T5Attention(nn.Module):
    def __init__(self, cfg: T5Config, bias: bool, bidirectional: bool):
        super().__init__()
        self.cfg, self.bidirectional, inner = cfg, bidirectional, cfg.num_heads * cfg.d_kv
        self.q = nn.Linear(cfg.d_model, inner, bias=False)
        self.k = nn.Linear(cfg.d_model, inner, bias=False)
        self.v = nn.Linear(cfg.d_model, inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        self.relative_attention_bias = nn.Embedding(cfg.relative_attention_num_buckets, cfg.num_heads) if bias else None

    def position_bias(self, q_len: int, k_len: int) -> torch.Tensor:
        assert self.relative_attention_bias is not None
        dev = self.relative_attention_bias.weight.device
        rel = torch.arange(k_len, device=dev)[None, :] - torch.arange(q_len, device=dev)[:, None]
        b = relative_bucket(rel, self.bidirectional, self.cfg.relative_attention_num_buckets,
                            self.cfg.relative_attention_max_distance)
        return self.relative_attention_bias(b).permute(2, 0, 1)[None]  # 1, heads, q, k

    def forward(self, x: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, h, d = x.shape[0], x.shape[1], self.cfg.num_heads, self.cfg.d_kv
        q = self.q(x).view(b, n, h, d).transpose(1, 2)
        k = self.k(kv).view(b, -1, h, d).transpose(1, 2)
        v = self.v(kv).view(b, -1, h, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.o(out.transpose(1, 2).reshape(b, n, h * d))


class T5MLP(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.gated = cfg.feed_forward == "gated-gelu"
        if self.gated:
            self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
            self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        else:
            self.wi = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.wo(F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x))
        return self.wo(F.relu(self.wi(x)))


class T5Block(nn.Module):
    def __init__(self, cfg: T5Config, decoder: bool, first: bool):
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.self_attn = T5Attention(cfg, first, bidirectional=not decoder)
        self.self_norm = RMSNorm(cfg.d_model, eps)
        self.cross_attn = T5Attention(cfg, False, bidirectional=True) if decoder else None
        self.cross_norm = RMSNorm(cfg.d_model, eps) if decoder else None
        self.mlp, self.mlp_norm = T5MLP(cfg), RMSNorm(cfg.d_model, eps)

    def forward(self, x, bias, enc=None, cross_bias=None):  # type: ignore[no-untyped-def]
        h = self.self_norm(x)
        x = x + self.self_attn(h, h, bias)
        if self.cross_attn is not None:
            assert self.cross_norm is not None
            x = x + self.cross_attn(self.cross_norm(x), enc, cross_bias)
        return x + self.mlp(self.mlp_norm(x))


class T5Stack(nn.Module):
    def __init__(self, cfg: T5Config, decoder: bool):
        super().__init__()
        n = cfg.num_decoder_layers if decoder else cfg.num_layers
        self.decoder = decoder
        self.blocks = nn.ModuleList(T5Block(cfg, decoder, i == 0) for i in range(n))
        self.final_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x, mask, enc=None, enc_mask=None):  # type: ignore[no-untyped-def]
        n = x.shape[1]
        bias = self.blocks[0].self_attn.position_bias(n, n)
        neg = torch.finfo(x.dtype).min
        if self.decoder:
            bias = bias.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1), neg)
        if mask is not None:
            bias = bias.masked_fill(~mask.bool()[:, None, None, :], neg)
        cross = None
        if enc is not None:
            cross = torch.zeros(x.shape[0], 1, 1, enc.shape[1], dtype=x.dtype, device=x.device)
            if enc_mask is not None:
                cross = cross.masked_fill(~enc_mask.bool()[:, None, None, :], neg)
        for blk in self.blocks:
            x = blk(x, bias, enc, cross)
        return self.final_norm(x)


class T5Model(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.cfg = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder, self.decoder = T5Stack(cfg, False), T5Stack(cfg, True)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        dec = labels.new_full(labels.shape, self.cfg.decoder_start_token_id)
        dec[:, 1:] = labels[:, :-1]
        return dec.masked_fill(dec == -100, self.cfg.pad_token_id)

    def forward(self, input_ids, decoder_input_ids=None, attention_mask=None, decoder_attention_mask=None,
                labels=None):  # type: ignore[no-untyped-def]
        """(logits, loss or None), as T5ForConditionalGeneration computes them."""
        enc = self.encoder(self.shared(input_ids), attention_mask)
        if decoder_input_ids is None:
            decoder_input_ids = self.shift_right(labels)
        h = self.decoder(self.shared(decoder_input_ids), decoder_attention_mask, enc, attention_mask)
        if self.lm_head is None:
            logits = F.linear(h * self.cfg.d_model ** -0.5, self.shared.weight)
        else:
            logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        return logits, loss


def model_tensor_shapes(cfg: T5Config) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = T5Model(cfg)
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}
