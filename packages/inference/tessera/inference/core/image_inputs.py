"""A request's images as the engine takes them: pixel values the HTTP process decoded and
preprocessed (entrypoints/server/images.py), where their image tokens sit in the prompt, and the
SHA-256 of the pixels, which the prefix cache mixes into the keys of the blocks the image's
tokens fall in (block_manager.py): two prompts with the same text and different images never
share blocks.

They cross the engine pipe as JSON (wire.py: no pickle): the pixels as base64 of little-endian
float32. The hash is checked against the pixels where the request is validated, so a cache key
always names what the block was computed from.
"""

from __future__ import annotations

import base64
import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import Field, model_validator

from tessera.common.config import StrictModel
from tessera.common.errors import UserError

MAX_IMAGE_TENSOR_ELEMENTS = 3 * 4096 * 4096  # a vision tower's largest input (config.MAX_IMAGE_SIZE)


@dataclass(frozen=True)
class ImageLimits:
    """What the server takes of image parts in chat requests (entrypoints/server/images.py); flags below."""

    max_images: int = 8  # image parts in one request (--max-images-per-request)
    max_bytes: int = 8 * 2**20  # one image's encoded bytes (--max-image-bytes)
    max_pixels: int = 25_000_000  # one image's width x height, from its header (--max-image-pixels)
    allowed_domains: tuple[str, ...] = ()  # hosts http(s) image URLs may name (--allowed-media-domains)
    fetch_timeout_s: float = 10.0  # one fetch from an allowed host (--media-fetch-timeout)


class ImageInput(StrictModel):
    """One image of a request."""

    offset: int = Field(..., ge=0, description="Prompt position of the image's first image token.")
    length: int = Field(..., gt=0, description="Image tokens it takes (the model's image_seq_len).")
    shape: list[int] = Field(..., min_length=3, max_length=3, description="[channels, height, width] of the pixels.")
    pixels: str = Field(..., description="base64 of the float32 pixel values, little-endian, channels first.")
    sha256: str = Field(..., min_length=64, max_length=64, description="Hex SHA-256 of the pixel bytes.")

    @model_validator(mode="after")
    def _check(self) -> ImageInput:
        if any(d <= 0 for d in self.shape) or math.prod(self.shape) > MAX_IMAGE_TENSOR_ELEMENTS:
            raise ValueError(f"image pixel shape {self.shape} is not a [channels, height, width] within limits")
        raw = base64.b64decode(self.pixels, validate=True)
        if len(raw) != 4 * math.prod(self.shape):
            raise ValueError(f"image pixels hold {len(raw)} bytes, not the {4 * math.prod(self.shape)} of shape {self.shape}")
        if hashlib.sha256(raw).hexdigest() != self.sha256:
            raise ValueError("image pixels do not match their sha256")
        return self

    @property
    def end(self) -> int:
        return self.offset + self.length

    @classmethod
    def of(cls, pixels: torch.Tensor, offset: int, length: int) -> ImageInput:
        raw = pixels.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        return cls(offset=offset, length=length, shape=list(pixels.shape), pixels=base64.b64encode(raw).decode(),
                   sha256=hashlib.sha256(raw).hexdigest())

    def tensor(self) -> torch.Tensor:
        raw = base64.b64decode(self.pixels)
        return torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(self.shape))


def image_keys(images: list[ImageInput], start: int, end: int) -> tuple[str, ...]:
    """The hashes of the images whose tokens fall in positions [start, end), in order."""
    return tuple(im.sha256 for im in images if im.offset < end and im.end > start)


def check_image_spans(images: list[ImageInput], prompt_ids: list[int], image_token_id: int | None) -> str | None:
    """Why the images do not fit the prompt (each image's span all image tokens, in order, not
    overlapping, and no other image token in the prompt), or None."""
    if image_token_id is None:
        return "this model reads no images (a text-only model)" if images else None
    last = 0
    for j, im in enumerate(images):
        if im.offset < last or im.end > len(prompt_ids):
            return f"image {j} takes prompt positions {im.offset}..{im.end}, out of order or past the prompt"
        if any(t != image_token_id for t in prompt_ids[im.offset:im.end]):
            return f"image {j}'s positions {im.offset}..{im.end} are not all image tokens"
        last = im.end
    if sum(1 for t in prompt_ids if t == image_token_id) != sum(im.length for im in images):
        return "the prompt has image tokens that no image fills; send images as image_url parts"
    return None


def add_image_limit_args(parser) -> None:
    """tessera-serve's flags for ImageLimits."""
    d = ImageLimits()
    parser.add_argument("--max-images-per-request", type=int, default=d.max_images, metavar="N",
                        help="Image parts one chat request may carry (default: %(default)s).")
    parser.add_argument("--max-image-bytes", type=int, default=d.max_bytes, metavar="BYTES",
                        help="Encoded size of one image (default: %(default)s; the body limit, --max-body-bytes, "
                             "bounds the request too).")
    parser.add_argument("--max-image-pixels", type=int, default=d.max_pixels, metavar="N",
                        help="Width x height of one image, read from its header before decoding (default: %(default)s).")
    parser.add_argument("--allowed-media-domains", nargs="*", default=[], metavar="HOST",
                        help="Hosts whose http(s) image URLs the server fetches (default: none: image parts must be "
                             "data: URLs and no request makes the server reach the network).")
    parser.add_argument("--media-fetch-timeout", type=float, default=d.fetch_timeout_s, metavar="S",
                        help="Seconds one image fetch from an allowed host may take (default: %(default)s).")


def image_limits(args) -> ImageLimits:
    """ImageLimits from the flags; a value out of range is a UserError naming its flag."""
    for flag in ("max_images_per_request", "max_image_bytes", "max_image_pixels", "media_fetch_timeout"):
        value = getattr(args, flag)
        if not value > 0 or value == float("inf"):
            raise UserError(f"--{flag.replace('_', '-')} {value}: must be positive")
    return ImageLimits(max_images=args.max_images_per_request, max_bytes=args.max_image_bytes,
                       max_pixels=args.max_image_pixels,
                       allowed_domains=tuple(h.lower().strip() for h in args.allowed_media_domains),
                       fetch_timeout_s=args.media_fetch_timeout)
