"""Input corpora as one stream of records, read lazily so memory stays flat for any corpus size.

Supported inputs (chosen by file name; globs and folders are expanded in sorted order):

- JSON Lines: `*.jsonl`, `*.json`, `*.ndjson`, optionally compressed (`.gz`, `.zst`): one JSON
  object per line; the text lives under each of `--json-keys`.
- Parquet: `*.parquet`, read one record batch at a time; the keys are columns.
- A Hugging Face `datasets` folder written by `save_to_disk` (it holds `state.json` or
  `dataset_dict.json`), read with `datasets.load_from_disk` and iterated in batches.
- Anything else is a plain-text file: the whole file is one document, under the key `text`.
  A folder that is not a `datasets` folder contributes every non-hidden file inside it.

Each record is reported with its file and line (or row), so a record that cannot be used is
named precisely: a reader never drops anything silently, it yields the reason instead.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.common.errors import UserError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSION_SUFFIXES = (".gz", ".zst")
PARQUET_SUFFIXES = (".parquet",)

Progress = Callable[[int], None]  # called with the number of input bytes just consumed


@dataclass(frozen=True)
class Record:
    """One input record: its texts (one per key) or the reason it cannot be used."""

    line: int  # 1-based line (JSONL), row (Parquet, datasets) or 1 (a plain-text file)
    values: tuple[str, ...] | None
    error: str | None = None


@dataclass
class InputFile:
    """One resolved input: its path, format and, once fully read, the hash of its bytes."""

    path: Path
    kind: str  # jsonl | parquet | text | hf
    sha256: str | None = None
    records: int = 0

    @property
    def size(self) -> int:
        if self.kind == "hf":
            return sum(p.stat().st_size for p in self.path.rglob("*.arrow"))
        return self.path.stat().st_size


def _optional(module: str, extra: str, path: Path) -> Any:
    """Import a reader's library, or say which extra to install (these formats are optional)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{path}: reading this format needs {module.split('.')[0]}; "
                        f"pip install 'tessera-data-prep[{extra}]'") from None


def _kind_of(path: Path) -> str:
    name = path.name.lower()
    for comp in COMPRESSION_SUFFIXES:
        if name.endswith(comp):
            name = name[: -len(comp)]
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def _is_hf_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def resolve_inputs(patterns: list[str]) -> list[InputFile]:
    """Expand files, globs and folders into a sorted, de-duplicated list; errors name the pattern."""
    found: list[InputFile] = []
    seen: set[Path] = set()

    def add(path: Path, kind: str) -> None:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            found.append(InputFile(path=path, kind=kind))

    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise UserError(f"--input {pattern}: no such file or folder (check the path or glob)")
        for match in matches:
            path = Path(match)
            if path.is_dir() and _is_hf_dataset(path):
                add(path, "hf")
            elif path.is_dir():
                files = sorted(p for p in path.rglob("*")
                               if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
                if not files:
                    raise UserError(f"--input {match}: folder holds no files")
                for p in files:
                    add(p, _kind_of(p))
            else:
                add(path, _kind_of(path))
    return found


def check_inputs(inputs: list[InputFile], keys: list[str], hf_split: str | None) -> None:
    """Validate everything knowable without reading the data: readable files, columns, splits."""
    for inp in inputs:
        if inp.kind == "text" and keys != ["text"]:
            raise UserError(f"{inp.path}: plain-text input provides only the key 'text', but --json-keys is "
                            f"{','.join(keys)}; use --json-keys text or convert it to JSONL")
        if inp.kind == "parquet":
            pq = _optional("pyarrow.parquet", "parquet", inp.path)
            try:
                schema = pq.ParquetFile(inp.path).schema_arrow
            except Exception as exc:
                raise UserError(f"{inp.path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
            for key in keys:
                if key not in schema.names:
                    raise UserError(f"{inp.path}: no column {key!r} (columns: {', '.join(schema.names)}); "
                                    "fix --json-keys")
        if inp.kind == "hf":
            _open_hf(inp.path, keys, hf_split)
        if inp.kind != "hf" and not os.access(inp.path, os.R_OK):
            raise UserError(f"{inp.path}: not readable (check permissions)")


class _HashingReader(io.RawIOBase):
    """Pass-through reader that hashes the raw bytes and reports progress as they are consumed."""

    def __init__(self, raw: io.BufferedIOBase, progress: Progress | None):
        self._raw = raw
        self._progress = progress
        self.digest = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self._raw.readinto(b)
        if n:
            view = memoryview(b)[:n]
            self.digest.update(view)
            if self._progress:
                self._progress(n)
        return n or 0

    def close(self) -> None:
        self._raw.close()
        super().close()


class _ZstdReader(io.RawIOBase):
    """Zstandard decompression over any number of concatenated frames, refusing a truncated file.

    (zstandard's own stream reader treats a file cut mid-frame as a clean end of data, which
    would turn a truncated corpus into a silently shorter one.)
    """

    def __init__(self, raw: io.BufferedIOBase, path: Path):
        zstandard = _optional("zstandard", "zstd", path)
        self._zstd = zstandard
        self._raw = raw
        self._obj = zstandard.ZstdDecompressor().decompressobj()
        self._pending = b""
        self._pos = 0  # read position in _pending
        self._fed = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while self._pos == len(self._pending):
            self._pending, self._pos = b"", 0
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._fed and not self._obj.eof:
                    raise EOFError("the last zstd frame is incomplete")
                return 0
            while chunk:
                if self._obj.eof:  # the previous frame ended: the rest starts a new one
                    self._obj = self._zstd.ZstdDecompressor().decompressobj()
                self._fed = True
                try:
                    self._pending += self._obj.decompress(chunk)
                except self._zstd.ZstdError as exc:
                    raise OSError(str(exc)) from None
                chunk = self._obj.unused_data if self._obj.eof else b""
        n = min(len(b), len(self._pending) - self._pos)
        b[:n] = self._pending[self._pos:self._pos + n]
        self._pos += n
        return n


def _open_stream(path: Path, progress: Progress | None) -> tuple[io.BufferedReader, _HashingReader]:
    hashing = _HashingReader(open(path, "rb"), progress)  # noqa: SIM115 - closed by the caller
    raw: Any = io.BufferedReader(hashing, buffer_size=1 << 20)
    name = path.name.lower()
    if name.endswith(".gz"):
        raw = gzip.GzipFile(fileobj=raw, mode="rb")
    elif name.endswith(".zst"):
        raw = _ZstdReader(raw, path)
    return io.BufferedReader(raw, buffer_size=1 << 20), hashing


def _extract(obj: Any, keys: list[str]) -> tuple[tuple[str, ...] | None, str | None]:
    """The texts of a record under `keys`, or the first reason they cannot be used."""
    if not isinstance(obj, dict):
        return None, f"not a JSON object (got {type(obj).__name__})"
    values = []
    for key in keys:
        if key not in obj or obj[key] is None:
            return None, f"missing key {key!r}"
        value = obj[key]
        if not isinstance(value, str):
            return None, f"key {key!r} is {type(value).__name__}, not a string"
        if not value or value.isspace():
            return None, f"empty document under key {key!r}"
        values.append(value)
    return tuple(values), None


def _read_jsonl(inp: InputFile, keys: list[str], progress: Progress | None) -> Iterator[Record]:
    for line_no, obj, error in read_json_objects(inp, progress):
        if error is not None:
            yield Record(line_no, None, error)
            continue
        values, error = _extract(obj, keys)
        yield Record(line_no, values, error)


def read_json_objects(inp: InputFile, progress: Progress | None = None) -> Iterator[tuple[int, Any, str | None]]:
    """(line, parsed JSON value, None) or (line, None, why it is unreadable) for every non-blank line of
    a JSON Lines input (plain, .gz or .zst); the file's sha256 is set on `inp` once it is read whole."""
    stream, hashing = _open_stream(inp.path, progress)
    loads = json.loads
    try:
        try:
            for line_no, line in enumerate(stream, 1):
                if line.isspace():
                    continue  # blank lines (e.g. a trailing newline) are not records
                try:
                    obj = loads(line)
                except UnicodeDecodeError:
                    yield line_no, None, "invalid UTF-8"
                    continue
                except ValueError as exc:
                    yield line_no, None, f"malformed JSON ({getattr(exc, 'msg', exc)})"
                    continue
                except RecursionError:  # json's decoder recurses once per nesting level
                    yield line_no, None, "JSON nested too deeply"
                    continue
                yield line_no, obj, None
        except (OSError, EOFError, zlib.error) as exc:  # gzip/zstd corruption or truncation
            raise UserError(f"{inp.path}: cannot read ({str(exc).splitlines()[0]}); "
                            "the file is corrupt or truncated") from None
        inp.sha256 = hashing.digest.hexdigest()
    finally:
        stream.close()


def _read_text(inp: InputFile, keys: list[str], progress: Progress | None) -> Iterator[Record]:
    data = inp.path.read_bytes()
    inp.sha256 = hashlib.sha256(data).hexdigest()
    if progress:
        progress(len(data))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        yield Record(1, None, f"invalid UTF-8 at byte {exc.start}")
        return
    if not text or text.isspace():
        yield Record(1, None, "empty document")
        return
    yield Record(1, (text,), None)


def _column_records(columns: list[list[Any]], first_row: int, keys: list[str]) -> Iterator[Record]:
    for i, row in enumerate(zip(*columns)):
        values, error = _extract(dict(zip(keys, row)), keys)
        yield Record(first_row + i, values, error)


def _read_parquet(inp: InputFile, keys: list[str], progress: Progress | None) -> Iterator[Record]:
    from tessera.common.fileio import sha256_file

    pq = _optional("pyarrow.parquet", "parquet", inp.path)

    inp.sha256 = sha256_file(inp.path)
    pf = pq.ParquetFile(inp.path)
    total_rows = max(pf.metadata.num_rows, 1)
    size = inp.path.stat().st_size
    row = 1
    for batch in pf.iter_batches(batch_size=4096, columns=keys):
        columns = [batch.column(k).to_pylist() for k in keys]
        yield from _column_records(columns, row, keys)
        if progress:
            progress(size * batch.num_rows // total_rows)
        row += batch.num_rows


def _open_hf(path: Path, keys: list[str], hf_split: str | None) -> Any:
    datasets = _optional("datasets", "hf", path)

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise UserError(f"{path}: not a readable Hugging Face datasets folder ({str(exc).splitlines()[0]})") from None
    if isinstance(ds, datasets.DatasetDict):
        split = hf_split or "train"
        if split not in ds:
            raise UserError(f"{path}: dataset has no split {split!r} (it has {', '.join(ds)}); pass --hf-split")
        ds = ds[split]
    for key in keys:
        if key not in ds.column_names:
            raise UserError(f"{path}: no column {key!r} (columns: {', '.join(ds.column_names)}); fix --json-keys")
    return ds


def _read_hf(inp: InputFile, keys: list[str], hf_split: str | None, progress: Progress | None) -> Iterator[Record]:
    ds = _open_hf(inp.path, keys, hf_split)
    inp.sha256 = None  # a datasets folder is many files; its own fingerprint is recorded instead
    size, total_rows = inp.size, max(len(ds), 1)
    row = 1
    for batch in ds.select_columns(keys).iter(batch_size=4096):
        columns = [batch[k] for k in keys]
        n = len(columns[0])
        yield from _column_records(columns, row, keys)
        if progress:
            progress(size * n // total_rows)
        row += n


def read_records(inp: InputFile, keys: list[str], hf_split: str | None = None,
                 progress: Progress | None = None) -> Iterator[Record]:
    """Records of one input, in file order."""
    if inp.kind == "jsonl":
        return _read_jsonl(inp, keys, progress)
    if inp.kind == "parquet":
        return _read_parquet(inp, keys, progress)
    if inp.kind == "hf":
        return _read_hf(inp, keys, hf_split, progress)
    return _read_text(inp, keys, progress)


def hf_fingerprint(inp: InputFile, hf_split: str | None) -> str | None:
    """The `datasets` library's own fingerprint of a saved dataset (recorded in the manifest)."""
    ds = _open_hf(inp.path, [], hf_split)
    return getattr(ds, "_fingerprint", None)


optional_module = _optional  # for the other readers (tessera.data_prep.multimodal)
