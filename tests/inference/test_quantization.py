"""--quantization: int8 weight-only weights (torchao) stay close to fp32, are really stored as int8,
and serve through the engine; a quantization the device cannot run is refused before any weight is read.

The model is the tiny random Llama of the other inference tests (untied head scaled x20 so its
choices are well separated; no trained checkpoint ships with the repo). Measured on it (fp32 vs
int8, CPU, torch 2.13, torchao 0.18): teacher-forced top-1 agreement 0.992 on 4 x 256 held-out
tokens, held-out perplexity +0.12% (window 128 and 256), logits' relative error 0.0064; through the
engine, 115 of 128 greedy tokens (8 prompts x 16) come before the first divergence. The bounds below
keep a margin over those figures.
"""

from __future__ import annotations

import inspect
import json
import string

import pytest
import torch
from inference_helpers import run_all, token_ids

from tessera.common.errors import UserError, run_cli
from tessera.inference.config import EngineConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.llm_engine import LLMEngine
from tessera.inference.worker.loader import load_for_serving
from tessera.inference.worker.quantization import check_quantization, perplexity, quantized_weight_dtypes

pytest.importorskip("torchao")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pair(tiny_ckpt):
    return load_for_serving(tiny_ckpt, CPU, torch.float32), load_for_serving(tiny_ckpt, CPU, torch.float32, "int8")


def held_out_ids(loaded) -> list[int]:
    # The tokenizer was trained on textwrap and json sources; the string module is text it never saw.
    return loaded.tokenizer.encode(inspect.getsource(string))


def test_int8_quantizes_every_linear_weight_to_int8_and_leaves_the_embedding(pair):
    fp32, int8 = pair
    dtypes = quantized_weight_dtypes(int8.model)
    assert len(dtypes) == 2 * 7 + 1  # q k v o gate up down per layer, and the untied head
    assert set(dtypes.values()) == {torch.int8}
    assert set(quantized_weight_dtypes(fp32.model).values()) == {torch.float32}
    assert int8.model.embed_tokens.weight.dtype == torch.float32
    w = int8.model.layers["0"].mlp.up_proj.weight
    assert w.qdata.shape == (128, 64) and w.scale.numel() == 128  # one scale per output channel


def test_int8_logits_stay_close_to_fp32_on_held_out_text(pair):
    fp32, int8 = pair
    x = torch.tensor(held_out_ids(fp32)[:1024]).view(4, 256)
    with torch.no_grad():
        ref, got = fp32.model(x), int8.model(x)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.025, rel  # changed (it is quantized), but little (measured 0.0064)
    agreement = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agreement >= 0.97, agreement  # measured 0.992


def test_int8_held_out_perplexity_is_within_half_a_percent_of_fp32(pair):
    fp32, int8 = pair
    ids = held_out_ids(fp32)
    ref, got = perplexity(fp32.model, ids, 256), perplexity(int8.model, ids, 256)
    assert abs(got / ref - 1) < 0.005, (ref, got)  # measured +0.12%; the issue asks for 1%


def test_int8_engine_greedy_outputs_match_fp32_for_most_tokens(pair):
    fp32, int8 = pair
    g = torch.Generator().manual_seed(5)
    prompts = {f"p{i}": torch.randint(3, 512, (n,), generator=g).tolist()
               for i, n in enumerate((4, 9, 17, 30, 41, 6, 12, 25))}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = {}
    for name, loaded in (("fp32", fp32), ("int8", int8)):
        engine = LLMEngine(loaded, EngineConfig(block_size=16, num_kv_blocks=64, max_num_batched_tokens=64,
                                                max_num_seqs=8), CPU, torch.float32)
        outs[name] = {k: token_ids(v) for k, v in run_all(engine, {k: (p, params) for k, p in prompts.items()}).items()}
    # Greedy decoding compounds one different token into a different continuation, so count the
    # tokens generated before each sequence's first divergence.
    same = 0
    for k in prompts:
        a, b = outs["fp32"][k], outs["int8"][k]
        assert len(a) == len(b) == 16
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 16)
    assert same / (16 * len(prompts)) >= 0.75, same  # measured 115 of 128 (0.90)



def test_fp8_on_cpu_is_refused_before_any_weight_is_read(tmp_path):
    missing = tmp_path / "no-such-checkpoint"  # were the weights read first, this would be "not found"
    with pytest.raises(UserError, match="--quantization fp8 needs a CUDA GPU"):
        load_for_serving(missing, CPU, torch.float32, "fp8")
    check_quantization("int8", CPU)  # int8 runs on CPU


def test_generate_cli_refuses_fp8_on_cpu_in_one_line(tiny_ckpt, tmp_path, capsys):
    from tessera.inference.entrypoints.generate_cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--checkpoint", str(tiny_ckpt), "--prompts", str(prompts), "--output",
                       str(tmp_path / "o.jsonl"), "--device", "cpu", "--quantization", "fp8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--quantization fp8" in err[0] and "use --quantization int8" in err[0], err
    assert not (tmp_path / "o.jsonl").exists()


def test_generate_cli_serves_int8_weights(tiny_ckpt, tmp_path):
    from tessera.inference.entrypoints.generate_cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": true}\n')
    out = tmp_path / "o.jsonl"
    assert main(["--checkpoint", str(tiny_ckpt), "--prompts", str(prompts), "--output", str(out),
                 "--device", "cpu", "--quantization", "int8", "--quiet"]) == 0
    assert len(json.loads(out.read_text())["token_ids"]) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_weights_on_a_gpu_that_has_them_stay_close_to_bf16(tiny_ckpt):
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev) < (8, 9):
        with pytest.raises(UserError, match="needs FP8 tensor cores"):
            load_for_serving(tiny_ckpt, dev, torch.bfloat16, "fp8")
        return
    ref = load_for_serving(tiny_ckpt, dev, torch.bfloat16)
    got = load_for_serving(tiny_ckpt, dev, torch.bfloat16, "fp8")
    assert set(quantized_weight_dtypes(got.model).values()) == {torch.float8_e4m3fn}
    ids = held_out_ids(ref)
    x = torch.tensor(ids[:1024], device=dev).view(4, 256)
    with torch.no_grad():
        a, b = ref.model(x).float(), got.model(x).float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9
    assert abs(perplexity(got.model, ids, 256) / perplexity(ref.model, ids, 256) - 1) < 0.02
