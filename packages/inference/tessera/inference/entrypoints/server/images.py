"""Image parts of chat messages (OpenAI's `{"type": "image_url", "image_url": {"url": ...}}`) for a
vision-language model: read, decoded and preprocessed in the HTTP process, on the tokenizer
threads, so a bad image is a 400 there and never reaches the engine.

A `data:image/...;base64,` URL is decoded under the limits (`ImageLimits`: images per request,
encoded bytes, pixels checked from the header before decoding; Pillow's decompression-bomb guard
and corrupt or truncated data: tessera.common.models.vision_language.processor). An http(s) URL is
fetched only when the operator names its host (`--allowed-media-domains`), with a timeout and a
size cap and no redirects; by default no request can make the server reach the network.

The chat template sees each message's content as a list of parts (`{"type": "text", "text"}`,
`{"type": "image"}`), as transformers' processors hand it to LLaVA templates; each image part
renders the image token once and `expand` writes `image_seq_len` of them in its place, as
transformers' LlavaProcessor does.
"""

from __future__ import annotations

import base64
import binascii
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from tessera.common.errors import UserError
from tessera.common.models.vision_language.processor import ImageProcessor, decode_image
from tessera.inference.core.image_inputs import ImageInput, ImageLimits
from tessera.inference.entrypoints.server.errors import ApiError

_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,", re.ASCII)


@dataclass(frozen=True)
class VisionFacts:
    """What the HTTP process needs of a vision-language model (the engine's `vision_info`)."""

    image_token_id: int
    image_token: str
    image_seq_len: int
    processor: ImageProcessor

    @classmethod
    def from_wire(cls, info: dict[str, Any] | None) -> VisionFacts | None:
        if info is None:
            return None
        return cls(int(info["image_token_id"]), str(info["image_token"]), int(info["image_seq_len"]),
                   ImageProcessor.from_hf(info["processor"], "preprocessor_config.json"))


def template_parts(content: str | list[dict[str, Any]] | None, where: str) -> tuple[list[dict[str, Any]], list[str]]:
    """A message's content as the template's parts, and its image URLs in order."""
    if content is None:
        return [], []
    if isinstance(content, str):
        return [{"type": "text", "text": content}], []
    parts: list[dict[str, Any]] = []
    urls: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise ApiError(400, f"{where}.content[{j}].image_url.url must be a string (a data: URL)", param=where)
            parts.append({"type": "image"})
            urls.append(url)
        else:
            raise ApiError(400, f"{where}.content[{j}]: part type {kind!r} is not supported (text and image_url)",
                           param=where)
    return parts, urls


def read_image(url: str, index: int, limits: ImageLimits) -> bytes:
    """The encoded bytes of image `index` from its URL, within the limits (ApiError 400 otherwise)."""
    where = f"image {index}"
    match = _DATA_URL.match(url)
    if match:
        data = url[match.end():]
        if len(data) > 4 * (limits.max_bytes // 3 + 1):
            raise ApiError(400, f"{where}: over the limit of {limits.max_bytes} bytes (--max-image-bytes)",
                           param="messages", code="image_too_large")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"{where}: the data URL is not valid base64", param="messages") from None
    if url.startswith("data:"):
        raise ApiError(400, f"{where}: a data URL must be data:image/<type>;base64,<data>", param="messages")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https"):
        raise ApiError(400, f"{where}: URL scheme {parsed.scheme!r} is not accepted; send a data:image/...;base64 URL",
                       param="messages")
    host = (parsed.hostname or "").lower()
    if host not in limits.allowed_domains:
        raise ApiError(400, f"{where}: this server does not fetch image URLs from {host!r}; send the image as a "
                       "data: URL (the operator may allow hosts with --allowed-media-domains)",
                       param="messages", code="image_url_not_allowed")
    return _fetch(url, where, limits)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # a redirect could leave the allowed hosts
        return None


def _fetch(url: str, where: str, limits: ImageLimits) -> bytes:
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(url, timeout=limits.fetch_timeout_s) as response:
            data = response.read(limits.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ApiError(400, f"{where}: fetching the image failed ({exc})", param="messages") from None
    if len(data) > limits.max_bytes:
        raise ApiError(400, f"{where}: over the limit of {limits.max_bytes} bytes (--max-image-bytes)",
                       param="messages", code="image_too_large")
    return data


def load_images(urls: list[str], vision: VisionFacts, limits: ImageLimits):
    """Pixel values [3, H, W] of each image (on a tokenizer thread)."""
    if len(urls) > limits.max_images:
        raise ApiError(400, f"{len(urls)} images in the request; this server takes at most {limits.max_images} "
                       "(--max-images-per-request)", param="messages", code="too_many_images")
    out = []
    for i, url in enumerate(urls):
        data = read_image(url, i, limits)
        if len(data) > limits.max_bytes:
            raise ApiError(400, f"image {i}: {len(data)} bytes, over the limit of {limits.max_bytes} "
                           "(--max-image-bytes)", param="messages", code="image_too_large")
        try:
            image = decode_image(data, f"image {i}", limits.max_pixels)
        except UserError as exc:
            raise ApiError(400, str(exc), param="messages", code="invalid_image") from None
        out.append(vision.processor(image))
    return out


def expand(ids: list[int], pixels: list, vision: VisionFacts) -> tuple[list[int], list[ImageInput]]:
    """The prompt with each image token repeated image_seq_len times, and the images placed there."""
    found = sum(1 for t in ids if t == vision.image_token_id)
    if found != len(pixels):
        raise ApiError(400, f"the chat template placed {found} image tokens ({vision.image_token!r}) for "
                       f"{len(pixels)} images; remove {vision.image_token!r} from the text", param="messages")
    out: list[int] = []
    images: list[ImageInput] = []
    n = vision.image_seq_len
    for t in ids:
        if t == vision.image_token_id:
            images.append(ImageInput.of(pixels[len(images)], len(out), n))
            out.extend([t] * n)
        else:
            out.append(t)
    return out, images

