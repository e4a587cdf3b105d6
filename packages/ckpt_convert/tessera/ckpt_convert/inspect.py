"""`tessera-ckpt verify` and `tessera-ckpt info`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tessera.ckpt_convert.progress import Progress
from tessera.ckpt_convert.source import CheckpointSource
from tessera.common.tokenizer import check_tokenizer_files


def verify(checkpoint: str | os.PathLike, read_tensors: bool = True, quiet: bool = False) -> str:
    """Raise ArtifactError on the first problem; return a one-line summary when all is well."""
    src = CheckpointSource(checkpoint)  # index, extents and model tensors against the config checked
    src.check_integrity()
    if src.tokenizer_dir is not None:  # what serving the checkpoint reads, inside it too
        check_tokenizer_files(src.tokenizer_dir)
    src.tokenizer()  # paired with the model as serving pairs them
    if read_tensors:
        specs = src.tensor_specs
        with Progress(sum(s.nbytes for s in specs.values()), len(specs), "verify", quiet) as bar:
            for key, spec in specs.items():
                src.load([key])
                bar.update(spec.nbytes)
    checked = f"{len(src.sidecar.checksums)} files checksummed"  # an empty table is refused
    return (f"OK {src.directory}: {len(src.model_specs)} model tensors match the config, "
            f"{len(src.tensor_specs)} tensors {'read' if read_tensors else 'indexed'}, {checked}")


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def info(checkpoint: str | os.PathLike) -> dict[str, Any]:
    # Cheap checks only (stat and the index; info reads no payload bytes, verify does): an unlisted,
    # missing or truncated payload file, or a sidecar that describes another model than the one stored.
    src = CheckpointSource(checkpoint)
    sc = src.sidecar
    cfg = sc.model
    return {
        "path": str(src.directory),
        "model": {"arch": cfg.arch, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
                  "num_heads": cfg.num_heads, "num_kv_heads": cfg.kv_heads, "ffn_hidden_size": cfg.ffn_hidden_size,
                  "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len, "tie_embeddings": cfg.tie_embeddings},
        "parameters": cfg.num_params(),
        "params_dtype": sc.params_dtype,
        "layout": sc.layout.model_dump(),
        "layout_short": sc.layout.short(),
        "world_size": sc.layout.world_size,
        "step": sc.step,
        "consumed_samples": sc.consumed_samples,
        "consumed_tokens": sc.consumed_tokens,
        "contents": sc.contents,
        "tensors": len(src.tensor_specs),
        "payload_files": len([p for p in src.directory.iterdir() if p.suffix == ".distcp"]),
        "size_on_disk_bytes": _dir_size(src.directory),
        "tokenizer_fingerprint": sc.tokenizer_fingerprint,
        "generation": None if sc.generation is None else sc.generation.model_dump(exclude_none=True),
        "created_at": sc.created_at,
        "tessera_version": sc.tessera_version,
    }


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def info_text(s: dict[str, Any]) -> str:
    m = s["model"]
    return "\n".join([
        f"checkpoint   {s['path']}",
        f"model        {m['arch']}  d={m['hidden_size']} layers={m['num_layers']} heads={m['num_heads']}"
        f"/{m['num_kv_heads']}kv ffn={m['ffn_hidden_size']} vocab={m['vocab_size']} seq={m['max_seq_len']}"
        f"{' tied' if m['tie_embeddings'] else ''}",
        f"parameters   {s['parameters']:,} ({s['params_dtype']})",
        f"layout       {s['layout_short']} (world size {s['world_size']}, {s['payload_files']} payload files)",
        f"step         {s['step']}",
        f"tokens seen  {s['consumed_tokens']:,} ({s['consumed_samples']:,} samples)",
        f"contents     {', '.join(s['contents'])} ({s['tensors']} tensors)",
        f"size         {_human(s['size_on_disk_bytes'])}",
        f"tokenizer    {s['tokenizer_fingerprint'] or '-'}",
        f"generation   {_generation_text(s['generation'])}",
    ])


def _generation_text(g: dict[str, Any] | None) -> str:
    """The recorded generation settings on one line ('-': none recorded)."""
    if not g:
        return "-"
    parts = [f"end ids {g['eos_token_ids']}"] if g.get("eos_token_ids") else []
    parts += [f"{k} {v}" for k, v in g.items() if k not in ("eos_token_ids", "ignored")]
    # the source file's values the sampler cannot take, left out at import
    parts += [f"ignored {k} {v!r}" for k, v in (g.get("ignored") or {}).items()]
    return ", ".join(parts) or "-"
