"""The image processor training and serving share: image bytes -> pixel values for the vision tower,
exactly as transformers' CLIPImageProcessor / SiglipImageProcessor (PIL backend) compute them.

Steps (each switched by the HF `preprocessor_config.json` field of its name): decode with Pillow
under limits (pixels, Pillow's decompression-bomb guard, corrupt or truncated data), convert to RGB,
resize (`size`: `shortest_edge` keeps the aspect ratio, `height`/`width` is a fixed size; `resample`
as Pillow's filter numbers, bicubic = 3), center crop (`crop_size`), rescale (`rescale_factor`, in
float64 then float32 as transformers) and normalise (`image_mean`, `image_std`). Output [3, H, W]
float32, channels first. Bad images and unsupported settings are UserErrors naming them.
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from tessera.common.errors import UserError

PREPROCESSOR_CONFIG = "preprocessor_config.json"
DEFAULT_MAX_PIXELS = 64 * 1024 * 1024  # decoded width x height an image may have (a 8192 x 8192 photo)
PROCESSOR_CLASSES = ("CLIPImageProcessor", "CLIPImageProcessorFast", "SiglipImageProcessor", "SiglipImageProcessorFast")
# Modes whose RGB conversion keeps the picture; 16/32-bit and float modes ("I;16", "I", "F") clip to
# white or black in Pillow's convert, so a model would silently train on blank images.
IMAGE_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV")
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def decode_image(data: bytes, where: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Image bytes -> an RGB PIL image, or a UserError naming `where`: not an image, corrupt or
    truncated, more than `max_pixels` pixels (checked from the header, before decoding), a
    decompression bomb, or a mode outside IMAGE_MODES."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > max_pixels:
                raise UserError(f"{where}: image of {w}x{h} pixels is over the limit of {max_pixels} pixels")
            if img.mode not in IMAGE_MODES:
                raise UserError(f"{where}: image mode {img.mode} is not supported (convert it to RGB or 8-bit "
                                "grayscale first)")
            img.load()
    except UserError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise UserError(f"{where}: image refused as a decompression bomb ({e})") from None
    except (OSError, ValueError, SyntaxError) as e:  # Pillow's errors for unknown, corrupt and truncated data
        raise UserError(f"{where}: not a readable image ({e})") from None
    return img if img.mode == "RGB" else img.convert("RGB")


def _pair(value: Any, where: str) -> tuple[int, int]:
    if isinstance(value, dict) and set(value) == {"height", "width"}:
        return int(value["height"]), int(value["width"])
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    raise UserError(f"{where}: expected {{\"height\": H, \"width\": W}}, got {value!r}")


@dataclass(frozen=True)
class ImageProcessor:
    """One preprocessor_config.json's steps. `shortest_edge` or `size` (height, width) when resizing."""

    do_resize: bool = True
    shortest_edge: int | None = 224
    size: tuple[int, int] | None = None
    resample: int = 3
    do_center_crop: bool = True
    crop_size: tuple[int, int] = (224, 224)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = _OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = _OPENAI_CLIP_STD

    @classmethod
    def from_hf(cls, data: Any, source: str) -> ImageProcessor:
        """From an HF preprocessor_config.json's fields; a field Tessera does not apply as written
        is a UserError naming it."""
        if not isinstance(data, dict):
            raise UserError(f"{source}: expected a JSON object")
        name = data.get("image_processor_type", "CLIPImageProcessor")
        if name not in PROCESSOR_CLASSES:
            raise UserError(f"{source}: image_processor_type {name!r} is not supported (Tessera applies {', '.join(PROCESSOR_CLASSES)})")
        siglip = name.startswith("Siglip")
        if data.get("do_pad") or data.get("do_image_splitting"):
            raise UserError(f"{source}: {'do_pad' if data.get('do_pad') else 'do_image_splitting'} is not supported")
        size = data.get("size", {"height": 224, "width": 224} if siglip else {"shortest_edge": 224})
        edge = None
        fixed = None
        if isinstance(size, dict) and set(size) == {"shortest_edge"}:
            edge = int(size["shortest_edge"])
        else:
            fixed = _pair(size, f"{source}: size")
        resample = data.get("resample", 3)
        if resample not in (0, 1, 2, 3, 4, 5):
            raise UserError(f"{source}: resample {resample!r} is not a Pillow filter (0-5; bicubic = 3)")
        mean = data.get("image_mean", [0.5] * 3 if siglip else _OPENAI_CLIP_MEAN)
        std = data.get("image_std", [0.5] * 3 if siglip else _OPENAI_CLIP_STD)
        for field, v in (("image_mean", mean), ("image_std", std)):
            if not (isinstance(v, (list, tuple)) and len(v) == 3 and all(isinstance(x, (int, float)) for x in v)):
                raise UserError(f"{source}: {field} must be three numbers, got {v!r}")
        if any(x == 0 for x in std):
            raise UserError(f"{source}: image_std has a zero")
        return cls(do_resize=bool(data.get("do_resize", True)), shortest_edge=edge, size=fixed, resample=int(resample),
                   do_center_crop=bool(data.get("do_center_crop", not siglip)),
                   crop_size=_pair(data.get("crop_size", {"height": 224, "width": 224}), f"{source}: crop_size"),
                   do_rescale=bool(data.get("do_rescale", True)), rescale_factor=float(data.get("rescale_factor", 1 / 255)),
                   do_normalize=bool(data.get("do_normalize", True)), image_mean=tuple(map(float, mean)),
                   image_std=tuple(map(float, std)))

    @classmethod
    def from_dir(cls, directory: str | Path) -> ImageProcessor:
        path = Path(directory) / PREPROCESSOR_CONFIG
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"{path}: not found; a vision-language model needs its image processor's config") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: not readable JSON ({e})") from None
        return cls.from_hf(data, str(path))

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after resizing, as transformers computes it (the short side to
        shortest_edge, the long one scaled and truncated)."""
        if self.size is not None:
            return self.size[1], self.size[0]
        assert self.shortest_edge is not None
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(self.shortest_edge * long / short)
        return (self.shortest_edge, new_long) if width <= height else (new_long, self.shortest_edge)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """An RGB image -> pixel values [3, H, W] float32."""
        if self.do_resize:
            image = image.resize(self.output_size(*image.size), resample=Image.Resampling(self.resample))
        pixels = np.asarray(image)
        if self.do_center_crop:
            pixels = _center_crop(pixels, *self.crop_size)
        out = pixels.astype(np.float32)
        if self.do_rescale:
            out = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            out = (out - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        return torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1)))

    def batch(self, images: list[Image.Image]) -> torch.Tensor:
        return torch.stack([self(im) for im in images])


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] -> the centre [height, width], zero-padded where the image is smaller (transformers')."""
    h, w = pixels.shape[:2]
    if h < height or w < width:
        padded = np.zeros((max(h, height), max(w, width), pixels.shape[2]), pixels.dtype)
        top, left = (padded.shape[0] - h) // 2, (padded.shape[1] - w) // 2
        padded[top:top + h, left:left + w] = pixels
        pixels, h, w = padded, padded.shape[0], padded.shape[1]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[top:top + height, left:left + width]
