"""The GPU session's FP8 scripts, checked on CPU before a lease spends time on them.

benchmarks/fp8_convergence.py refuses fp8 on CPU with the trainer's one line before any work, and
its --dry-run trains both halves (fp8 emulated by torchao on CPU) from the same init and data to
losses within its 1% acceptance; benchmarks/train_throughput.py --precision fp8 converts the same
layers in Tessera and transformers and both train to the same loss; benchmarks/torchtitan_peer.py's
generated tokenizer and data are what torchtitan's loader reads (skipped without torchtitan).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tessera.common.errors import UserError

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fp8_convergence_refuses_fp8_on_cpu_before_training():
    convergence = load("fp8_convergence")
    with pytest.raises(UserError) as err:
        convergence.main(["--device", "cpu"])
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("training.precision=fp8 needs an NVIDIA GPU with FP8 tensor cores")


def test_fp8_convergence_dry_run_trains_both_halves_from_the_same_start_to_the_same_loss(tmp_path, capsys):
    pytest.importorskip("torchao")
    out = tmp_path / "convergence.json"
    load("fp8_convergence").main(["--dry-run", "--json", str(out)])
    figures = json.loads(out.read_text())
    bf16, fp8 = figures["runs"]["bf16"], figures["runs"]["fp8"]
    assert len(bf16["losses"]) == len(fp8["losses"]) == 8
    assert bf16["fp8_layers"] == 0 and fp8["fp8_layers"] == 2 * 7, "every projection, not the head"
    assert bf16["losses"][0] == pytest.approx(fp8["losses"][0], rel=1e-2), "same init, same first batch"
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.3, "the generated phrases are learnable"
    assert figures["loss_rel_diff"] < 0.01
    assert "fp8 vs bf16 differ by" in capsys.readouterr().out


def test_throughput_benchmark_in_fp8_converts_the_same_layers_in_both_frameworks(tmp_path, capsys):
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    out = tmp_path / "figures.json"
    load("train_throughput").main([
        "--hidden", "64", "--heads", "2", "--kv-heads", "2", "--ffn", "128", "--vocab", "512", "--layers", "2",
        "--seq", "32", "--batch", "2", "--warmup", "1", "--steps", "2", "--threads", "1", "--no-compile",
        "--precision", "fp8", "--fp8-emulate", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert results["tessera"]["fp8_layers"] == results["transformers"]["fp8_layers"] == 2 * 7
    # Same weights, data and Float8 casts: the same loss after 1 + 2 steps (bf16 autocast in both).
    assert results["tessera"]["final_loss"] == pytest.approx(results["transformers"]["final_loss"], rel=1e-2)
    assert "fp8 (tensorwise, torchao Float8Linear, emulated)" in capsys.readouterr().out


def test_throughput_benchmark_refuses_fp8_on_cpu_with_one_line():
    with pytest.raises(UserError, match="^training.precision=fp8 needs an NVIDIA GPU"):
        load("train_throughput").main(["--layers", "1", "--precision", "fp8"])


@pytest.mark.parametrize("extra, line", [
    (["--fp8-emulate"], "--fp8-emulate is torchao's"),
    ([], "training.fp8_backend=te needs NVIDIA Transformer Engine, which cannot be imported here"),
])
def test_throughput_benchmark_refuses_what_transformer_engine_cannot_run_with_one_usage_line(
        monkeypatch, capsys, extra, line):
    """--fp8-backend te: TE's refusals (here: not importable) are usage errors, exit 2, one line."""
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(SystemExit) as exited:
        load("train_throughput").main(["--layers", "1", "--precision", "fp8", "--fp8-backend", "te", "--no-compile",
                                       "--only", "tessera", *extra])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert line in err and "Traceback" not in err


def torchtitan_peer(release: tuple[int, int]):
    """The peer script, when the installed torchtitan is of `release`'s generation (0.2.x or 0.3.x):
    CI installs 0.2.2 (requirements-dev.txt: it imports on torch 2.10 and later), whose wheels and
    0.3.0's travel to the GPU machine (benchmarks/gpu_session.py)."""
    pytest.importorskip("torchtitan")
    peer = load("torchtitan_peer")
    if peer.torchtitan_release()[:2] != release:
        pytest.skip(f"torchtitan {'.'.join(map(str, peer.torchtitan_release()))} is installed")
    return peer


def peer_args(precision="bf16", attn_backend="flex", seq=256):
    import argparse

    return argparse.Namespace(flavor="1B", seq=seq, batch=2, steps=2, warmup=1, precision=precision,
                              fp8_recipe="tensorwise", attn_backend=attn_backend, no_compile=True)


def test_torchtitan_0_3_config_is_tesseras_llama_1b_and_its_loader_reads_the_generated_data(tmp_path):
    peer = torchtitan_peer((0, 3))
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    assets, data = peer.write_assets(tmp_path, documents=4, words_per_document=600)
    config = peer.trainer_config(peer_args(), assets, data, tmp_path / "outputs")
    assert config.model_spec.model.dim == 2048 and len(config.model_spec.model.layers) == 16
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(assets))
    assert tokenizer.encode("w0 w1") == [tokenizer.bos_id, 3, 4, tokenizer.eos_id]
    loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=256,
                                     local_batch_size=2)
    inputs, labels = next(iter(loader))
    assert inputs["input"].shape == labels.shape == (2, 256)


def test_torchtitan_0_2_parses_the_peers_toml_into_tesseras_llama_1b_with_fp8_everywhere_but_the_tied_head(tmp_path):
    """The TOML goes through torchtitan 0.2.x's own ConfigManager (tyro) and its train spec builds the
    model as its Trainer does (meta device, then the model converters): Tessera's llama-1b parameter
    for parameter, every block projection Float8Linear, the head bf16 and tied to the embedding."""
    peer = torchtitan_peer((0, 2))
    import torch
    from torchao.float8.float8_linear import Float8Linear
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    from tessera.common.models.causal_lm.config import preset

    assets, data = peer.write_assets(tmp_path, documents=2, words_per_document=100)
    config = peer.job_config(peer_args("fp8", "sdpa", seq=4096), assets, data, tmp_path / "outputs")
    assert (config.model.name, config.model.flavor, config.model.converters) == (
        "llama3", "1B", ["tie_embeddings", "quantize.linear.float8"])
    assert (config.training.local_batch_size, config.training.seq_len, config.training.steps) == (2, 4096, 3)
    assert config.quantize.linear.float8.recipe_name == "tensorwise"
    assert config.activation_checkpoint.mode == "none" and not config.checkpoint.enable
    config.quantize.linear.float8.emulate = True  # the converter's CPU mode (eager only); on the GPU: SM89+

    spec = get_train_spec(config.model.name)
    model_args = spec.model_args[config.model.flavor]
    model_args.update_from_config(config)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    build_model_converters(config, ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1,
                                                world_size=1)).convert(model)
    assert model.output.weight is model.tok_embeddings.weight and type(model.output) is torch.nn.Linear
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 16 * 7
    assert sum(p.numel() for p in model.parameters()) == preset("llama-1b").num_params()
    assert model.layers["0"].feed_forward.w1.weight.shape == (8192, 2048)
    assert model.layers["0"].attention.wk.weight.shape == (8 * 64, 2048)


def test_torchtitan_0_2_reads_the_generated_tokenizer_and_data_through_its_own_loader(tmp_path):
    peer = torchtitan_peer((0, 2))
    from torchtitan.components.tokenizer import build_hf_tokenizer
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    assets, data = peer.write_assets(tmp_path, documents=4, words_per_document=600)
    config = peer.job_config(peer_args(), assets, data, tmp_path / "outputs")
    tokenizer = build_hf_tokenizer(config)
    assert tokenizer.encode("w0 w1", add_bos=True, add_eos=True) == [tokenizer.bos_id, 3, 4, tokenizer.eos_id]
    loader = build_text_dataloader(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, job_config=config)
    inputs, labels = next(iter(loader))
    assert inputs["input"].shape == labels.shape == (2, 256)


def test_torchtitan_peer_refuses_an_attention_backend_its_torchtitan_lacks_with_one_line(capsys):
    peer = torchtitan_peer((0, 2))
    with pytest.raises(SystemExit) as exited:
        peer.main(["--attn-backend", "flex_flash", "--precisions", "bf16"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--attn-backend flex_flash: torchtitan 0.2 has sdpa, flex, varlen" in err


def test_torchtitan_peer_tokenizer_encodes_the_generated_words(tmp_path):
    from tokenizers import Tokenizer

    assets, data = load("torchtitan_peer").write_assets(tmp_path, words=50, documents=2, words_per_document=100)
    tokenizer = Tokenizer.from_file(str(assets / "tokenizer.json"))
    first = json.loads((data / "train.jsonl").read_text().splitlines()[0])["text"]
    ids = tokenizer.encode(first).ids
    assert len(ids) == 100 and all(3 <= i < 53 for i in ids), "every generated word is one known token"
    config = json.loads((assets / "tokenizer_config.json").read_text())
    assert tokenizer.token_to_id(config["bos_token"]) == 0 and tokenizer.token_to_id(config["eos_token"]) == 1


# torchtitan 0.2.x picks CUDA when no accelerator is found: this points its device globals at the
# CPU (gloo, no memory statistics; one rank, so nothing to wait for) so its Trainer can run the peer's worker on a tiny Llama here.
CPU_WORKER = '''
import importlib.util, sys, types
import torch
import torchtitan.components.metrics as metrics
import torchtitan.distributed.parallel_dims as parallel_dims
import torchtitan.distributed.utils as dist_utils
import torchtitan.tools.utils as tools
import torchtitan.train as train

train.time = types.SimpleNamespace(**{**vars(train.time), "sleep": lambda seconds: None})  # "for other ranks"
cpu = types.SimpleNamespace(**{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")})
cpu.current_device = lambda: 0
tools.device_type = parallel_dims.device_type = dist_utils.device_type = metrics.device_type = "cpu"
tools.device_module = dist_utils.device_module = metrics.device_module = cpu


class NoMemoryStatistics:
    device_name, device_capacity_gib = "cpu", 1.0

    def get_peak_stats(self):
        return metrics.DeviceMemStats(0, 0, 0, 0, 0, 0)

    def reset_peak_stats(self):
        pass


metrics.build_device_memory_monitor = NoMemoryStatistics
spec = importlib.util.spec_from_file_location("peer", sys.argv[1])
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)
peer.LLAMA32_1B.update(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=8003, multiple_of=64)
peer.main(sys.argv[2:])
'''


def test_torchtitan_0_2_trainer_runs_the_peers_worker_and_its_step_metrics_summarize(tmp_path):
    """The worker end to end through torchtitan 0.2.x's own Trainer (built from the TOML, trained,
    closed), with its per-step metrics recorded and summarized as on the GPU, at a tiny width."""
    import subprocess

    peer = torchtitan_peer((0, 2))
    script, out = tmp_path / "cpu_worker.py", tmp_path / "bf16.json"
    script.write_text(CPU_WORKER)
    run = subprocess.run([sys.executable, str(script), str(BENCHMARKS / "torchtitan_peer.py"), "--worker",
                          "--precision", "bf16", "--seq", "64", "--batch", "2", "--steps", "3", "--warmup", "1",
                          "--no-compile", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    recorded = json.loads(out.read_text())
    assert recorded["torchtitan"].startswith("0.2") and [s["step"] for s in recorded["steps"]] == [1, 2, 3, 4]
    figures = peer.summarize(recorded, peer_args(), flops_per_token=1e6, peak=None)
    assert figures["steps_timed"] == 3 and figures["tokens_per_s"] > 0
    assert figures["tflops"] == pytest.approx(figures["tokens_per_s"] * 1e6 / 1e12)
    assert 7 < figures["final_loss"] < 11, "about ln(8003) for an untrained model"
