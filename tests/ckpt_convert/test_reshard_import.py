"""Reshard round trips, per-rank file contents, import(export(ckpt)) identity, verify and info."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_helpers import make_checkpoint, tiny_gpt2, tiny_llama

from tessera.ckpt_convert.cli import run
from tessera.ckpt_convert.source import CheckpointSource
from tessera.common.checkpoint import read_sidecar, resolve_checkpoint


def all_tensors(ckpt) -> dict[str, torch.Tensor]:
    src = CheckpointSource(ckpt)
    return src.load(list(src.tensor_specs))


def optimizer_state(cfg) -> dict:
    """Training state shaped as a trainer might store it: per-parameter moments plus non-tensor entries."""
    from tessera.common.models.causal_lm.model import build_model

    g = torch.Generator().manual_seed(7)
    state = {}
    for name, p in build_model(cfg, seed=None).named_parameters():
        state[f"optimizer.state.{name}.exp_avg"] = torch.randn(p.shape, generator=g)
        state[f"optimizer.state.{name}.exp_avg_sq"] = torch.rand(p.shape, generator=g)
    state["optimizer.step"] = torch.tensor(10.0)
    state["scheduler"] = {"last_epoch": 10, "base_lrs": [3e-4]}
    state["train_state"] = {"step": 10, "consumed_samples": 80}
    return state


def test_reshard_round_trip_bit_identical(tmp_path, tokenizer_dir):
    cfg = tiny_llama(num_layers=4, num_heads=4, num_kv_heads=4, vocab_size=320)
    make_checkpoint(tmp_path / "c11", cfg, tokenizer_dir, extra=optimizer_state(cfg))
    before = all_tensors(tmp_path / "c11")
    prev = tmp_path / "c11"
    for name, (t, p, extra) in {"c22": (2, 2, ["--data-parallel", "2"]), "c41": (4, 1, []),
                                "c22v": (2, 2, ["--virtual-stages", "2"]), "back11": (1, 1, [])}.items():
        assert run(["reshard", "--checkpoint", str(prev), "--output", str(tmp_path / name),
                    "--tensor-parallel", str(t), "--pipeline-parallel", str(p), *extra, "--quiet"]) == 0
        side = read_sidecar(resolve_checkpoint(tmp_path / name))
        assert (side.layout.tensor, side.layout.pipeline) == (t, p)
        assert side.model_extra["resharded_from"] == read_sidecar(resolve_checkpoint(prev)).layout.short()
        assert side.step == 10 and side.consumed_tokens == 10 * 8 * 64
        prev = tmp_path / name
    # Exporting from a partitioned payload (DCP assembles the chunks) gives the same bytes.
    for name in ("c11", "c22"):
        run(["export", "--format", "hf", "--checkpoint", str(tmp_path / name), "--output",
             str(tmp_path / f"hf-{name}"), "--quiet"])
    assert (tmp_path / "hf-c11" / "model.safetensors").read_bytes() == \
        (tmp_path / "hf-c22" / "model.safetensors").read_bytes()
    after = all_tensors(prev)
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k
    # Non-tensor training state passes through byte for byte.
    import torch.distributed.checkpoint as dcp

    src0, src1 = CheckpointSource(tmp_path / "c11"), CheckpointSource(prev)
    assert src0.bytes_keys and sorted(src0.bytes_keys) == sorted(src1.bytes_keys)
    for k in src0.bytes_keys:
        assert src0.raw_bytes_item(k)[0] == src1.raw_bytes_item(k)[0], k
    got = {"scheduler": {"last_epoch": 0, "base_lrs": [0.0]}, "train_state": {"step": 0, "consumed_samples": 0}}
    dcp.load(got, checkpoint_id=str(resolve_checkpoint(prev)), no_dist=True)
    assert got["scheduler"] == {"last_epoch": 10, "base_lrs": [3e-4]} and got["train_state"]["step"] == 10


def test_reshard_files_hold_each_ranks_blocks(tmp_path, tokenizer_dir):
    """tp2 x dp2 x pp2: rank r's file holds exactly the blocks rank r owns, in global coordinates."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    cfg = tiny_llama(num_layers=4, num_heads=4, num_kv_heads=2)
    make_checkpoint(tmp_path / "src", cfg, tokenizer_dir, extra=optimizer_state(cfg))
    run(["reshard", "--checkpoint", str(tmp_path / "src"), "--output", str(tmp_path / "out"),
         "--tensor-parallel", "2", "--pipeline-parallel", "2", "--data-parallel", "2", "--quiet"])
    src = CheckpointSource(tmp_path / "out")
    assert sorted(p.name for p in src.directory.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(8)]
    md = src.metadata

    def where(key):
        chunks = md.state_dict_metadata[key].chunks
        return [(md.storage_data[MetadataIndex(key, c.offsets)].relative_path, tuple(c.offsets), tuple(c.sizes))
                for c in chunks]

    # rank = tp + 2 * (dp + 2 * pp)
    assert where("model.layers.0.attn.q_proj.weight") == [("__0_0.distcp", (0, 0), (32, 64)),
                                                          ("__1_0.distcp", (32, 0), (32, 64))]
    assert where("model.layers.3.attn.o_proj.weight") == [("__4_0.distcp", (0, 0), (64, 32)),
                                                          ("__5_0.distcp", (0, 32), (64, 32))]
    assert where("model.layers.2.mlp_norm.weight") == [("__4_0.distcp", (0,), (64,))]
    assert where("model.embed_tokens.weight") == [("__0_0.distcp", (0, 0), (160, 64)),
                                                  ("__1_0.distcp", (160, 0), (160, 64))]
    assert where("model.lm_head.weight")[0][0] == "__4_0.distcp"
    assert where("model.final_norm.weight") == [("__4_0.distcp", (0,), (64,))]
    # Optimizer moments: the parameter's tp block, split again over the two dp ranks.
    assert where("optimizer.state.layers.3.mlp.up_proj.weight.exp_avg") == [
        ("__4_0.distcp", (0, 0), (24, 64)), ("__6_0.distcp", (24, 0), (24, 64)),
        ("__5_0.distcp", (48, 0), (24, 64)), ("__7_0.distcp", (72, 0), (24, 64))]
    assert where("optimizer.step") == [("__0_0.distcp", (), ())]


@pytest.mark.parametrize("args, message", [
    (["--tensor-parallel", "3", "--pipeline-parallel", "1"], "--tensor-parallel 3 must divide num_heads (4)"),
    (["--tensor-parallel", "4", "--pipeline-parallel", "1"], "--tensor-parallel 4 must divide num_kv_heads (2)"),
    (["--tensor-parallel", "1", "--pipeline-parallel", "5"], "5 pipeline stages (pipeline x virtual-stages) but the "
                                                             "model has only 4 layers"),
    (["--tensor-parallel", "1", "--pipeline-parallel", "1", "--virtual-stages", "2"], "needs --pipeline-parallel"),
    (["--tensor-parallel", "1", "--pipeline-parallel", "3", "--pipeline-layers", "2,2"], "2 values given"),
    (["--tensor-parallel", "1", "--pipeline-parallel", "2", "--pipeline-layers", "2,1"], "counts sum to 3 but the "
                                                                                         "model has 4 layers"),
    (["--tensor-parallel", "1", "--pipeline-parallel", "2", "--pipeline-layers", "4,0"], "at least one layer"),
    (["--tensor-parallel", "1", "--pipeline-parallel", "2", "--pipeline-layers", "3;1"], "comma-separated"),
    (["--tensor-parallel", "0", "--pipeline-parallel", "1"], "must be a positive integer"),
])
def test_reshard_bad_layout_exit_2_no_output(tmp_path, tokenizer_dir, capsys, args, message):
    from tessera.ckpt_convert.cli import main

    make_checkpoint(tmp_path / "src", tiny_llama(num_kv_heads=2), tokenizer_dir)
    with pytest.raises(SystemExit) as exc:
        main(["reshard", "--checkpoint", str(tmp_path / "src"), "--output", str(tmp_path / "out"), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("cfg", [tiny_llama(tie_embeddings=True), tiny_llama(bias=True, num_layers=2),
                                 tiny_gpt2(), tiny_gpt2(tie_embeddings=False)], ids=["llama-tied", "llama-bias",
                                                                                     "gpt2", "gpt2-untied"])
def test_import_export_identity(tmp_path, tokenizer_dir, cfg):
    make_checkpoint(tmp_path / "orig", cfg, tokenizer_dir)
    run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "orig"), "--output", str(tmp_path / "hf"),
         "--max-shard-size", "50KB", "--quiet"])
    # The original is unpadded: import without vocabulary padding (test_vocab_padding covers padding).
    assert run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "back"),
                "--quiet", "--vocab-size-divisible-by", "1"]) == 0
    a, b = all_tensors(tmp_path / "orig"), all_tensors(tmp_path / "back")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    side = read_sidecar(resolve_checkpoint(tmp_path / "back"))
    assert side.model == cfg.model_copy(update={"vocab_size_divisible_by": 1})  # the padding rule it was given
    assert side.tokenizer_fingerprint == read_sidecar(resolve_checkpoint(tmp_path / "orig")).tokenizer_fingerprint
    assert "OK" in run_verify(tmp_path / "back")


def run_verify(path):
    from tessera.ckpt_convert.inspect import verify

    return verify(path, quiet=True)


def test_import_from_transformers_save_pretrained(tmp_path):
    """A directory written by transformers itself (GPT-2, sharded) imports and gives the same logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tessera.common.checkpoint import load_model_tensors
    from tessera.common.models.causal_lm.model import build_model

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4)).eval()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    run(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ck"), "--quiet"])
    directory = resolve_checkpoint(tmp_path / "ck")
    model = build_model(read_sidecar(directory).model, seed=None)
    model.load_state_dict(load_model_tensors(directory))
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        logits = model.eval()(tokens)  # imported padded to 384 rows (vocab_size_divisible_by 128)
        assert logits.shape[-1] == 384 and torch.isneginf(logits[..., 300:]).all()
        assert (logits[..., :300] - hf(tokens).logits).abs().max().item() < 1e-4


def test_import_unsupported_architecture_exit_2(tmp_path, capsys):
    from tessera.ckpt_convert.cli import main

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "falcon",
                                                             "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(SystemExit) as exc:
        main(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "unsupported architecture 'falcon'" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_verify_and_info(tmp_path, tokenizer_dir, capsys):
    from tessera.ckpt_convert.cli import main

    make_checkpoint(tmp_path / "ck", tiny_llama(), tokenizer_dir, step=10)
    assert run(["verify", str(tmp_path / "ck"), "--quiet"]) == 0
    assert run(["info", str(tmp_path / "ck"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().split("\n", 1)[1])
    assert run(["info", str(tmp_path / "ck")]) == 0
    text = capsys.readouterr().out
    assert "tokens seen  5,120" in text and "step         10" in text
    assert summary["step"] == 10 and summary["consumed_tokens"] == 10 * 8 * 64
    assert summary["parameters"] == tiny_llama().num_params() and summary["layout_short"].startswith("tp1")
    # Truncate the payload: verify (and any converter) refuses with one line, exit 2.
    payload = next(resolve_checkpoint(tmp_path / "ck").glob("*.distcp"))
    payload.write_bytes(payload.read_bytes()[:-100])
    for argv in (["verify", str(tmp_path / "ck")],
                 ["export", "--format", "hf", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "x")]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and ("checksum mismatch" in err or "truncated" in err or "corrupt" in err)
    assert not (tmp_path / "x").exists()


def test_not_a_checkpoint_exit_2(tmp_path, capsys):
    from tessera.ckpt_convert.cli import main

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["info", str(tmp_path / "empty")])
    assert exc.value.code == 2
    assert "not a Tessera checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["export", "reshard", "trtllm"])
def test_corrupt_payload_same_size_exit_2_no_output(tmp_path, tokenizer_dir, capsys, verb):
    """A flipped byte inside tensor data reads fine; only the checksum catches it, and the
    converters must then refuse with one line and leave no output."""
    from tessera.ckpt_convert.cli import main

    make_checkpoint(tmp_path / "ck", tiny_llama(num_layers=2), tokenizer_dir)
    payload = next(resolve_checkpoint(tmp_path / "ck").glob("*.distcp"))
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    argv = {"export": ["export", "--format", "hf"], "trtllm": ["export", "--format", "trtllm"],
            "reshard": ["reshard", "--tensor-parallel", "2", "--pipeline-parallel", "1"]}[verb]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "checksum mismatch" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
