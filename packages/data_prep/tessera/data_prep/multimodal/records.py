"""Image-text records from the three layouts image-text corpora come in, as (where, messages, images).

- LLaVA JSON (`.json`: one array; `.jsonl`: one object a line): `{"image": "a.jpg" | [..],
  "conversations": [{"from": "human"|"gpt"|"system", "value": "<image>\\n..."}]}` (or `messages`
  with role/content), image paths relative to --image-folder (default: the JSON file's folder).
- Parquet: a `conversations` or `messages` column and an `images` (list) or `image` column holding
  bytes or `{"bytes": ...}` structs (how Hugging Face datasets store images).
- WebDataset tar (Megatron Energon's base): members grouped by key (the name up to the first dot of
  its base name); image members by extension, `KEY.json` holding the conversation, or `KEY.txt` a
  caption (a one-turn sample: the image, then the caption as the answer). Members are read, never
  extracted, and only regular files count.

A record whose structure is wrong raises BadRecord (skipped and counted, or fatal with --on-error
fail, as text records); the image bytes are checked by the caller.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tessera.common.errors import UserError
from tessera.common.fileio import sha256_file
from tessera.data_prep.sft import BadRecord
from tessera.data_prep.sources import InputFile, optional_module, read_json_objects

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
MAX_IMAGE_BYTES = 64 << 20  # one encoded image; larger is refused before it is read


class ImageRecord:
    """One sample: its location for messages, chat messages, and image sources (bytes or a path)."""

    def __init__(self, where: str, obj: Any, images: list[bytes | Path]):
        self.where, self.obj, self.images = where, obj, images


def conversation(obj: Any, num_images: int, image_token: str) -> list[dict[str, str]]:
    """LLaVA `conversations` or chat `messages` -> [{role, content}] with one `image_token` per image
    (LLaVA's convention: a sample whose text names no image gets it before the first user turn)."""
    if not isinstance(obj, dict):
        raise BadRecord(f"not a JSON object (got {type(obj).__name__})")
    turns = obj.get("conversations", obj.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise BadRecord("missing 'conversations' (LLaVA) or 'messages': a non-empty list of turns")
    messages = []
    for i, t in enumerate(turns):
        role = t.get("from", t.get("role")) if isinstance(t, dict) else None
        content = t.get("value", t.get("content")) if isinstance(t, dict) else None
        if role not in _ROLES or not isinstance(content, str):
            raise BadRecord(f"turn {i} is not {{\"from\": human|gpt|system, \"value\": str}} or {{role, content}}")
        messages.append({"role": _ROLES[role], "content": content})
    placed = sum(m["content"].count(image_token) for m in messages)
    if placed == 0 and num_images:
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise BadRecord("images but no user turn to place them in")
        first_user["content"] = image_token * num_images + "\n" + first_user["content"]
    elif placed != num_images:
        raise BadRecord(f"{placed} {image_token} placeholders for {num_images} images")
    return messages


def _json_image_paths(obj: Any, folder: Path) -> list[bytes | Path]:
    names = obj.get("image", obj.get("images", [])) if isinstance(obj, dict) else []
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise BadRecord("'image' must be a path or a list of paths")
    return [folder / n for n in names]


def _read_json(inp: InputFile, folder: Path) -> Iterator[ImageRecord]:
    if inp.path.name.lower().endswith(".json"):
        try:
            data = json.loads(inp.path.read_bytes())
        except (ValueError, RecursionError) as exc:
            raise UserError(f"{inp.path}: not a JSON array of LLaVA records ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, list):
            raise UserError(f"{inp.path}: expected a JSON array of records (LLaVA's layout)")
        inp.sha256 = sha256_file(inp.path)
        for i, obj in enumerate(data):
            yield _json_record(f"{inp.path}:record {i}", obj, folder)
        return
    for line, obj, error in read_json_objects(inp):
        if error is not None:
            yield ImageRecord(f"{inp.path}:{line}", BadRecord(error), [])
            continue
        yield _json_record(f"{inp.path}:{line}", obj, folder)


def _json_record(where: str, obj: Any, folder: Path) -> ImageRecord:
    try:
        return ImageRecord(where, obj, _json_image_paths(obj, folder))
    except BadRecord as exc:
        return ImageRecord(where, exc, [])


def _cell_bytes(value: Any) -> bytes:
    if isinstance(value, dict):
        value = value.get("bytes")
    if not isinstance(value, (bytes, bytearray)) or not value:
        raise BadRecord("image cell holds no bytes (expected binary or {bytes: ...})")
    return bytes(value)


def _read_parquet(inp: InputFile) -> Iterator[ImageRecord]:
    pq = optional_module("pyarrow.parquet", "parquet", inp.path)
    try:
        pf = pq.ParquetFile(inp.path)
    except Exception as exc:  # pyarrow's ArrowInvalid and OSError for a damaged file
        raise UserError(f"{inp.path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
    names = set(pf.schema_arrow.names)
    text_col = next((c for c in ("conversations", "messages") if c in names), None)
    image_col = next((c for c in ("images", "image") if c in names), None)
    if text_col is None or image_col is None:
        raise UserError(f"{inp.path}: needs a 'conversations' or 'messages' column and an 'images' or 'image' "
                        f"column (has {sorted(names)})")
    inp.sha256 = sha256_file(inp.path)
    row = 0
    for batch in pf.iter_batches(batch_size=256, columns=[text_col, image_col]):
        for turns, cell in zip(batch.column(text_col).to_pylist(), batch.column(image_col).to_pylist()):
            where = f"{inp.path}:row {row}"
            row += 1
            try:
                cells = cell if isinstance(cell, list) else ([] if cell is None else [cell])
                yield ImageRecord(where, {text_col: turns}, [_cell_bytes(c) for c in cells])
            except BadRecord as exc:
                yield ImageRecord(where, exc, [])


def _read_tar(inp: InputFile) -> Iterator[ImageRecord]:
    def flush(key: str, members: dict[str, bytes]) -> ImageRecord:
        where = f"{inp.path}:{key}"
        images: list[bytes | Path] = [members[e] for e in sorted(members) if e.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS]
        if "json" in members:
            try:
                obj = json.loads(members["json"])
            except (ValueError, RecursionError) as exc:
                return ImageRecord(where, BadRecord(f"KEY.json is not JSON ({str(exc).splitlines()[0]})"), [])
            return ImageRecord(where, obj, images)
        if "txt" in members:
            try:
                caption = members["txt"].decode("utf-8").strip()
            except UnicodeDecodeError:
                return ImageRecord(where, BadRecord("KEY.txt is not UTF-8"), [])
            return ImageRecord(where, {"messages": [{"role": "user", "content": ""},
                                                    {"role": "assistant", "content": caption}]}, images)
        return ImageRecord(where, BadRecord("no KEY.json conversation or KEY.txt caption"), [])

    try:
        with tarfile.open(inp.path, "r:*") as tar:
            key, members = None, {}
            for m in tar:
                if not m.isfile():
                    continue
                base = m.name.rsplit("/", 1)[-1]
                if "." not in base or base.startswith("."):
                    continue
                k = m.name[: len(m.name) - len(base)] + base.split(".", 1)[0]
                ext = base.split(".", 1)[1].lower()
                if k != key and key is not None:
                    yield flush(key, members)
                    members = {}
                key = k
                if m.size > MAX_IMAGE_BYTES:
                    raise UserError(f"{inp.path}:{m.name}: member of {m.size} bytes is over the limit of "
                                    f"{MAX_IMAGE_BYTES} bytes")
                f = tar.extractfile(m)
                members[ext] = f.read() if f is not None else b""
            if key is not None:
                yield flush(key, members)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise UserError(f"{inp.path}: not a readable tar ({str(exc).splitlines()[0]}); the file is corrupt or "
                        "truncated") from None
    inp.sha256 = sha256_file(inp.path)


def input_kind(path: Path) -> str | None:
    name = path.name.lower()
    for kind, suffixes in (("json", (".json", ".jsonl")), ("parquet", (".parquet",)),
                           ("tar", (".tar", ".tar.gz", ".tgz"))):
        if name.endswith(suffixes):
            return kind
    return None


def read_image_records(inp: InputFile, image_folder: Path | None) -> Iterator[ImageRecord]:
    kind = input_kind(inp.path)
    if kind == "json":
        yield from _read_json(inp, image_folder or inp.path.parent)
    elif kind == "parquet":
        yield from _read_parquet(inp)
    elif kind == "tar":
        yield from _read_tar(inp)
    else:
        raise UserError(f"{inp.path}: --format image-text reads LLaVA .json/.jsonl, .parquet or WebDataset .tar")


def load_image(src: bytes | Path, where: str) -> bytes:
    """An image's encoded bytes (read from its path when it is one); a missing file names the record."""
    if isinstance(src, bytes):
        return src
    try:
        if src.stat().st_size > MAX_IMAGE_BYTES:
            raise UserError(f"{where}: image {src} of {src.stat().st_size} bytes is over the limit of "
                            f"{MAX_IMAGE_BYTES} bytes")
        return src.read_bytes()
    except OSError as exc:
        raise UserError(f"{where}: image {src} cannot be read ({exc.strerror or exc}); check --image-folder") from None
