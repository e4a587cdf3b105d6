"""`tessera-ckpt import --format hf-llava-parts --vision DIR --language DIR`: a new LLaVA run's
weights from a separate Hugging Face vision model and causal LM, the projector fresh (how LLaVA
runs start: stage 1 trains the projector on top of a pretrained CLIP / SigLIP and LM).

The vision directory is a `CLIPVisionModel` / `SiglipVisionModel` (or a whole `CLIPModel` /
`SiglipModel`, whose `vision_config` and `vision_model.*` tensors are read); the language
directory any causal LM the converter imports, with its tokenizer, which must have the image
placeholder token (`<image>` unless --image-token names another: LLaVA adds it to the LM's
tokenizer). The pair is read as the Llava checkpoint it would be (vision tensors under
`vision_tower.`, the LM's under `language_model.`) through the vision-language kind's one HF
adapter, so names and layouts are mapped exactly as `import --format hf` maps a Llava directory.
The projector is drawn as the model's own init draws it (Normal(0, init_std) weights, zero
biases) from --seed. The vision directory's preprocessor_config.json is copied beside the
tokenizer, where training and serving look for it.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from tessera.ckpt_convert.dcp_writer import write_imported_checkpoint
from tessera.ckpt_convert.importers.hf import imported_generation
from tessera.ckpt_convert.progress import Progress
from tessera.common.checkpoint import CHECKPOINT_KIND, is_checkpoint_output
from tessera.common.errors import UserError
from tessera.common.fileio import (
    artifact_path,
    atomic_directory,
    check_output_directory,
    read_json,
)
from tessera.common.hf.directory import CONFIG, SafetensorsWeights
from tessera.common.hf.rules import check_import
from tessera.common.models.vision_language.hf import adapter
from tessera.common.models.vision_language.processor import PREPROCESSOR_CONFIG
from tessera.common.tokenizer import check_tokenizer_fits, copy_tokenizer_files, load_tokenizer

_VISION_PREFIX = "vision_model."  # CLIPVisionModel's / SiglipVisionModel's (and CLIPModel's tower)


class _Renamed:
    """Both directories' safetensors as one Llava checkpoint's names (a WeightSource)."""

    def __init__(self, vision: SafetensorsWeights, language: SafetensorsWeights):
        self.sources: dict[str, tuple[SafetensorsWeights, str]] = {}
        # transformers 5 saves a vision model's tensors bare (`embeddings.*`); a CLIPModel / SiglipModel
        # and older saves put the tower under `vision_model.` (beside the text tower, not read).
        nested = any(n.startswith(_VISION_PREFIX) for n in vision.names())
        for n in vision.names():
            if not nested or n.startswith(_VISION_PREFIX):
                self.sources["vision_tower." + n.removeprefix(_VISION_PREFIX)] = (vision, n)
        for n in language.names():
            self.sources["language_model." + n] = (language, n)

    def names(self) -> set[str]:
        return set(self.sources)

    def shape(self, name: str) -> tuple[int, ...]:
        w, n = self.sources[name]
        return w.shape(n)

    def dtype(self, name: str) -> torch.dtype:
        w, n = self.sources[name]
        return w.dtype(n)

    def get(self, name: str) -> torch.Tensor:
        w, n = self.sources[name]
        return w.get(n)


def _vision_config(directory: Path) -> dict[str, Any]:
    path = artifact_path(directory, CONFIG)
    data = read_json(path, "Hugging Face config.json")
    if isinstance(data, dict) and data.get("model_type") in ("clip", "siglip") and isinstance(data.get("vision_config"), dict):
        data = {"model_type": f"{data['model_type']}_vision_model", **data["vision_config"]}
    if not isinstance(data, dict) or data.get("model_type") not in ("clip_vision_model", "siglip_vision_model"):
        got = data.get("model_type") if isinstance(data, dict) else None
        raise UserError(f"{path}: model_type {got!r} is not a CLIP or SigLIP vision model (clip_vision_model, "
                        "siglip_vision_model, or a clip / siglip model with a vision_config)")
    return data


def import_llava_parts(vision_dir: str | Path, language_dir: str | Path, output: str | Path,
                       image_token: str = "<image>", vision_feature_layer: int = -2, seed: int = 0,
                       dtype: torch.dtype | None = None, overwrite: bool = False, quiet: bool = False,
                       sync: bool = True) -> Path:
    vision_dir, language_dir, output = Path(vision_dir), Path(language_dir), Path(output)
    for d in (vision_dir, language_dir):
        if not d.is_dir():
            raise UserError(f"{d}: input directory not found")
    check_output_directory(output, overwrite, [vision_dir, language_dir], CHECKPOINT_KIND, is_checkpoint_output)
    if not (language_dir / "tokenizer.json").is_file():
        raise UserError(f"{language_dir}: no tokenizer.json; the language model's tokenizer (with {image_token!r}) "
                        "is needed to write image-text data and to serve")
    tok = load_tokenizer(language_dir)
    token_id = tok.token_id(image_token)
    if token_id is None:
        raise UserError(f"{language_dir / 'tokenizer.json'}: no {image_token!r} token; add it as a special token "
                        "(LLaVA adds <image> to the LM's tokenizer) or name the placeholder with --image-token")
    text = read_json(artifact_path(language_dir, CONFIG), "Hugging Face config.json")
    source = f"{vision_dir} + {language_dir}"
    llava = {"model_type": "llava", "architectures": [adapter.HF_CLASS], "vision_config": _vision_config(vision_dir),
             "text_config": text, "image_token_index": token_id, "vision_feature_layer": vision_feature_layer,
             "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu"}
    cfg = adapter.model_config_from_hf(llava, source)
    check_tokenizer_fits(tok, cfg.vocab_size, str(artifact_path(language_dir, CONFIG)))
    weights = _Renamed(SafetensorsWeights(vision_dir), SafetensorsWeights(language_dir))
    rules, optional = adapter.import_rules(cfg, weights.names())
    fresh = [r for r in rules if r.target.startswith("projector.")]
    read = [r for r in rules if not r.target.startswith("projector.")]
    # The whole CLIPModel / SiglipModel carries its text tower and pooling projections: not LLaVA's.
    extra = {n for n in weights.names() if n.startswith("vision_tower.")} - {s for r in read for s in r.sources}
    check_import(read, weights, source, frozenset(optional | extra))
    stored = {weights.dtype(s) for r in read for s in r.sources}
    out_dtype = dtype or (stored.pop() if len(stored) == 1 else torch.float32)
    gen = torch.Generator().manual_seed(seed)
    projector = {}
    for r in sorted(fresh, key=lambda r: r.target):  # name order, as VisionLanguageModel.init_weights draws
        projector[r.target] = (torch.zeros(r.shape) if r.target.endswith("bias")
                               else torch.empty(r.shape).normal_(0.0, cfg.text.init_std, generator=gen))
    total = sum(out_dtype.itemsize * torch.Size(r.shape).numel() for r in rules)
    digest = hashlib.sha256()
    for d in (vision_dir, language_dir):
        digest.update(artifact_path(d, CONFIG).read_bytes())
    with atomic_directory(output, overwrite=overwrite, sync=sync) as tmp, \
            Progress(total, len(rules), f"import hf-llava-parts -> {output.name}", quiet) as bar:
        tensors = ((r.target, projector[r.target] if r.target in projector
                    else r.apply([weights.get(s) for s in r.sources])) for r in rules)
        with tempfile.TemporaryDirectory() as staged:  # the LM's tokenizer files + the tower's processor
            copy_tokenizer_files(language_dir, staged)
            if (vision_dir / PREPROCESSOR_CONFIG).is_file():
                shutil.copyfile(vision_dir / PREPROCESSOR_CONFIG, Path(staged) / PREPROCESSOR_CONFIG)
            write_imported_checkpoint(tmp, tensors, cfg, load_tokenizer(staged), out_dtype, {
                "path": f"{vision_dir.resolve()} + {language_dir.resolve()}", "format": "hf-llava-parts",
                "config_sha256": digest.hexdigest()}, bar, sync, imported_generation(language_dir))
    return output
