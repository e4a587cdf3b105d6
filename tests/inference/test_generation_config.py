"""The model's generation settings (generation_config.json) when serving: an end id only that file
lists survives `tessera-ckpt import` and stops generation; its sampling fields are the defaults of
requests that leave them out (vLLM's --generation-config auto / vllm / FOLDER and
--override-generation-config)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from inference_helpers import hf_llama_from, make_engine, run_all, tiny_config, token_ids
from live_server import LiveServer

from tessera.ckpt_convert.cli import run as ckpt_run
from tessera.common.checkpoint import load_model_tensors, read_sidecar, resolve_checkpoint
from tessera.inference.core.sampling_params import SamplingParams

PROMPT = [4, 9, 200, 31, 77]


@pytest.fixture(scope="module")
def hf_dir(tiny_ckpt, tmp_path_factory):
    """tiny_ckpt's weights as transformers saves a Llama (no end id in config.json), with its tokenizer."""
    out = tmp_path_factory.mktemp("gen") / "hf"
    hf_llama_from(tiny_config(), load_model_tensors(resolve_checkpoint(tiny_ckpt))).save_pretrained(out)
    for f in (resolve_checkpoint(tiny_ckpt) / "tokenizer").iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def greedy(hf_dir):
    """The 10 tokens the model greedily emits after PROMPT, end ids ignored."""
    engine = make_engine(hf_dir, num_kv_blocks=64)
    try:
        out = run_all(engine, {"a": (PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))})["a"]
        return token_ids(out), set(engine.eos_ids)
    finally:
        engine.close()


def _with_generation_config(hf_dir, out, gen: dict):
    shutil.copytree(hf_dir, out)
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def test_an_end_id_only_generation_config_lists_survives_import_and_stops_the_served_checkpoint(
        hf_dir, greedy, tmp_path):
    tokens, eos = greedy
    # An id the model really emits (not at its first step, not before, not an end id already), as
    # Llama-3-Instruct's <|eot_id|>: listed in generation_config.json only.
    i = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] not in eos)
    stop = tokens[i]
    hf = _with_generation_config(hf_dir, tmp_path / "hf", {"eos_token_id": [*sorted(eos), stop]})
    assert ckpt_run(["import", "--format", "hf", "--input", str(hf), "--output", str(tmp_path / "ckpt"),
                     "--quiet"]) == 0
    assert read_sidecar(resolve_checkpoint(tmp_path / "ckpt")).generation.eos_token_ids == [*sorted(eos), stop]
    outs = {}
    for name, path in (("hf", hf), ("checkpoint", tmp_path / "ckpt")):
        engine = make_engine(path, num_kv_blocks=64)
        try:
            out = run_all(engine, {"a": (PROMPT, SamplingParams(max_tokens=10, temperature=0))})["a"]
        finally:
            engine.close()
        outs[name] = (token_ids(out), out[-1].finish_reason)
    assert outs["checkpoint"] == outs["hf"] == (tokens[:i + 1], "stop")


def _body(**over):
    return {"prompt": PROMPT, **over}


def _tokens(server, **over) -> tuple[str, int]:
    r = httpx.post(server.url + "/v1/completions", json=_body(**over), timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


@pytest.fixture(scope="module")
def sampled_hf(hf_dir, tmp_path_factory):
    """The model with generation_config.json defaults (greedy: temperature 0; 3 new tokens), its head
    made flat (x 0.02) so that sampling at temperature 1 and greedy decoding part at once."""
    import torch
    from transformers import LlamaForCausalLM

    out = tmp_path_factory.mktemp("sampled") / "hf"
    shutil.copytree(hf_dir, out)
    hf = LlamaForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        hf.lm_head.weight.mul_(0.02)
    hf.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 3, "top_k": 50, "do_sample": False}))
    return out


def test_a_request_without_sampling_fields_takes_the_models_defaults_and_its_own_values_win(sampled_hf, tmp_path):
    assert ckpt_run(["import", "--format", "hf", "--input", str(sampled_hf), "--output", str(tmp_path / "ckpt"),
                     "--quiet"]) == 0
    server = LiveServer(tmp_path / "ckpt", block_size=8, num_kv_blocks=64)
    try:
        defaults = server.openai.generation_defaults
        # top_k 50 is transformers' own default: vLLM reads the file through to_diff_dict, which drops it.
        assert defaults.values == {"temperature": 0.0, "max_tokens": 3}
        greedy_text, n = _tokens(server, max_tokens=3, temperature=0.0, ignore_eos=True)
        assert n == 3
        # No temperature and max_tokens null (chat's default): the model's temperature 0 and max_new_tokens 3.
        assert _tokens(server, max_tokens=None, ignore_eos=True, seed=1) == (greedy_text, 3)
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}).json()
        assert chat["usage"]["completion_tokens"] == 3
        # The request's own values win: 5 tokens; temperature 1 samples (this model's sampled text is
        # not its greedy text, so the default's greedy output above is no accident of the model).
        assert _tokens(server, max_tokens=5, temperature=0.0, ignore_eos=True)[1] == 5
        assert _tokens(server, max_tokens=None, temperature=1.0, ignore_eos=True, seed=1)[0] != greedy_text
    finally:
        server.stop()


def test_generation_config_vllm_ignores_the_models_defaults_and_the_override_wins(sampled_hf):
    server = LiveServer(sampled_hf, block_size=8, num_kv_blocks=64, generation_config="vllm")
    try:
        assert server.openai.generation_defaults.values == {}
        _, n = _tokens(server, max_tokens=None, ignore_eos=True)
        assert n == 100  # the server's max_tokens limit (LiveServer's ServerLimits), no model default
    finally:
        server.stop()
    server = LiveServer(sampled_hf, block_size=8, num_kv_blocks=64,
                        override_generation_config={"max_new_tokens": 2, "temperature": 0.5})
    try:
        assert server.openai.generation_defaults.values == {"temperature": 0.5, "max_tokens": 2}
        assert _tokens(server, max_tokens=None, ignore_eos=True)[1] == 2
        # vLLM: the override's max_new_tokens caps a request's own max_tokens too.
        assert _tokens(server, max_tokens=6, ignore_eos=True)[1] == 2
    finally:
        server.stop()


def test_generation_config_folder_replaces_the_models_file(sampled_hf, tmp_path):
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4, "top_p": 0.9}))
    server = LiveServer(sampled_hf, block_size=8, num_kv_blocks=64, generation_config=str(folder))
    try:
        defaults = server.openai.generation_defaults
        assert defaults.values == {"top_p": 0.9, "max_tokens": 4} and defaults.max_tokens_cap == 4
        assert _tokens(server, max_tokens=None, ignore_eos=True)[1] == 4
    finally:
        server.stop()


def test_tessera_generate_takes_the_models_defaults_below_its_flags_and_a_lines_fields(sampled_hf, tmp_path):
    from tessera.inference.entrypoints.generate_cli import main as generate_main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in [
        {"id": "model", "prompt": PROMPT, "ignore_eos": True},  # the model's: greedy, 3 tokens
        {"id": "greedy", "prompt": PROMPT, "ignore_eos": True, "temperature": 0.0, "max_tokens": 3},
        {"id": "own", "prompt": PROMPT, "ignore_eos": True, "max_tokens": 5}]) + "\n")

    def generate(*flags) -> dict[str, dict]:
        out = tmp_path / "o.jsonl"
        assert generate_main(["--checkpoint", str(sampled_hf), "--prompts", str(prompts), "--output", str(out),
                              "--num-kv-blocks", "64", "--quiet", *flags]) == 0
        return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}

    rows = generate()
    assert rows["model"]["token_ids"] == rows["greedy"]["token_ids"] and len(rows["model"]["token_ids"]) == 3
    assert len(rows["own"]["token_ids"]) == 5
    assert len(generate("--max-tokens", "4")["model"]["token_ids"]) == 4  # a flag wins over the model
    assert len(generate("--generation-config", "vllm")["model"]["token_ids"]) == 64  # tessera-generate's own


def test_tessera_generate_clamps_the_models_max_tokens_default_to_the_context_left(sampled_hf, tmp_path):
    # Models ship max_new_tokens larger than a short --max-model-len leaves (vLLM takes the smaller):
    # a default, unlike a line's own max_tokens, must fit the room left, as the server clamps it.
    from tessera.common.errors import UserError
    from tessera.inference.entrypoints.generate_cli import main as generate_main

    hf = tmp_path / "hf"
    shutil.copytree(sampled_hf, hf)
    (hf / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4096}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": PROMPT, "ignore_eos": True}) + "\n")
    out = tmp_path / "o.jsonl"
    args = ["--checkpoint", str(hf), "--prompts", str(prompts), "--output", str(out), "--num-kv-blocks", "64",
            "--max-model-len", "16", "--quiet"]
    assert generate_main(args) == 0
    assert json.loads(out.read_text())["completion_tokens"] == 16 - len(PROMPT)
    prompts.write_text(json.dumps({"id": "a", "prompt": PROMPT, "max_tokens": 4096}) + "\n")
    with pytest.raises(UserError, match="maximum context length is 16 tokens"):  # a line's own: refused as before
        generate_main(args)


@pytest.mark.slow
def test_the_engine_process_resolves_a_folder_and_the_override_and_hands_them_to_the_http_side(
        sampled_hf, tmp_path, monkeypatch):
    from tessera.inference.config import EngineConfig
    from tessera.inference.engine.process_client import ProcessEngine

    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 11, "top_p": 0.9}))
    monkeypatch.chdir(tmp_path)  # a relative folder: the flag makes it absolute for the engine process
    from tessera.inference.entrypoints.engine_args import engine_config_from_args
    from tessera.inference.entrypoints.serve_cli import build_parser

    cfg = engine_config_from_args(build_parser().parse_args([
        "--checkpoint", str(sampled_hf), "--num-kv-blocks", "64", "--generation-config", "gen",
        "--override-generation-config", '{"min_p": 0.05}']))
    assert isinstance(cfg, EngineConfig) and cfg.generation_config == str(folder)
    frontend = ProcessEngine.launch(str(sampled_hf), cfg)
    try:
        assert 11 in frontend.eos_ids  # the folder's end id, not only config.json's and the tokenizer's
        d = frontend.generation_defaults
        assert d.values == {"top_p": 0.9, "min_p": 0.05} and d.max_tokens_cap is None
        assert "generation_config.json and --override-generation-config" in d.describe()
    finally:
        frontend.shutdown(timeout=0)
        frontend._proc.wait(timeout=60)


@pytest.mark.parametrize("flags, message", [
    (["--override-generation-config", '{"eos_token_id": 3}'],
     "--override-generation-config: field 'eos_token_id' is not supported; use temperature, top_p, top_k, min_p, "
     "repetition_penalty, max_new_tokens"),
    (["--override-generation-config", '{"temperature": "hot"}'],
     "--override-generation-config: field temperature is 'hot'; expected a number in [0, 100]"),
    (["--override-generation-config", "{"], "--override-generation-config: not valid JSON"),
    (["--generation-config", "/nonexistent-folder"], "--generation-config /nonexistent-folder: no "
     "generation_config.json in that folder"),
])
@pytest.mark.parametrize("cli", ["tessera-serve", "tessera-generate"])
def test_bad_generation_flags_are_one_line_and_exit_2(tiny_ckpt, tmp_path, capsys, flags, message, cli):
    from tessera.common.errors import run_cli
    from tessera.inference.entrypoints import generate_cli, serve_cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    # (--port -1, refused after the engine flags: a flag wrongly accepted fails here, not by starting a server)
    main, extra = ((serve_cli.main, ["--port", "-1"]) if cli == "tessera-serve" else
                   (generate_cli.main, ["--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]))
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--checkpoint", str(tiny_ckpt), *extra, *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_default_vllms_sampler_refuses_too_is_one_line_naming_the_file_field_and_way_out(hf_dir, tmp_path):
    from tessera.common.errors import ArtifactError

    hf = _with_generation_config(hf_dir, tmp_path / "hf", {"top_p": 1.5})
    with pytest.raises(ArtifactError, match=r"generation_config.json: field top_p is 1.5; expected a number in "
                                            r"\(0, 1\] .*serve with --generation-config vllm"):
        make_engine(hf, num_kv_blocks=64)


def test_an_odd_generation_config_vllm_serves_is_served_under_vllm_and_imported(hf_dir, tmp_path, capsys):
    from tessera.ckpt_convert.inspect import info, info_text

    # as real repositories ship them: top_p 0, greedy with do_sample false, top_k 0, a string, a null end id
    odd = {"top_p": 0, "temperature": 0, "do_sample": False, "top_k": 0, "min_p": "0.05", "eos_token_id": None}
    hf = _with_generation_config(hf_dir, tmp_path / "hf", odd)
    engine = make_engine(hf, num_kv_blocks=64, generation_config="vllm")
    try:
        assert engine.generation_defaults.values == {}
        out = run_all(engine, {"a": (PROMPT, SamplingParams(max_tokens=2, temperature=0))})["a"]
        assert len(token_ids(out)) == 2
    finally:
        engine.close()
    assert ckpt_run(["import", "--format", "hf", "--input", str(hf), "--output", str(tmp_path / "ckpt"),
                     "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "field top_p is 0, which the sampler cannot take" in err and "field min_p is '0.05'" in err
    g = read_sidecar(resolve_checkpoint(tmp_path / "ckpt")).generation
    assert (g.temperature, g.top_k, g.top_p, g.min_p, g.ignored) == (0.0, 0, None, None, {"top_p": 0, "min_p": "0.05"})
    line = next(x for x in info_text(info(tmp_path / "ckpt")).splitlines() if x.startswith("generation"))
    assert "ignored top_p 0" in line and "ignored min_p '0.05'" in line, line
    engine = make_engine(tmp_path / "ckpt", num_kv_blocks=64)  # the checkpoint serves its kept defaults
    try:
        assert engine.generation_defaults.values == {"temperature": 0.0, "top_k": 0}
    finally:
        engine.close()


def test_an_end_id_past_the_vocabulary_is_dropped_and_a_min_tokens_request_still_samples(hf_dir, greedy, tmp_path):
    # Such an id is never generated; kept, the min_tokens mask indexed the logits with it ("sampling failed").
    tokens, eos = greedy
    hf = _with_generation_config(hf_dir, tmp_path / "hf", {"eos_token_id": [*sorted(eos), 100000]})
    engine = make_engine(hf, num_kv_blocks=64)
    try:
        assert set(engine.eos_ids) == eos
        out = run_all(engine, {"a": (PROMPT, SamplingParams(max_tokens=4, min_tokens=2, temperature=0,
                                                            ignore_eos=True))})["a"]
        assert token_ids(out) == tokens[:4]
    finally:
        engine.close()


def test_a_draft_models_generation_config_is_not_read_for_sampling_defaults(hf_dir, greedy, tmp_path):
    # Only the target's file gives defaults (as in vLLM): a draft's odd file must not refuse the server.
    from tessera.inference.config import SpeculativeConfig

    draft = _with_generation_config(hf_dir, tmp_path / "draft", {"top_p": 0, "temperature": "0.7"})
    engine = make_engine(hf_dir, num_kv_blocks=64, speculative=SpeculativeConfig(model=str(draft),
                                                                                  num_speculative_tokens=2))
    try:
        out = run_all(engine, {"a": (PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))})["a"]
        assert token_ids(out) == greedy[0][:4]
    finally:
        engine.close()


def test_a_generation_config_that_is_not_json_serves_and_imports_without_it(hf_dir, greedy, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(hf_dir, hf)
    (hf / "generation_config.json").write_text('{"eos_token_id": [0, 9], "temperature": 0.6,}')  # trailing comma
    engine = make_engine(hf, num_kv_blocks=64)
    try:
        assert set(engine.eos_ids) == greedy[1] and engine.generation_defaults.values == {}
    finally:
        engine.close()
    assert ckpt_run(["import", "--format", "hf", "--input", str(hf), "--output", str(tmp_path / "ckpt"),
                     "--quiet"]) == 0
    assert read_sidecar(resolve_checkpoint(tmp_path / "ckpt")).generation is None


def test_the_request_fields_it_sets_win_over_the_defaults_and_those_it_leaves_out_take_them():
    from tessera.inference.core.generation_defaults import GenerationDefaults
    from tessera.inference.entrypoints.protocol import ChatCompletionRequest

    defaults = GenerationDefaults({"temperature": 0.0, "top_p": 0.5, "top_k": 7, "min_p": 0.1,
                                   "repetition_penalty": 1.2, "max_tokens": 3})
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.7, top_k=-1)
    p = body.sampling_params(10, None, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.7, 0.5, 0, 0.1, 1.2)
    plain = body.sampling_params(10, None)  # no defaults: SamplingParams' own
    assert (plain.top_p, plain.top_k, plain.min_p, plain.repetition_penalty) == (1.0, 0, 0.0, 1.0)


@pytest.mark.parametrize("mode, override, values, cap", [
    # auto: the file's fields (transformers' own defaults dropped, as vLLM's to_diff_dict does); top_k -1 -> 0 (off)
    ("auto", {}, {"temperature": 0.6, "top_k": 0, "max_tokens": 9}, None),
    ("vllm", {}, {}, None),  # none of the model's
    ("vllm", {"top_p": 0.5}, {"top_p": 0.5}, None),  # the override applies under vllm too
    ("auto", {"temperature": 1.0, "max_new_tokens": 4}, {"temperature": 1.0, "top_k": 0, "max_tokens": 4}, 4),
    ("/folder", {}, {"temperature": 0.6, "top_k": 0, "max_tokens": 9}, 9),  # a folder's max_new_tokens caps
])
def test_resolution_follows_vllms_rules(mode, override, values, cap):
    from tessera.common.hf.generation import GenerationSettings
    from tessera.inference.core.generation_defaults import resolve_defaults

    record = GenerationSettings(temperature=0.6, top_p=1.0, top_k=-1, repetition_penalty=1.0, max_new_tokens=9)
    d = resolve_defaults(record, mode, override, "g.json")
    assert (d.values, d.max_tokens_cap) == (values, cap)


@pytest.mark.slow
def test_tessera_serve_logs_the_defaults_it_applies_and_serves_them_from_the_engine_process(sampled_hf):
    from ports import SERVE, start_serve

    proc, url, lines = start_serve(SERVE, "--checkpoint", sampled_hf, "--num-kv-blocks", "16",
                                   "--override-generation-config", '{"top_p": 0.5}')
    try:
        line = next(x for x in lines if "sampling defaults" in x)
        assert (f"tessera-serve: sampling defaults from {sampled_hf / 'generation_config.json'} and "
                "--override-generation-config: temperature=0.0, top_p=0.5, max_tokens=3 (a request's own values "
                "win; --generation-config vllm ignores the model's)") == line.strip()
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    finally:
        proc.kill()
        proc.wait()
