"""The vision-language kind's Hugging Face adapter: transformers' `LlavaForConditionalGeneration`
(CLIP or SigLIP vision tower, any causal LM Tessera maps as the language model). Same protocol as
the causal LM's (tessera.common.models.kind.HFAdapter).

Facts (transformers 5.24 is the reference; the parity tests compare logits and export bytes with
it): `save_pretrained` writes the legacy layout every Hub LLaVA checkpoint has, not the module
names it holds in memory: the tower under `vision_tower.` (`embeddings.{class_embedding,
patch_embedding,position_embedding}`, CLIP's `pre_layrnorm` (sic), `encoder.layers.<i>.{layer_norm1,
self_attn.{q,k,v,out}_proj,layer_norm2,mlp.fc1,mlp.fc2}`, `post_layernorm`, SigLIP's `head.*`), the
projector under `multi_modal_projector.linear_{1,2}`, and the causal LM's own checkpoint names
under `language_model.` (`language_model.model.*`, `language_model.lm_head.weight`). Export writes
that; import also reads the in-memory names (`model.vision_tower.*`, `model.language_model.*`,
`lm_head.weight`), as transformers loads both. config.json nests `vision_config` / `text_config`;
the text one is read and written by the causal LM's own adapter.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.common.errors import ArtifactError
from tessera.common.hf.architecture import HF_DTYPE_NAMES, HFConfig
from tessera.common.hf.rules import Rule
from tessera.common.models.causal_lm.hf import adapter as lm_adapter
from tessera.common.models.vision_language.config import VisionLanguageConfig

HF_CLASS = "LlavaForConditionalGeneration"
TRANSFORMERS_VERSION = "5.24.0"
_VISION_TYPES = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
_VISION_ACTS = {"quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_erf"}
_PROJECTOR_ACTS = {"gelu": "gelu_erf", "gelu_pytorch_tanh": "gelu", "quick_gelu": "quick_gelu"}
_LM_PREFIX = "language_model."  # Tessera's prefix of the LM's names, and the checkpoint's of its HF names
# The saved layout's prefixes -> transformers' in-memory names (what import also accepts).
_IN_MEMORY = (("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
              ("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."))


def supported() -> str:
    return f"llava ({HF_CLASS}: {', '.join(_VISION_TYPES)} vision towers; text: {lm_adapter.supported()})"


def claims(data: dict[str, Any]) -> bool:
    archs = data.get("architectures")
    return (isinstance(archs, list) and bool(archs) and archs[0] == HF_CLASS) or data.get("model_type") == "llava"


def _vision(c: HFConfig) -> dict[str, Any]:
    kind = c.text("model_type")
    c.require("model_type", kind, tuple(_VISION_TYPES), "Tessera's vision tower is CLIP's or SigLIP's ViT")
    arch = _VISION_TYPES[kind]
    act = c.text("hidden_act", "quick_gelu" if arch == "clip" else "gelu_pytorch_tanh")
    c.require("hidden_act", act, tuple(_VISION_ACTS), "Tessera's vision MLP has quick_gelu, gelu and gelu_pytorch_tanh")
    out = dict(arch=arch, hidden_size=c.integer("hidden_size"), num_layers=c.integer("num_hidden_layers"),
               num_heads=c.integer("num_attention_heads"), ffn_hidden_size=c.integer("intermediate_size"),
               image_size=c.integer("image_size"), patch_size=c.integer("patch_size"),
               num_channels=c.integer("num_channels", 3), activation=_VISION_ACTS[act],
               norm_eps=c.number("layer_norm_eps", 1e-5 if arch == "clip" else 1e-6, positive=True),
               attention_dropout=c.number("attention_dropout", 0.0),
               head=arch == "siglip" and c.flag("vision_use_head", True))
    return out


def model_config_from_hf(data: dict[str, Any], source: str) -> VisionLanguageConfig:
    """The VisionLanguageConfig equivalent to a Llava config.json; a field Tessera's model cannot
    express is an ArtifactError naming it."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{source}: expected a JSON object")
    c = HFConfig(data, source)
    c.require("model_type", c.text("model_type"), ("llava",), f"Tessera's vision-language kind reads {supported()}")
    vision, text = c.obj("vision_config"), c.obj("text_config")
    if vision is None or text is None:
        raise ArtifactError(f"{source}: vision_config and text_config must both be objects")
    layer = data.get("vision_feature_layer", -2)
    if not isinstance(layer, int) or isinstance(layer, bool):
        c.fail("vision_feature_layer", f"= {layer!r}: Tessera reads one layer (an integer), not a list of layers")
    act = c.text("projector_hidden_act", "gelu")
    c.require("projector_hidden_act", act, tuple(_PROJECTOR_ACTS), "Tessera's projector has gelu, gelu_pytorch_tanh and quick_gelu")
    strategy = c.text("vision_feature_select_strategy", "default")
    c.require("vision_feature_select_strategy", strategy, ("default", "full"), "transformers' two strategies")
    token = data.get("image_token_id", data.get("image_token_index", 32000))
    lm = lm_adapter.model_config_from_hf(dict(text.data), f"{source} text_config")
    try:
        return VisionLanguageConfig(
            vision=_vision(vision), text=lm, image_token_id=token, vision_feature_layer=layer,
            vision_feature_select_strategy=strategy,
            projector=dict(activation=_PROJECTOR_ACTS[act], bias=c.flag("multimodal_projector_bias", True)))
    except ValueError as e:
        raise ArtifactError(f"{source}: {str(e).splitlines()[-1].strip() if 'validation' in str(e) else e}") from None


def check_exportable(cfg: VisionLanguageConfig) -> None:
    lm_adapter.check_exportable(cfg.text)


def hf_config(cfg: VisionLanguageConfig, dtype: torch.dtype, bos_id: int | None, eos_id: int | None,
              pad_id: int | None = None) -> dict[str, Any]:
    """config.json for `cfg` (a LlavaConfig's fields; the text config the causal LM's adapter writes)."""
    check_exportable(cfg)
    v = cfg.vision
    text = lm_adapter.hf_config(cfg.text, dtype, bos_id, eos_id, pad_id)
    text.pop("architectures", None)
    vision: dict[str, Any] = {
        "attention_dropout": v.attention_dropout, "hidden_act": next(k for k, a in _VISION_ACTS.items() if a == v.activation),
        "hidden_size": v.hidden_size, "image_size": v.image_size, "intermediate_size": v.ffn_hidden_size,
        "layer_norm_eps": v.norm_eps, "model_type": f"{v.arch}_vision_model", "num_attention_heads": v.num_heads,
        "num_channels": v.num_channels, "num_hidden_layers": v.num_layers, "patch_size": v.patch_size}
    if v.arch == "siglip":
        vision["vision_use_head"] = v.head
    return {"architectures": [HF_CLASS], "model_type": "llava", "dtype": HF_DTYPE_NAMES[dtype],
            "image_seq_length": cfg.image_seq_len, "image_token_index": cfg.image_token_id,
            "multimodal_projector_bias": cfg.projector.bias,
            "projector_hidden_act": next(k for k, a in _PROJECTOR_ACTS.items() if a == cfg.projector.activation),
            "text_config": text, "tie_word_embeddings": cfg.text.tie_embeddings,
            "transformers_version": TRANSFORMERS_VERSION, "vision_config": vision,
            "vision_feature_layer": cfg.vision_feature_layer,
            "vision_feature_select_strategy": cfg.vision_feature_select_strategy}


def _tower_names(cfg: VisionLanguageConfig) -> list[tuple[str, str]]:
    """(Tessera name, transformers name) of every tower and projector tensor."""
    v, t, h = cfg.vision, "vision.", "vision_tower."
    pairs = [(t + "patch_embed.weight", h + "embeddings.patch_embedding.weight")]
    if v.arch == "siglip":
        pairs.append((t + "patch_embed.bias", h + "embeddings.patch_embedding.bias"))
    else:
        pairs += [(t + "class_embed", h + "embeddings.class_embedding"),
                  (t + "pre_norm.weight", h + "pre_layrnorm.weight"), (t + "pre_norm.bias", h + "pre_layrnorm.bias")]
    pairs.append((t + "pos_embed.weight", h + "embeddings.position_embedding.weight"))
    block = {"attn_norm": "layer_norm1", "attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj",
             "attn.v_proj": "self_attn.v_proj", "attn.o_proj": "self_attn.out_proj", "mlp_norm": "layer_norm2",
             "mlp.up_proj": "mlp.fc1", "mlp.down_proj": "mlp.fc2"}
    for i in range(v.num_layers):
        for ours, theirs in block.items():
            for p in ("weight", "bias"):
                pairs.append((f"{t}layers.{i}.{ours}.{p}", f"{h}encoder.layers.{i}.{theirs}.{p}"))
    pairs += [(t + "post_norm.weight", h + "post_layernorm.weight"), (t + "post_norm.bias", h + "post_layernorm.bias")]
    if v.head:
        pairs.append((t + "head.probe", h + "head.probe"))
        for ours, theirs in {"attention.in_proj_weight": "attention.in_proj_weight",
                             "attention.in_proj_bias": "attention.in_proj_bias",
                             "attention.out_proj.weight": "attention.out_proj.weight",
                             "attention.out_proj.bias": "attention.out_proj.bias",
                             "norm.weight": "layernorm.weight", "norm.bias": "layernorm.bias",
                             "mlp.up_proj.weight": "mlp.fc1.weight", "mlp.up_proj.bias": "mlp.fc1.bias",
                             "mlp.down_proj.weight": "mlp.fc2.weight", "mlp.down_proj.bias": "mlp.fc2.bias"}.items():
            pairs.append((t + "head." + ours, h + "head." + theirs))
    for n in (1, 2):
        for p in ("weight", "bias") if cfg.projector.bias else ("weight",):
            pairs.append((f"projector.linear_{n}.{p}", f"multi_modal_projector.linear_{n}.{p}"))
    return pairs


def _in_memory(name: str) -> str:
    for saved, memory in _IN_MEMORY:
        if name.startswith(saved):
            return memory + name.removeprefix(saved)
    return name


def export_rules(cfg: VisionLanguageConfig) -> list[Rule]:
    """Tessera names -> transformers tensors, one rule per transformers tensor, sorted by name (the
    order save_pretrained writes)."""
    from tessera.common.models.vision_language.model import model_tensor_shapes

    check_exportable(cfg)
    shapes = model_tensor_shapes(cfg, buffers=False)
    rules = [Rule(hf, (ours,), shapes[ours]) for ours, hf in _tower_names(cfg)]
    for r in lm_adapter.export_rules(cfg.text):
        rules.append(Rule(_LM_PREFIX + r.target, tuple(_LM_PREFIX + s for s in r.sources), r.shape, r.combine,
                          r.source_shapes))
    return sorted(rules, key=lambda r: r.target)


def import_rules(cfg: VisionLanguageConfig, hf_names: set[str]) -> tuple[list[Rule], frozenset[str]]:
    """(rules producing every Tessera parameter from a Llava checkpoint's tensors, names that may be
    present unread), from the saved layout or transformers' in-memory names."""
    from tessera.common.models.vision_language.model import model_tensor_shapes

    shapes = model_tensor_shapes(cfg, buffers=False)
    memory = any(n.startswith("model.vision_tower.") for n in hf_names)
    rename = _in_memory if memory else (lambda n: n)
    saved = {n for n in hf_names if n.startswith(_LM_PREFIX)} if not memory else \
        {next(s + n.removeprefix(m) for s, m in _IN_MEMORY if n.startswith(m)) for n in hf_names
         if n.startswith(("model.language_model.", "lm_head."))}
    rules = [Rule(ours, (rename(hf),), shapes[ours]) for ours, hf in _tower_names(cfg)]
    lm_rules, optional = lm_adapter.import_rules(cfg.text, {n.removeprefix(_LM_PREFIX) for n in saved})
    for r in lm_rules:
        rules.append(Rule(_LM_PREFIX + r.target, tuple(rename(_LM_PREFIX + s) for s in r.sources), r.shape, r.combine,
                          r.source_shapes))
    return rules, frozenset(rename(_LM_PREFIX + n) for n in optional)
