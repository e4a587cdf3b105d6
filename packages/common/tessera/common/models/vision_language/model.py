"""The vision-language model: LLaVA as transformers' `LlavaForConditionalGeneration`.

Read top to bottom: vision tower, projector, model. The tower is a ViT: patches by a strided conv,
(CLIP) a class embedding in front and a pre-LayerNorm, learned positions, then pre-LayerNorm blocks
of bidirectional attention and an MLP (the shared layers, tessera.common.layers), a post-LayerNorm
and (SigLIP) the attention-pooling head. LLaVA reads one block's hidden states (the config's
`vision_feature_layer`, no post-LayerNorm), drops the class token under the "default" strategy,
projects them to the language model's width and writes them over the embeddings of the image
tokens, in order; the causal LM (tessera.common.models.causal_lm) runs on the result.

Parameter names are the checkpoint contract: `vision.{patch_embed,class_embed,pos_embed,pre_norm,
post_norm}`, `vision.layers.<i>.{attn_norm,attn,mlp_norm,mlp}.*`, `vision.head.{probe,attention,
norm,mlp}.*`, `projector.linear_{1,2}`, `language_model.*` (the causal LM's own names).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.common.layers.mlp import MLP
from tessera.common.layers.self_attention import Attention
from tessera.common.models.build import build_on_meta
from tessera.common.models.causal_lm.model import Transformer
from tessera.common.models.causal_lm.model import model_tensor_shapes as lm_tensor_shapes
from tessera.common.models.vision_language.config import VisionConfig, VisionLanguageConfig, VisionLayerConfig

__all__ = ["Projector", "VisionLanguageModel", "VisionTower", "build_model", "model_tensor_shapes"]


class VisionBlock(nn.Module):
    """Pre-LayerNorm: x + attn(norm(x)), then x + mlp(norm(x)); every patch sees every patch."""

    def __init__(self, layers: VisionLayerConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(layers.hidden_size, eps=layers.norm_eps)
        self.attn = Attention(layers, layer_idx, causal=False)
        self.mlp_norm = nn.LayerNorm(layers.hidden_size, eps=layers.norm_eps)
        self.mlp = MLP(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), None)
        return x + self.mlp(self.mlp_norm(x))


class PoolingHead(nn.Module):
    """SigLIP's attention pooling: a learned probe attends over the patches (torch's multi-head
    attention, the tensors transformers' head has), then LayerNorm and an MLP residual."""

    def __init__(self, cfg: VisionConfig, layers: VisionLayerConfig):
        super().__init__()
        self.probe = nn.Parameter(torch.empty(1, 1, cfg.hidden_size))
        self.attention = nn.MultiheadAttention(cfg.hidden_size, cfg.num_heads, batch_first=True)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = MLP(layers)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probe = self.probe.expand(h.shape[0], -1, -1)
        x = self.attention(probe, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm(x))
        return x[:, 0]


class VisionTower(nn.Module):
    """pixels [N, C, H, W] -> hidden states; `hidden_states(pixels, k)` stops after block k."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        layers = cfg.layer_config()
        d = cfg.hidden_size
        self.patch_embed = nn.Conv2d(cfg.num_channels, d, cfg.patch_size, stride=cfg.patch_size, bias=cfg.arch == "siglip")
        self.class_embed = nn.Parameter(torch.empty(d)) if cfg.arch == "clip" else None
        self.pos_embed = nn.Embedding(cfg.num_positions, d)
        self.pre_norm = nn.LayerNorm(d, eps=cfg.norm_eps) if cfg.arch == "clip" else None
        self.layers = nn.ModuleDict({str(i): VisionBlock(layers, i) for i in range(cfg.num_layers)})
        self.post_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.head = PoolingHead(cfg, layers) if cfg.head else None

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        size = self.cfg.image_size
        if pixels.dim() != 4 or pixels.shape[1:] != (self.cfg.num_channels, size, size):
            raise ValueError(f"pixel values of shape {tuple(pixels.shape)}; the vision tower reads "
                             f"[images, {self.cfg.num_channels}, {size}, {size}]")
        h = self.patch_embed(pixels.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embed is not None:
            h = torch.cat([self.class_embed.expand(h.shape[0], 1, -1), h], dim=1)
        h = h + self.pos_embed.weight
        return self.pre_norm(h) if self.pre_norm is not None else h

    def hidden_states(self, pixels: torch.Tensor, index: int) -> torch.Tensor:
        """The `index`th of (embeddings, block 0's output, ...): [N, positions, d]."""
        h = self.embed(pixels)
        for i in range(index):
            h = self.layers[str(i)](h)
        return h

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(last hidden state [N, P, d], pooled [N, d] or None) as transformers' vision models give
        them: CLIP's last state is the blocks' output and its pooled one the post-LayerNormed class
        token; SigLIP post-LayerNorms the last state and pools it with its head (if it has one)."""
        h = self.hidden_states(pixels, self.cfg.num_layers)
        if self.class_embed is not None:
            return h, self.post_norm(h[:, 0])
        h = self.post_norm(h)
        return h, self.head(h) if self.head is not None else None


class Projector(nn.Module):
    """linear_2(act(linear_1(features))): vision width -> the language model's width."""

    def __init__(self, cfg: VisionLanguageConfig):
        super().__init__()
        self.activation = cfg.projector.activation
        self.linear_1 = nn.Linear(cfg.vision.hidden_size, cfg.text.hidden_size, bias=cfg.projector.bias)
        self.linear_2 = nn.Linear(cfg.text.hidden_size, cfg.text.hidden_size, bias=cfg.projector.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_1(x)
        if self.activation == "quick_gelu":
            h = h * torch.sigmoid(1.702 * h)
        else:
            h = F.gelu(h, approximate="none" if self.activation == "gelu_erf" else "tanh")
        return self.linear_2(h)


class VisionLanguageModel(nn.Module):
    def __init__(self, cfg: VisionLanguageConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTower(cfg.vision)
        self.projector = Projector(cfg)
        self.language_model = Transformer(cfg.text)

    @property
    def layers(self) -> dict[str, nn.Module]:
        """The blocks the forward runs, in order, by name: the tower's up to `vision_feature_layer`,
        then the language model's (those a pipeline stage holds). What block-wise wrappers walk
        (activation recompute, the trainer's FSDP units). Not a module attribute: names stay
        `vision.layers.<i>` and `language_model.layers.<i>`."""
        tower = {} if self.vision is None else {
            f"vision.{i}": b for i, b in self.vision.layers.items() if int(i) < self.cfg.feature_layer_index}
        return {**tower, **{f"language_model.{i}": b for i, b in self.language_model.layers.items()}}

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """The language model's own init; the tower and projector: Normal(0, init_std) weights
        (conv, linears, embeddings, class token, probe), zero biases, unit LayerNorms, visited in
        parameter-name order so a seed gives the same weights anywhere. Module by module in
        `init_order`."""
        modules = dict(self.named_modules())
        for name in self.init_order():
            self.init_module(name, modules[name], generator)

    def init_order(self) -> list[str]:
        """The modules with parameters in the order `init_weights` draws them: the language model's
        in module-name order (its own init), then the tower's and projector's in the name order of
        their parameters, each module where its first parameter falls. Module order differs from
        that: SigLIP's `vision.head.probe` is drawn after the head's attention, MLP and norm, and
        `vision.layers.10` before `vision.layers.2`. Each tower or projector module draws at most
        one tensor (the rest are zeros and ones), so a module at a time draws as the parameters did.
        What sharded initialisation (trainer/parallel/sharded_init.py) replays."""
        lm = [f"language_model.{n}".rstrip(".") for n, _ in sorted(self.language_model.named_modules(),
                                                                   key=lambda kv: kv[0])]
        params = sorted(n for part in ("vision", "projector") for n, _ in getattr(self, part).named_parameters(part))
        return lm + list(dict.fromkeys(n.rsplit(".", 1)[0] for n in params))

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module, generator: torch.Generator | None = None) -> None:
        """Initialise one module's own parameters, `name` being its name in the whole model (a
        module alone at its global shape, as sharded initialisation materialises it)."""
        if name == "language_model" or name.startswith("language_model."):
            self.language_model.init_module(name.removeprefix("language_model").removeprefix("."), module, generator)
            return
        std = self.cfg.text.init_std
        for pname, param in sorted(module.named_parameters(prefix=name, recurse=False)):
            norm = ".pre_norm." in pname or ".post_norm." in pname or "_norm." in pname or ".norm." in pname
            if norm and pname.endswith(".weight"):
                nn.init.ones_(param)
            elif pname.endswith("bias"):
                nn.init.zeros_(param)
            else:
                nn.init.normal_(param, 0.0, std, generator=generator)

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, H, W] -> projected features [N, image_seq_len, text width]."""
        h = self.vision.hidden_states(pixels, self.cfg.feature_layer_index)
        if self.cfg.vision_feature_select_strategy == "default":
            h = h[:, 1:]
        return self.projector(h)

    def embed(self, tokens: torch.Tensor, pixels: torch.Tensor | None) -> torch.Tensor:
        """Text embeddings [B, T, d] with the image features written over the image tokens, image
        after image and feature after feature in reading order."""
        image = tokens == self.cfg.image_token_id
        embed = self.language_model.embed_tokens
        assert embed is not None, "the language model's embedding lives on the first pipeline stage"
        h = embed(tokens.masked_fill(image, 0))
        wanted = int(image.sum())
        if pixels is None or pixels.shape[0] == 0:
            if wanted:
                raise ValueError(f"{wanted} image tokens in the text but no images")
            return h
        features = self.image_features(pixels).to(h.dtype)
        if features.shape[0] * features.shape[1] != wanted:
            raise ValueError(f"{wanted} image tokens in the text for {features.shape[0]} image(s) of "
                             f"{features.shape[1]} features each")
        return h.masked_scatter(image.unsqueeze(-1), features.reshape(-1, features.shape[-1]))

    def forward(self, tokens: torch.Tensor, pixels: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                return_hidden: bool = False, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] and the images of the batch in order, pixels [N, C, H, W] -> logits [B, T, V]."""
        h = self.embed(tokens, pixels)
        return self.language_model(h, positions, return_hidden=return_hidden, document_ids=document_ids)


def build_model(cfg: VisionLanguageConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int | None = 0) -> VisionLanguageModel:
    """Built on the meta device, materialised on `device`, initialised in place from `seed`
    (None: left for a checkpoint): tessera.common.models.build.build_on_meta."""
    return build_on_meta(lambda: VisionLanguageModel(cfg), device, dtype, seed)


def model_tensor_shapes(cfg: VisionLanguageConfig, buffers: bool = True) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the model's state dict, in its order, without building the
    language model (the tower and projector are built on the meta device)."""
    out: dict[str, tuple[int, ...]] = {}
    with torch.device("meta"):
        for name, module in (("vision", VisionTower(cfg.vision)), ("projector", Projector(cfg))):
            tensors = module.state_dict() if buffers else dict(module.named_parameters())
            out.update({f"{name}.{k}": tuple(v.shape) for k, v in tensors.items()})
    out.update({f"language_model.{k}": v for k, v in lm_tensor_shapes(cfg.text, buffers).items()})
    return out
