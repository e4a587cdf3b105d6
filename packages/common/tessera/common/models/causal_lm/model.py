"""The decoder-only transformer: GPT-2, Llama 2/3, Mistral, Qwen2/3, their mixtures of experts
(Mixtral, Qwen3-MoE) and DeepSeek-V3 (latent attention, `mla`) from one config.

Read top to bottom: block, model. The layers it stacks are shared with other kinds and live in
`tessera.common.layers` (norms, self-attention, MLP, mixture of experts, rotary embeddings). This
file is the single-device model; parallelism (tensor, sequence, pipeline, data) is applied to it
by functions elsewhere (its kind's parallel plan, `parallelize.py`), which swap layers or drop
modules, never by branches in here.

Parameter names are the checkpoint contract (see docs/formats/checkpoint.md): they do not depend
on any parallel layout. Projections are stored split (q/k/v, gate/up) so a tensor-parallel shard
of each is a contiguous slice, and layers live in a ModuleDict keyed by global layer number, so a
pipeline stage keeps the names it would have in the full model.

Three hooks serve the other stages: `positions` (explicit token positions for packed or cached
sequences), `document_ids` (several documents packed in one sample attend only within their own
document) and `attention_fn` (replaces the attention core, e.g. with paged attention over a KV
cache in the server).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.common.layers.attention import MaskedAttention
from tessera.common.layers.mla import MLA
from tessera.common.layers.mlp import MLP
from tessera.common.layers.moe import AuxLoss, MoE
from tessera.common.layers.norms import RMSNorm, add_norm, make_norm
from tessera.common.layers.rope import RotaryEmbedding
from tessera.common.layers.self_attention import Attention, AttentionFn
from tessera.common.models.build import build_on_meta
from tessera.common.models.causal_lm.config import ModelConfig

__all__ = ["Block", "MTPLayer", "MultiTokenPrediction", "Transformer", "build_model", "mask_vocab_padding", "model_tensor_shapes"]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn: Attention | MLA = MLA(cfg, layer_idx) if cfg.mla is not None else Attention(cfg, layer_idx)
        self.mlp_norm = make_norm(cfg)
        self.mlp: nn.Module = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        attention_fn: AttentionFn | None = None,
        attn_mask: MaskedAttention | None = None,
    ) -> torch.Tensor:
        h = self.dropout(self.attn(self.attn_norm(x), rope, attention_fn, attn_mask))
        x, normed = add_norm(self.mlp_norm, x, h)
        return x + self.dropout(self.mlp(normed))


class MTPLayer(Block):
    """One multi-token-prediction depth (DeepSeek-V3): a block of the model's kind (global layer
    number num_layers + depth, so MoE or dense as DeepSeek's) over eh_proj([enorm(embedding of token
    t+k) ; hnorm(previous depth's hidden at t)]), then its own head norm (DeepSeek's shared_head.norm).
    Its output, normed, is both what the shared output head reads and the next depth's input."""

    def __init__(self, cfg: ModelConfig, depth: int):
        super().__init__(cfg, cfg.num_layers + depth)
        self.enorm = make_norm(cfg)
        self.hnorm = make_norm(cfg)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.head_norm = make_norm(cfg)

    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        attention_fn: AttentionFn | None = None,
        attn_mask: MaskedAttention | None = None,
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        return self.head_norm(super().forward(x, rope, attention_fn, attn_mask))


class MultiTokenPrediction(nn.Module):
    """The MTP depths, and what training needs of them: the mean over depths of each depth's
    next-token loss (token t+k+1 at position t, positions without one not counted), whose gradient
    `loss_scaling_factor x loss_scale` is injected into the main output (Megatron's MTPLossAutoScaler),
    so the trainer's loss stays the main loss and the MTP loss is logged apart (`metrics`)."""

    loss_scale: float = 1.0  # 1 / micro-batches of the step (`prepare`)
    # (a depth's normed hidden, its targets) -> mean loss over the counted targets; the tensor-parallel
    # plan sets a vocabulary-parallel one (causal_lm.parallelize). None: the model's own head.
    token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.mtp is not None
        self.factor = cfg.mtp.loss_scaling_factor
        self.layers = nn.ModuleDict({str(k): MTPLayer(cfg, k) for k in range(cfg.mtp.depth)})
        self.recorded: list[torch.Tensor] = []  # per training forward: each depth's loss

    def prepare(self, num_microbatches: int, grad_scale: float = 1.0) -> None:
        """Before a step: the step trains on the mean MTP loss of its micro-batches (times the fp16
        loss scale `grad_scale`, which the main loss's backward carries too)."""
        self.loss_scale = grad_scale / num_microbatches
        self.recorded = []

    def metrics(self) -> dict[str, float]:
        """The step's MTP loss (mean over depths and micro-batches, before the scaling factor)."""
        if not self.recorded:
            return {}
        losses = torch.stack(self.recorded).mean(0).tolist()
        self.recorded = []
        out = {"mtp_loss": sum(losses) / len(losses)}
        if len(losses) > 1:
            out.update({f"mtp_loss_{k}": v for k, v in enumerate(losses, start=1)})
        return out


# ---- the model -----------------------------------------------------------------------------


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int, vocab_start: int = 0) -> torch.Tensor:
    """`logits` [..., V_local] for vocabulary rows vocab_start.. with columns of ids >= vocab_size
    (padding, see ModelConfig.padded_vocab_size) set to -inf; unchanged (no copy) without padding."""
    local = logits.shape[-1]
    if vocab_start + local <= vocab_size:
        return logits
    padded = torch.arange(vocab_start, vocab_start + local, device=logits.device) >= vocab_size
    return logits.masked_fill(padded, float("-inf"))


class Transformer(nn.Module):
    """Embedding -> blocks -> final norm -> output head.

    A pipeline stage is this model with some modules set to None (embedding on later stages,
    head on earlier ones) and some layers deleted; forward skips what is absent, so a stage
    without an embedding takes hidden states, and one without a head returns them.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_rows, cfg.hidden_size)
        self.pos_embed: nn.Embedding | None = (
            nn.Embedding(cfg.max_seq_len, cfg.hidden_size) if cfg.position == "learned" else None
        )
        self.rotary = RotaryEmbedding(cfg) if cfg.position == "rope" else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.num_layers)})
        self.final_norm: nn.Module | None = make_norm(cfg)
        self.lm_head: nn.Linear | None = (
            None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_rows, bias=False)
        )
        self.mtp: MultiTokenPrediction | None = MultiTokenPrediction(cfg) if cfg.mtp is not None else None
        # Whether this module produces logits (a pipeline stage may hold the head but not the
        # embedding, with tied weights kept in sync by the pipeline runtime).
        self.has_head = True

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter in place (after `to_empty` when built on the meta device).

        Normal(0, init_std) for embeddings and linear weights, scaled by 1/sqrt(2 L) for the
        projections that write into the residual stream (o_proj, down_proj); zero biases; unit
        norms. Parameters are visited in name order so a given generator seed gives the same
        weights whatever device or pipeline split. Padded vocabulary rows are zero and draw nothing from
        the generator, so the real weights do not depend on the padding (nor on the tensor-parallel size
        that chose it).
        """
        for name, module in sorted(self.named_modules(), key=lambda kv: kv[0]):
            self.init_module(name, module, generator)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module, generator: torch.Generator | None = None) -> None:
        """Initialise one module's own parameters, `name` being its name in the whole model.
        `init_weights` applies this in name order; sharded initialisation replays the same sequence
        one global module at a time (tessera.trainer.parallel.sharded_init)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        if isinstance(module, nn.Linear):
            s = out_std if name.endswith(("o_proj", "down_proj")) else std
            nn.init.normal_(self._real_rows(name, module.weight), 0.0, s, generator=generator)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(self._real_rows(name, module.weight), 0.0, std, generator=generator)
        elif isinstance(module, (nn.LayerNorm, RMSNorm, RotaryEmbedding)):
            module.reset_parameters()
        elif isinstance(module, MoE):
            module.init_weights(std, out_std, generator)
        if name in ("embed_tokens", "lm_head") and self.cfg.vocab_rows > self.cfg.vocab_size:
            module.weight[self.cfg.vocab_size:].zero_()  # padding rows: zero, drawing nothing

    def _real_rows(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        return weight[: self.cfg.vocab_size] if name in ("embed_tokens", "lm_head") else weight

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, vocab_start: int = 0) -> torch.Tensor:
        """The output head: hidden @ weight.T, with the padded vocabulary rows' logits at -inf.

        The one place padding is masked: forward, the tensor-parallel head (`weight` a vocab slice
        starting at row `vocab_start`) and the server's sampler all come here, so no loss, softmax,
        evaluation or sample ever sees a padded row.
        """
        out = F.linear(hidden, self.output_weight() if weight is None else weight)
        return mask_vocab_padding(out, self.cfg.vocab_size, vocab_start)

    def output_weight(self) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.weight
        assert self.embed_tokens is not None, "tied head needs the embedding on this stage"
        return self.embed_tokens.weight

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_fn: AttentionFn | None = None,
        return_hidden: bool = False,
        document_ids: torch.Tensor | None = None,
        mtp_labels: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B, T] (or hidden states [B, T, d] on a later pipeline stage) -> logits [B, T, V].

        `positions` [B or 1, T] defaults to 0..T-1. With `return_hidden` the final-normed hidden
        states are returned instead of logits (for a fused or vocab-parallel loss).
        `document_ids` [B, T] (full sequence, non-decreasing along it) restricts attention to tokens
        of the same document: packed documents do not see each other (Megatron's
        reset_attention_mask). Pair it with per-document `positions` to also restart positions.
        `mtp_labels` [B, T] (the main labels, -100 not counted) trains the MTP depths: their loss
        goes into backward through the output (MultiTokenPrediction), the output itself unchanged;
        `mtp_tokens` are the token ids when `tokens` are hidden states (the last pipeline stage).
        """
        # Float input is embeddings already: a later pipeline stage's hidden states, or a
        # vision-language model's text embeddings with image features in place.
        h = self.embed_tokens(tokens) if self.embed_tokens is not None and not tokens.is_floating_point() else tokens
        seq = h.shape[1]
        if positions is None:
            positions = torch.arange(seq, device=h.device).unsqueeze(0)
        if self.pos_embed is not None and self.embed_tokens is not None:
            h = h + self.pos_embed(positions)
        if self.embed_tokens is not None:
            h = self.dropout(h)
        rope = self.rotary(positions) if self.rotary is not None else None
        if document_ids is not None and attention_fn is not None:
            raise ValueError("document_ids and attention_fn are exclusive (the attention_fn owns masking)")
        # One MaskedAttention per distinct sliding window (None: plain causal, left to SDPA's
        # is_causal unless documents are packed), shared by the layers; the attention_fn owns
        # masking, windows included. Under sequence parallel h is this rank's chunk but attention
        # sees the gathered sequence, so the length comes from `positions`.
        masks: dict[int | None, MaskedAttention | None] = {}
        for block in self.layers.values():
            window = block.attn.window
            if window not in masks:
                masks[window] = None
                if attention_fn is None and (document_ids is not None or window is not None):
                    masks[window] = MaskedAttention(document_ids, window, h.shape[0], positions.shape[1], h.device)
            h = block(h, rope, attention_fn, masks[window])
        if self.final_norm is None:
            return h
        h = self.final_norm(h)
        out = h if return_hidden or not self.has_head else self.logits(h)
        if self.mtp is not None and mtp_labels is not None:
            ids = tokens if mtp_tokens is None else mtp_tokens
            out = self._train_mtp(out, h, ids, mtp_labels, rope, masks.get(None))
        return out

    def mtp_hidden(self, depth: int, hidden: torch.Tensor, tokens: torch.Tensor,
                   positions: torch.Tensor | None = None, attention_fn: AttentionFn | None = None,
                   attn_mask: MaskedAttention | None = None) -> torch.Tensor:
        """MTP depth `depth` (0-based): from the previous depth's normed hidden states [B, T, d] (the
        main model's final-normed ones for depth 0) and `tokens` [B, T] holding token t+depth+1 at
        position t, the depth's normed hidden states; `self.logits` of them predicts token t+depth+2."""
        assert self.mtp is not None and self.embed_tokens is not None, "MTP needs its modules and the embedding"
        if positions is None:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rope = self.rotary(positions) if self.rotary is not None else None
        return self.mtp.layers[str(depth)](hidden, self.embed_tokens(tokens), rope, attention_fn, attn_mask)

    def _train_mtp(self, out: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor] | None, attn_mask: MaskedAttention | None) -> torch.Tensor:
        # Depth k reads token t+k (the inputs rolled left by k: the wrapped-around last k positions
        # only feed positions that come after every counted one) and predicts labels[t+k].
        assert self.mtp is not None and self.embed_tokens is not None and not tokens.is_floating_point(), \
            "MTP training needs the token ids and the embedding (one stage holding the whole model)"
        losses = []
        for k, layer in enumerate(self.mtp.layers.values(), start=1):
            hidden = layer(hidden, self.embed_tokens(tokens.roll(-k, dims=1)), rope, None, attn_mask)
            target = labels.roll(-k, dims=1)
            target[:, -k:] = -100
            if self.mtp.token_loss is not None:
                losses.append(self.mtp.token_loss(hidden, target))
            else:
                losses.append(F.cross_entropy(self.logits(hidden).flatten(0, 1).float(), target.flatten(),
                                              ignore_index=-100))
        loss = torch.stack(losses)
        self.mtp.recorded.append(loss.detach())
        return AuxLoss.apply(out, loss.mean(), self.mtp.factor * self.mtp.loss_scale)


def build_model(
    cfg: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
) -> Transformer:
    """Built on the meta device, materialised on `device`, initialised in place from `seed`
    (None: left for a checkpoint): tessera.common.models.build.build_on_meta."""
    return build_on_meta(lambda: Transformer(cfg), device, dtype, seed)


def model_tensor_shapes(cfg: ModelConfig, buffers: bool = True) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of `Transformer(cfg).state_dict()`, in its order: what a
    checkpoint stores under `model.` (parameters only with buffers=False). Built on the meta device
    from one block per kind of layer, so it costs about the same for 2 layers as for thousands."""
    def shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
        tensors = module.state_dict() if buffers else dict(module.named_parameters())
        return {k: tuple(v.shape) for k, v in tensors.items()}

    out: dict[str, tuple[int, ...]] = {}
    kinds: dict[bool, dict[str, tuple[int, ...]]] = {}
    with torch.device("meta"):
        top = Transformer(cfg.model_copy(update={"num_layers": 0, "sliding_window_layers": None, "mtp": None}))
        for name, child in top.named_children():
            if name != "layers":
                out.update({f"{name}.{k}": v for k, v in shapes(child).items()})
                continue
            for i in range(cfg.num_layers):
                kind = cfg.is_moe_layer(i)
                if kind not in kinds:
                    kinds[kind] = shapes(Block(cfg, i))
                out.update({f"layers.{i}.{k}": v for k, v in kinds[kind].items()})
        for depth in range(cfg.mtp.depth if cfg.mtp is not None else 0):
            out.update({f"mtp.layers.{depth}.{k}": v for k, v in shapes(MTPLayer(cfg, depth)).items()})
    return out
