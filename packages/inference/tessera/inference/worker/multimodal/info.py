"""What the HTTP process needs to turn image parts into a vision-language prompt, read once where
the model loads: the image token (id and text), image tokens per image, and the image
processor's config (a plain dict: it crosses the engine pipe as JSON)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tessera.common.errors import UserError
from tessera.common.models.vision_language.processor import PREPROCESSOR_CONFIG, ImageProcessor


def vision_info(loaded) -> dict[str, Any] | None:
    """None for a text-only model; a UserError naming the file when its processor config is missing or bad."""
    cfg = loaded.config
    if getattr(cfg, "kind", None) != "vision_language":
        return None
    dirs = [Path(d) for d in (loaded.path, getattr(loaded.tokenizer, "directory", None)) if d is not None]
    path = next((d / PREPROCESSOR_CONFIG for d in dirs if (d / PREPROCESSOR_CONFIG).is_file()), None)
    if path is None:
        raise UserError(f"{dirs[0] / PREPROCESSOR_CONFIG}: not found; a vision-language model is served with its "
                        "image processor's config")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not readable JSON ({e})") from None
    processor = ImageProcessor.from_hf(data, str(path))
    crop = processor.crop_size if processor.do_center_crop else processor.size
    if crop is None or tuple(crop) != (cfg.vision.image_size, cfg.vision.image_size):
        raise UserError(f"{path}: the processor makes {crop} images; the vision tower reads "
                        f"{cfg.vision.image_size}x{cfg.vision.image_size}")
    token = loaded.tokenizer.backend.id_to_token(cfg.image_token_id)
    if token is None:
        raise UserError(f"{path.parent}: the tokenizer has no token for image_token_id {cfg.image_token_id}")
    return {"image_token_id": cfg.image_token_id, "image_token": token, "image_seq_len": cfg.image_seq_len,
            "processor": data}
