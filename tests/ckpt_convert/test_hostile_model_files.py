"""Model files that state sizes or types their readers must not trust (issues 35.6, 35.7, 28.4).

A Hugging Face config.json claiming 10^12 positions or 10^6 layers made serving try to allocate
64 TB and import, serve and generate grow past 3 GiB; one whose tokenizer is larger than its
vocabulary was imported. A checkpoint storing q_proj as bool or uint8 passed verify and export.
Each is now one line naming the file (and field), exit 2, nothing written, before any allocation
sized by it. A safetensors header giving two tensors the same bytes (q_proj's values loaded as o_proj) was
accepted too. The checkpoint half of every reader is in tests/trainer/test_checkpoint_corruption_matrix.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_checkpoint, make_tokenizer, tiny_llama

from tessera.common.checkpoint import (
    CheckpointSidecar,
    finalize_checkpoint,
    load_model_tensors,
    resolve_checkpoint,
    save_model_tensors,
)
from tessera.common.errors import run_cli

HF_READERS = ["ckpt import", "generate", "serve"]


class _WouldServe(Exception):
    """Raised by the uvicorn.Server.run stub: tessera-serve accepted the directory and would listen now."""


@pytest.fixture
def no_listening(monkeypatch):
    import uvicorn

    def stub(*args, **kwargs):
        raise _WouldServe

    monkeypatch.setattr(uvicorn.Server, "run", stub)  # serve_cli runs a uvicorn.Server (it reports the bound port)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Llama exported to a Hugging Face directory: vocabulary 300, tokenizer of 300."""
    from tessera.ckpt_convert.cli import run

    root = tmp_path_factory.mktemp("hostile-hf")
    tok = make_tokenizer(root / "tok", vocab_size=300)
    make_checkpoint(root / "ck", tiny_llama(vocab_size=300, num_layers=2), tok)
    run(["export", "--format", "hf", "--checkpoint", str(root / "ck"), "--output", str(root / "hf"), "--quiet"])
    return root / "hf"


def _config_field(key: str, value: int):
    def edit(hf: Path) -> None:
        config = json.loads((hf / "config.json").read_text())
        config[key] = value
        (hf / "config.json").write_text(json.dumps(config))
    return edit


def _larger_tokenizer(hf: Path) -> None:
    make_tokenizer(hf, vocab_size=512)  # tokenizer.json of 512 tokens over the 300-row model


def _shared_bytes(hf: Path) -> None:
    """o_proj's header entry points at q_proj's bytes (same shape): every other check passes."""
    import struct

    path = hf / "model.safetensors"
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header["model.layers.0.self_attn.o_proj.weight"]["data_offsets"] = \
        header["model.layers.0.self_attn.q_proj.weight"]["data_offsets"]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])


HF_CASES = {
    "max_position_embeddings 10^12": (_config_field("max_position_embeddings", 10**12),
                                      "config.json: field 'max_position_embeddings'"),
    "num_hidden_layers 10^6": (_config_field("num_hidden_layers", 10**6), "config.json: field 'num_hidden_layers'"),
    "tokenizer larger than the vocabulary": (_larger_tokenizer, "tokenizer has 512 tokens but the model"),
    "two tensors sharing bytes": (_shared_bytes, "'model.layers.0.self_attn.q_proj.weight' overlap in the file"),
}


def _hf_command(reader: str, hf: Path, out: Path):
    from tessera.ckpt_convert.cli import run as ckpt_run
    from tessera.inference.entrypoints.generate_cli import main as generate_main
    from tessera.inference.entrypoints.serve_cli import main as serve_main

    prompts = out / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f"}) + "\n")
    main, argv = {
        "ckpt import": (ckpt_run, ["import", "--format", "hf", "--input", str(hf), "--output", str(out / "imported"),
                                   "--quiet"]),
        "generate": (generate_main, ["--checkpoint", str(hf), "--prompts", str(prompts), "--output",
                                     str(out / "out.jsonl"), "--max-tokens", "2", "--quiet"]),
        "serve": (serve_main, ["--checkpoint", str(hf), "--port", "8", "--quiet"]),
    }[reader]
    return lambda: run_cli(main, argv)


@pytest.mark.parametrize("reader", HF_READERS)
@pytest.mark.parametrize("case", list(HF_CASES))
def test_an_hf_directory_with_unbounded_sizes_or_a_larger_tokenizer_is_refused_by_every_reader(
        case, reader, hf_dir, tmp_path, capsys, no_listening):
    hf = tmp_path / "hf"
    shutil.copytree(hf_dir, hf)
    damage, expected = HF_CASES[case]
    damage(hf)
    out = tmp_path / "out"
    out.mkdir()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        try:
            _hf_command(reader, hf, out)()
        except _WouldServe:
            pytest.fail(f"tessera-serve accepted an HF directory with {case} and would listen")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 2, f"exit {exc.value.code}; stderr:\n{err[-3000:]}"
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert expected in lines[0], lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["prompts.jsonl"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("dtype-src") / "ck", tiny_llama(num_layers=2), tokenizer_dir)


@pytest.mark.parametrize("verb", ["verify", "export"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8], ids=["bool", "uint8"])
def test_a_checksummed_checkpoint_with_q_proj_stored_as_bool_or_uint8_is_refused_by_verify_and_export(
        dtype, verb, checkpoint, tmp_path, capsys):
    from tessera.ckpt_convert.cli import main

    source = resolve_checkpoint(checkpoint)
    tensors = load_model_tensors(source)
    tensors["layers.0.attn.q_proj.weight"] = (tensors["layers.0.attn.q_proj.weight"] * 100).to(dtype)
    it = tmp_path / "iter_0000010"
    save_model_tensors(it, tensors)
    shutil.copytree(source / "tokenizer", it / "tokenizer")
    finalize_checkpoint(it, CheckpointSidecar.model_validate_json((source / "tessera_checkpoint.json").read_text()))
    argv = {"verify": ["verify", str(it)],
            "export": ["export", "--format", "hf", "--checkpoint", str(it), "--output", str(tmp_path / "hf")]}[verb]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    name = str(dtype).removeprefix("torch.")
    assert f".metadata: model tensor 'layers.0.attn.q_proj.weight' is stored as {name}" in err[0], err[0]
    assert not (tmp_path / "hf").exists()


def test_import_refuses_a_vocabulary_padding_multiple_past_its_bound_before_reading_the_weights(hf_dir, tmp_path,
                                                                                               capsys):
    from tessera.ckpt_convert.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["import", "--format", "hf", "--input", str(hf_dir), "--output", str(tmp_path / "out"), "--quiet",
              "--vocab-size-divisible-by", str(2**40)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert "--vocab-size-divisible-by 1099511627776: must be at most 65536" in err[0]
    assert not (tmp_path / "out").exists()


def test_every_kind_a_stage_reads_maps_its_checkpoint_tensors_as_its_model_state_dict_does():
    """check_checkpoint compares the DCP index with the kind's tensor map before building anything,
    so the map must be exactly the model's state dict (names, order, shapes), buffers included."""
    from tessera.common.models.causal_lm.config import preset
    from tessera.common.models.causal_lm.model import Transformer
    from tessera.common.models.registry import KINDS

    for kind in KINDS.values():
        hooks = [getattr(kind.hooks, f) for f in kind.hooks.__dataclass_fields__]
        assert kind.tensor_shapes is not None or not any(hooks), f"{kind.name}: stages read it, no tensor map"
    configs = [preset("tiny"), preset("mixtral-tiny"), preset("gpt2-124m", num_layers=2),
               tiny_llama(sliding_window=8, sliding_window_layers=[1, 3]),
               preset("qwen3-moe-tiny", moe=dict(num_experts=8, top_k=2, ffn_hidden_size=48, first_k_dense=1,
                                                  layer_freq=2, num_shared_experts=1))]
    for cfg in configs:
        with torch.device("meta"):
            model = Transformer(cfg)
        assert list(KINDS["causal_lm"].tensor_shapes(cfg).items()) == \
            [(k, tuple(v.shape)) for k, v in model.state_dict().items()], cfg.arch
