"""Atomic writes, content hashing, and opening an artifact's files only inside its folder.

Every artifact is written under a temporary name and renamed into place only when complete, so
an interrupted run never leaves a file or directory that looks finished.

Checksums: SHA-256 (fingerprints, shard and mixture manifests, checkpoints before format 2) and
XXH3-128 (checkpoint payloads from format 2 on: an integrity check against corruption and
truncation, not a security boundary, at ~30 GB/s per core instead of SHA-256's ~1.8 GB/s, so
hashing a multi-GB checkpoint no longer costs more than writing it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

_CHUNK = 1 << 22  # 4 MiB
_WINDOW = 1 << 24  # 16 MiB: hashing maps a file window by window (bounded resident memory)

SHA256 = "sha256"
XXH3_128 = "xxh3-128"
CHECKSUM_ALGORITHMS = (SHA256, XXH3_128)


def sha256_file(path: str | os.PathLike, chunk_size: int = _CHUNK) -> str:
    """Hex SHA-256 of a file, read in chunks so memory stays flat for any file size."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def new_hasher(algorithm: str) -> Any:
    """A streaming hasher (`update(buffer)`, `hexdigest()`) for one of CHECKSUM_ALGORITHMS."""
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm == XXH3_128:
        import xxhash

        return xxhash.xxh3_128()
    raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(CHECKSUM_ALGORITHMS)})")


def file_digest(path: str | os.PathLike, algorithm: str, cancel: threading.Event | None = None) -> str | None:
    """Hex digest of a file. The file is hashed straight from the page cache through a memory
    map (no copy into a read buffer), one window at a time so resident memory stays bounded.
    Both hashers release the GIL on large buffers, so files can be hashed on threads. Returns
    None if `cancel` is set before the end."""
    hasher = new_hasher(algorithm)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for offset in range(0, size, _WINDOW):
            if cancel is not None and cancel.is_set():
                return None
            length = min(_WINDOW, size - offset)
            with mmap.mmap(f.fileno(), length, offset=offset, access=mmap.ACCESS_READ) as window:
                hasher.update(window)
    return hasher.hexdigest()


class HashingWriter:
    """A binary file wrapper that hashes every byte as it is written, so a file's checksum is
    known when it is closed without reading it back. Writes are handed to the file unchanged
    (memoryviews of tensors included: no copy)."""

    def __init__(self, f: BinaryIO, algorithm: str = XXH3_128, write: Any = None):
        """`write(data) -> int`: how bytes reach `f` (default `f.write`; a converter passes one
        that copies file to file in the kernel where it can)."""
        self.f = f
        self.algorithm = algorithm
        self.hasher = new_hasher(algorithm)
        self.position = f.tell()
        self._write = write or f.write

    def write(self, data: Any) -> int:
        try:
            n = self._write(data)
        except OSError as exc:
            name_os_error(exc, getattr(self.f, "name", None))
            raise
        # Hash after writing, not before: when `data` is a memory map, letting write() fault its
        # pages in and then hashing them is ~1 s per GB cheaper on the dev VM than touching them
        # from user space first (measured: 1.0 s vs 2.1-3.3 s for 1.2 GB).
        self.hasher.update(data)
        self.position += n
        return n

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()

    def hexdigest(self) -> str:
        return self.hasher.hexdigest()


class BackgroundFsync:
    """fsync + close finished files on a background thread while the caller writes the next one
    (the disk works while the CPU does), then `wait()` before the output is committed: it
    re-raises the first fsync error. Use as a context manager; leaving it waits too.

    `sync=False` (a caller's explicit non-durable mode): files are only flushed and closed, at
    once, in the caller's thread; nothing is fsynced."""

    def __init__(self, sync: bool = True) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.sync = sync
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsync")
        self._pending: list[Any] = []

    @staticmethod
    def _fsync_close(f: BinaryIO) -> None:
        try:
            f.flush()
            os.fsync(f.fileno())
        except OSError as exc:
            name_os_error(exc, getattr(f, "name", None))
            raise
        finally:
            f.close()

    def submit(self, f: BinaryIO) -> None:
        """Take ownership of an open file: it is flushed, fsynced and closed in the background
        (with sync=False: flushed and closed now, no fsync)."""
        if not self.sync:
            f.close()
            return
        self._pending.append(self._pool.submit(self._fsync_close, f))

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def __enter__(self) -> BackgroundFsync:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.wait()
        finally:
            self._pool.shutdown(wait=True)


def tmp_name(path: str | os.PathLike) -> Path:
    """A sibling temporary name for `path` (same directory, so the final rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def ensure_output_dir(directory: str | os.PathLike, what: str) -> None:
    """Create an output's folder before any work, or fail with one line naming `what` (the flag
    or config field that chose it) and the folder (exit 2 through run_cli)."""
    from tessera.common.errors import UserError

    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{what} {directory}: cannot create the output folder ({exc.strerror}); "
                        "choose a writable location") from None


def refuse_replacing_inputs(output: str | os.PathLike, inputs: list, what: str = "--output") -> None:
    """Refuse an output whose replacement (--overwrite) would delete an input: the output is an
    input or a folder above one. atomic_directory swaps the old output out only at the end, but
    the swap still deletes it, e.g. `export --checkpoint run --output run --overwrite` replaced a
    whole run (every iteration) by its export. One line naming both (exit 2 through run_cli)."""
    from tessera.common.errors import UserError

    out = Path(output).resolve()
    for given in inputs:
        path = Path(given).resolve()
        if path == out or out in path.parents:
            raise UserError(f"{what} {output}: holds the input {given}, which writing there would delete; "
                            "choose another output path")


def check_output_directory(output: str | os.PathLike, overwrite: bool, inputs: list, kind: str,
                           is_kind: Callable[[Path], bool], what: str = "--output") -> None:
    """Before any work, an output folder a command will write with atomic_directory: refused when it
    exists without --overwrite, when replacing it would delete an input, or when it is not
    replaceable (check_replaceable)."""
    from tessera.common.errors import UserError

    if os.path.lexists(output) and not overwrite:
        raise UserError(f"{output}: output already exists; choose another path or pass --overwrite")
    refuse_replacing_inputs(output, inputs, what)
    check_replaceable(output, kind, is_kind, what)


def check_replaceable(output: str | os.PathLike, kind: str, is_kind: Callable[[Path], bool],
                      what: str = "--output") -> None:
    """The one --overwrite policy, checked before any work: an existing output is replaced only
    when it is an empty folder or a `kind` artifact and nothing else (`is_kind`, the recogniser kept
    beside that format's reader, checks both: see holds_only), so `export --output ~/ --overwrite`
    cannot delete the home folder once the export is written. A link is never replaced: the swap
    would move the link, not what it leads to, and the recogniser would have judged the target. A
    file where a folder goes is refused too. One line naming the path and what it holds (exit 2
    through run_cli)."""
    from tessera.common.errors import UserError

    output = Path(output)
    if not os.path.lexists(output):
        return
    hint = f"remove it yourself or choose another {what}"
    if output.is_symlink():
        raise UserError(f"{what} {output}: is a symbolic link (to {os.readlink(output)}); --overwrite never replaces "
                        f"through a link; {hint}")
    if not output.is_dir():
        raise UserError(f"{what} {output}: is a file, not a {kind}; {hint}")
    try:
        entries = os.listdir(output)
    except OSError as exc:
        raise UserError(f"{what} {output}: cannot be listed ({exc.strerror}); {hint}") from None
    if entries and not is_kind(output):
        raise UserError(f"{what} {output}: holds {len(entries)} files or folders that are not a {kind}; {hint}")


def holds_only(path: Path, belongs: Callable[[str], bool]) -> bool:
    """Every entry of folder `path` is one its writer writes (`belongs(name)`): a recogniser's
    second half. Replacing deletes the whole folder, so a user's file beside an artifact (a
    checkpoint_dir that was a project folder, notes put in an export) makes it not the artifact."""
    try:
        return all(belongs(name) for name in os.listdir(path))
    except OSError:
        return False


def check_replaceable_files(files: list[Path], kind: str, is_kind: Callable[[Path], bool],
                            what: str = "--output-prefix") -> None:
    """check_replaceable for outputs that are files beside others (shards, a shard's manifest):
    each existing file must be a link-free `kind` file, so `--output-prefix data/corpus
    --overwrite` never deletes a `data/corpus.json` of the user's."""
    from tessera.common.errors import UserError

    for f in files:
        hint = f"remove it yourself or choose another {what}"
        if not os.path.lexists(f):
            continue
        if f.is_symlink():
            raise UserError(f"{what}: {f} is a symbolic link; --overwrite never replaces through a link; {hint}")
        if not f.is_file() or not is_kind(f):
            raise UserError(f"{what}: {f} exists and is not a {kind} file; {hint}")


def fsync_tree(directory: Path, files: list[Path] | None = None) -> None:
    """fsync `files` (default: every file under `directory`) and `directory` itself, e.g. files
    copied into a durable output (shutil.copyfile does not fsync)."""
    for p in files if files is not None else [p for p in directory.rglob("*") if p.is_file()]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as exc:
            name_os_error(exc, p)
            raise
        finally:
            os.close(fd)
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", sync: bool = True) -> Iterator[Any]:
    """Open a temporary sibling of `path` for writing; rename it to `path` on success.

    `sync` (default): the file is fsynced before the rename and the directory after it, so the
    new content is durable when this returns. `sync=False`: still renamed only when whole (a
    crash of the process never leaves a partial file under `path`), but nothing is fsynced, so a
    power loss may lose it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if sync:
            _fsync_dir(path.parent)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        name_os_error(exc, path)
        raise


def name_os_error(exc: BaseException, path: str | os.PathLike | None, staging: Path | None = None) -> None:
    """Give an OSError raised by a write (which carries no file name) the path the user knows, so
    `run_cli`'s one line for a full disk names the file. A full disk wrapped by another error (DCP
    wraps each rank's) is found inside it. `staging`: a full disk named inside this temporary
    directory is renamed to the path it would have had under `path`, the output the user gave."""
    from tessera.common.errors import storage_exhausted

    full = storage_exhausted(exc)
    err = full if full is not None else exc if isinstance(exc, OSError) else None
    if err is None or err.errno is None or path is None:  # no errno: a message of its own, kept whole
        return
    if err.filename is None:
        err.filename = str(path)
    elif staging is not None and err is full:
        with contextlib.suppress(ValueError):
            err.filename = str(Path(path) / Path(err.filename).relative_to(staging))


@contextlib.contextmanager
def names_os_errors(path: str | os.PathLike) -> Iterator[None]:
    """Inside the block, a write's OSError (which carries no file name) is given `path`."""
    try:
        yield
    except BaseException as exc:
        name_os_error(exc, path)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes, sync: bool = True) -> None:
    with atomic_file(path, "wb", sync=sync) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str, sync: bool = True) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), sync=sync)


def atomic_write_json(path: str | os.PathLike, obj: Any, sync: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", sync=sync)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False, sync: bool = True) -> Iterator[Path]:
    """Yield a temporary directory that becomes `path` when the block completes.

    On any exception the temporary directory is removed and `path` is untouched. With
    `overwrite`, an existing `path` is replaced only after the new one is complete. `sync`
    (default): the parent directory is fsynced after the rename; the caller fsyncs the files it
    wrote. `sync=False`: no fsync (the rename still happens only when the block completes).
    """
    path = Path(path)
    if path.name in ("", ".."):  # `.` or `..` (`--output . --overwrite`): no name to stage beside or rename
        path = path.resolve()
    if path.exists() and not overwrite:
        raise FileExistsError(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            old = tmp_name(path)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        if sync:
            _fsync_dir(path.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        name_os_error(exc, path, staging=tmp)  # a full disk names the output, not its temporary name
        raise


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    """Read a JSON file, turning absence or corruption into a one-line ArtifactError."""
    from tessera.common.errors import ArtifactError

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: {what} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc}); "
                            f"the {what} is corrupt, rebuild it") from None


def artifact_path(directory: str | os.PathLike, name: str | os.PathLike) -> Path:
    """`directory / name`, for reading a file (or subfolder) of an artifact. Refused with one line
    (ArtifactError) when its links or a `..` lead outside `directory`, or when it is neither a
    regular file nor a folder (a FIFO would hang its reader). A path that does not exist is
    returned as it is: the caller reports it missing in its own words.

    Artifacts come from elsewhere (downloads, other users): a link `chat_template.jinja ->
    /proc/self/environ` would otherwise have the server read that file and hand it to clients,
    and an export copy it. One exception, because real users serve such folders: a Hugging Face
    hub cache snapshot (`models--org--name/snapshots/<rev>/config.json -> ../../blobs/<sha>`)
    may link into its own repository's `blobs/` folder."""
    from tessera.common.errors import ArtifactError

    path = Path(directory) / name
    if not os.path.lexists(path):
        return path
    try:
        root, target = Path(directory).resolve(), path.resolve()
    except (OSError, RuntimeError):  # a loop of links (RuntimeError before Python 3.13)
        raise ArtifactError(f"{path}: a loop of symbolic links; replace it with the real file") from None
    if not target.is_relative_to(root):
        blobs = _hub_blobs(root)
        if blobs is None or not target.is_relative_to(blobs):
            raise ArtifactError(f"{path}: leads outside {directory} (to {target}); an artifact's files must lie "
                                "inside its folder: put a copy of the file there instead of a link")
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:  # a link to nothing: missing
        return path
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ArtifactError(f"{path}: not a regular file (a device, pipe or socket); replace it with the real file")
    return path


def _hub_blobs(root: Path) -> Path | None:
    """The `blobs/` folder of the Hugging Face hub cache repository whose snapshot holds `root`
    (already resolved), when `root` lies in one and that folder is a real folder, not a link.
    The repository's folder is named as the hub names it (`models--org--name`), so any other
    `snapshots/` folder (a backup's) lends no exception."""
    for parent in root.parents:
        if parent.name == "snapshots" and re.fullmatch(r"(models|datasets|spaces)--.+", parent.parent.name):
            blobs = parent.parent / "blobs"
            return blobs if blobs.is_dir() and not blobs.is_symlink() else None
    return None


def artifact_files(directory: str | os.PathLike) -> list[Path]:
    """The regular files directly in an artifact folder, sorted, every entry checked by
    `artifact_path` (an entry leading outside refuses the whole listing)."""
    entries = sorted(os.listdir(directory))
    return [p for p in (artifact_path(directory, e) for e in entries) if p.is_file()]
