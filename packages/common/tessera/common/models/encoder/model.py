"""The encoder: BERT as transformers' BertModel / BertForMaskedLM / BertForPreTraining and
Megatron-Core's BertModel, from one config.

Read top to bottom: embeddings, block, heads, model. Embeddings are word + absolute position +
token type, summed, then a LayerNorm. Each block is post-LayerNorm: x = norm(x + attn(x)), then
x = norm(x + mlp(x)), with bidirectional attention (every query sees every real key of its row:
padding is masked by `attention_mask`) and a GELU MLP, both the shared layers
(tessera.common.layers) built from `EncoderConfig.layer_config()`. The heads a config has sit on
top: the pooler (dense + tanh on the first token), the masked-LM head (dense + activation +
LayerNorm, then the vocabulary decoder, tied to the word embedding, with its own bias) and the
binary head (two logits from the pooled token). This file is the single-device model;
parallelism is applied to it by `parallelize.py`.

Parameter names are the checkpoint contract (docs/formats/checkpoint.md): `embed_tokens`,
`pos_embed`, `token_type_embed`, `embed_norm` (post-LN) / `final_norm` (pre-LN), `layers.<i>.{attn,attn_norm,mlp,mlp_norm}.*`,
`pooler.dense`, `mlm_head.{dense,norm}`, `mlm_head.decoder.bias` (and `.weight` when untied),
`binary_head`; layers live in a ModuleDict keyed by global layer number, so a pipeline stage
keeps the names it would have in the full model.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tessera.common.layers.attention import BidirectionalAttention
from tessera.common.layers.mlp import MLP
from tessera.common.layers.norms import add_norm, make_norm
from tessera.common.layers.self_attention import Attention
from tessera.common.models.build import build_on_meta
from tessera.common.models.causal_lm.model import mask_vocab_padding
from tessera.common.models.encoder.config import EncoderConfig, EncoderLayerConfig

__all__ = ["EncoderBlock", "EncoderModel", "EncoderOutput", "build_model", "model_tensor_shapes"]

# Parameters with one row per vocabulary entry (and padding rows past the vocabulary).
VOCAB_PARAMS = ("embed_tokens.weight", "mlm_head.decoder.weight", "mlm_head.decoder.bias")


class EncoderBlock(nn.Module):
    """Post-LayerNorm: the norms follow the residual adds (BERT's, Megatron's BERT layer spec)."""

    def __init__(self, cfg: EncoderConfig, layers: EncoderLayerConfig, layer_idx: int):
        super().__init__()
        self.attn = Attention(layers, layer_idx, causal=False)
        self.attn_norm = make_norm(layers)
        self.mlp = MLP(layers)
        self.mlp_norm = make_norm(layers)
        self.dropout = nn.Dropout(cfg.dropout)

        self.pre_norm = cfg.norm_placement == "pre"

    def forward(self, x: torch.Tensor, attn_mask: BidirectionalAttention | None = None) -> torch.Tensor:
        if self.pre_norm:  # MegatronBert's: x + attn(norm(x)), then x + mlp(norm(x))
            x = x + self.dropout(self.attn(self.attn_norm(x), None, None, attn_mask))
            return x + self.dropout(self.mlp(self.mlp_norm(x)))
        _, x = add_norm(self.attn_norm, x, self.dropout(self.attn(x, None, None, attn_mask)))
        _, x = add_norm(self.mlp_norm, x, self.dropout(self.mlp(x)))
        return x


# ---- heads -----------------------------------------------------------------------------------


class Pooler(nn.Module):
    """tanh(dense(hidden of the first token)): [B, T, d] -> [B, d]. Takes the whole sequence so a
    parallel plan can gather a sequence-sharded input in front of it."""

    def __init__(self, d: int):
        super().__init__()
        self.dense = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(h[:, 0]))


class VocabDecoder(nn.Module):
    """The MLM decoder's own tensors: its bias [V] and, untied, its weight [V, d] (tied, the weight
    is the word embedding's). Both split by vocabulary rows under tensor parallel."""

    def __init__(self, rows: int, d: int, tied: bool):
        super().__init__()
        self.weight = None if tied else nn.Parameter(torch.empty(rows, d))
        self.bias = nn.Parameter(torch.empty(rows))


class MLMHead(nn.Module):
    """Masked-LM head: LayerNorm(act(dense(h))) -> logits over the vocabulary (EncoderModel.logits)."""

    def __init__(self, cfg: EncoderConfig, layers: EncoderLayerConfig):
        super().__init__()
        self.activation = cfg.activation
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm = make_norm(layers)
        self.decoder = VocabDecoder(cfg.vocab_rows, cfg.hidden_size, cfg.tie_embeddings)

    def transform(self, h: torch.Tensor) -> torch.Tensor:
        h = self.dense(h)
        h = F.gelu(h) if self.activation == "gelu_erf" else F.gelu(h, approximate="tanh")
        return self.norm(h)


class EncoderOutput(NamedTuple):
    """hidden [B, T, d]: the last block's output (what embeddings pool); pooled [B, d] (with a
    pooler); mlm_logits [B, T, V] (with an MLM head, unless return_hidden); binary_logits [B, 2]."""

    hidden: torch.Tensor
    pooled: torch.Tensor | None = None
    mlm_logits: torch.Tensor | None = None
    binary_logits: torch.Tensor | None = None


# ---- the model -------------------------------------------------------------------------------


class EncoderModel(nn.Module):
    """Embeddings -> blocks -> heads.

    A pipeline stage is this model with some modules set to None (the embeddings on later stages,
    the heads on earlier ones) and some layers deleted: a stage without embeddings takes hidden
    states, one without heads (`has_head` false) returns them.
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        layers = cfg.layer_config()
        d = cfg.hidden_size
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_rows, d)
        self.pos_embed: nn.Embedding | None = nn.Embedding(cfg.max_seq_len, d)
        self.token_type_embed: nn.Embedding | None = nn.Embedding(cfg.num_token_types, d) if cfg.num_token_types else None
        pre = cfg.norm_placement == "pre"  # pre-LN: no embedding norm, a final norm after the blocks
        self.embed_norm: nn.Module | None = None if pre else make_norm(layers)
        self.final_norm: nn.Module | None = make_norm(layers) if pre else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): EncoderBlock(cfg, layers, i) for i in range(cfg.num_layers)})
        self.pooler: Pooler | None = Pooler(d) if cfg.pooler else None
        self.mlm_head: MLMHead | None = MLMHead(cfg, layers) if cfg.mlm_head else None
        self.binary_head: nn.Linear | None = nn.Linear(d, 2) if cfg.binary_head else None
        self.has_head = True  # whether this module (a pipeline stage) runs the heads

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter in place, visiting modules in name order (a given generator
        seed gives the same weights on any device or pipeline split): Normal(0, init_std) for
        embeddings and linear weights (transformers' BERT init), zero biases, unit LayerNorms.
        Padded vocabulary rows are zero and draw nothing from the generator."""
        for name, module in sorted(self.named_modules(), key=lambda kv: kv[0]):
            self.init_module(name, module, generator)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module, generator: torch.Generator | None = None) -> None:
        """Initialise one module's own parameters, `name` being its name in the whole model (what
        sharded initialisation replays one module at a time)."""
        std, real = self.cfg.init_std, self.cfg.vocab_size
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std, generator=generator)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            weight = module.weight[:real] if name == "embed_tokens" else module.weight
            nn.init.normal_(weight, 0.0, std, generator=generator)
            if name == "embed_tokens":
                module.weight[real:].zero_()
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        elif isinstance(module, VocabDecoder):
            if module.weight is not None:
                nn.init.normal_(module.weight[:real], 0.0, std, generator=generator)
                module.weight[real:].zero_()
            nn.init.zeros_(module.bias)

    # ---- pieces the stages call -------------------------------------------------------------

    def embed(self, tokens: torch.Tensor, token_types: torch.Tensor | None = None) -> torch.Tensor:
        """Word + position (0..T-1) + token-type embeddings, LayerNorm, dropout: [B, T] -> [B, T, d]."""
        assert self.embed_tokens is not None and self.pos_embed is not None
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than the position table ({self.cfg.max_seq_len}: "
                             "model.max_seq_len)")
        h = self.embed_tokens(tokens)
        if self.token_type_embed is not None:
            types = token_types if token_types is not None else torch.zeros_like(tokens)
            h = h + self.token_type_embed(types)
        elif token_types is not None:
            raise ValueError("token_types given to a model without token types (model.num_token_types = 0)")
        h = h + self.pos_embed(torch.arange(seq, device=tokens.device).unsqueeze(0))
        return self.dropout(self.embed_norm(h) if self.embed_norm is not None else h)

    def output_weight(self) -> torch.Tensor:
        assert self.mlm_head is not None, "no MLM head"
        if self.mlm_head.decoder.weight is not None:
            return self.mlm_head.decoder.weight
        assert self.embed_tokens is not None, "tied MLM decoder needs the word embedding on this stage"
        return self.embed_tokens.weight

    def logits(self, x: torch.Tensor, weight: torch.Tensor | None = None, vocab_start: int = 0) -> torch.Tensor:
        """MLM logits from the head's transformed states `x`: x @ weight.T + bias, padded vocabulary
        rows at -inf. Under tensor parallel `weight` and the decoder's bias are this rank's vocab
        slice, starting at row `vocab_start` (tessera.common.parallel.tensor_parallel.parallel_logits)."""
        assert self.mlm_head is not None, "no MLM head"
        out = F.linear(x, self.output_weight() if weight is None else weight, self.mlm_head.decoder.bias)
        return mask_vocab_padding(out, self.cfg.vocab_size, vocab_start)

    def forward(
        self,
        tokens: torch.Tensor,
        token_types: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> EncoderOutput | torch.Tensor:
        """tokens [B, T] (or hidden states [B, T, d] on a later pipeline stage) -> EncoderOutput
        (hidden states [B, T, d] on a stage without the heads).

        `token_types` [B, T] (segment ids; default 0), `attention_mask` [B, T] (1 / true at real
        tokens, 0 / false at padding; None: no padding), as transformers takes them. With
        `return_hidden` the MLM logits are left to the caller (`mlm_head.transform` then `logits`:
        the vocab-parallel loss computes them itself).
        """
        h = self.embed(tokens, token_types) if self.embed_tokens is not None else tokens
        mask = BidirectionalAttention(attention_mask).built_for(h) if attention_mask is not None else None
        for block in self.layers.values():
            h = block(h, mask)
        if self.final_norm is not None:
            h = self.final_norm(h)
        if not self.has_head:
            return h
        pooled = self.pooler(h) if self.pooler is not None else None
        mlm = None
        if self.mlm_head is not None and not return_hidden:
            mlm = self.logits(self.mlm_head.transform(h))
        binary = self.binary_head(pooled) if self.binary_head is not None and pooled is not None else None
        return EncoderOutput(h, pooled, mlm, binary)


def build_model(
    cfg: EncoderConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
) -> EncoderModel:
    """Built on the meta device, materialised on `device`, initialised in place from `seed`
    (None: left for a checkpoint): tessera.common.models.build.build_on_meta."""
    return build_on_meta(lambda: EncoderModel(cfg), device, dtype, seed)


def model_tensor_shapes(cfg: EncoderConfig, buffers: bool = True) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of `EncoderModel(cfg).state_dict()`, in its order: what a
    checkpoint stores under `model.`. Built on the meta device from one block, so it costs the
    same for 2 layers as for thousands (the encoder has no buffers: `buffers` is for the protocol)."""
    def shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
        tensors = module.state_dict() if buffers else dict(module.named_parameters())
        return {k: tuple(v.shape) for k, v in tensors.items()}

    out: dict[str, tuple[int, ...]] = {}
    with torch.device("meta"):
        top = EncoderModel(cfg.model_copy(update={"num_layers": 1}))
        block = shapes(top.layers["0"])
        for name, child in top.named_children():
            if name != "layers":
                out.update({f"{name}.{k}": v for k, v in shapes(child).items()})
                continue
            for i in range(cfg.num_layers):
                out.update({f"layers.{i}.{k}": v for k, v in block.items()})
    return out
