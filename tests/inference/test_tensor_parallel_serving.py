"""Tensor-parallel serving (`--tensor-parallel N`, executor.py): worker processes on gloo, each
holding its shard of the weights and of the KV heads, give the same tokens as one process and as
transformers' `generate`; seeded sampling picks the same tokens; bad sizes are refused before any
weight is read; a dead worker ends the engine instead of hanging it."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from inference_helpers import (
    hf_greedy,
    hf_llama_from,
    make_checkpoint,
    run_all,
    tiny_config,
    token_ids,
    wait_for_health,
)
from test_hf_serving import _gpt2, _llama, _save

from tessera.common.checkpoint import load_model_tensors, resolve_checkpoint
from tessera.common.errors import UserError
from tessera.common.models.causal_lm.config import MoEConfig
from tessera.inference.config import EngineConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.llm_engine import LLMEngine
from tessera.inference.worker.loader import load_for_serving
from tessera.inference.worker.tensor_parallel.executor import TensorParallelExecutor, WorkerDied
from tessera.inference.worker.tensor_parallel.logits_mailbox import LogitsMailbox

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CPU = torch.device("cpu")
PROMPTS = {"a": [4, 9, 200, 31, 77, 5, 6, 7, 8, 120, 3], "b": [17, 300, 2, 2, 45, 1, 99], "c": [5] * 21}
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def engine_for(path, tp: int, **cfg) -> LLMEngine:
    cfg = {"num_kv_blocks": 64, "block_size": 4, **cfg}
    loaded = load_for_serving(path, CPU, torch.float32, tensor_parallel=tp)
    return LLMEngine(loaded, EngineConfig(tensor_parallel=tp, **cfg), CPU, torch.float32)


def generate(path, tp: int, requests: dict, **cfg) -> dict[str, list[int]]:
    engine = engine_for(path, tp, **cfg)
    try:
        return {rid: token_ids(o) for rid, o in run_all(engine, requests).items()}
    finally:
        engine.close()


@pytest.fixture(scope="module")
def gqa_ckpt(tmp_path_factory):
    """Llama with grouped-query attention: 8 query heads over 4 key/value heads (TP2 and TP4)."""
    return make_checkpoint(tmp_path_factory.mktemp("gqa"), tiny_config(num_heads=8, num_kv_heads=4))


def test_tp2_and_tp4_llama_gqa_checkpoint_greedy_equals_one_process_and_transformers(gqa_ckpt):
    requests = {rid: (p, GREEDY) for rid, p in PROMPTS.items()}
    one = generate(gqa_ckpt, 1, requests)
    it = resolve_checkpoint(gqa_ckpt)
    hf = hf_llama_from(tiny_config(num_heads=8, num_kv_heads=4), load_model_tensors(it))
    for rid, prompt in PROMPTS.items():
        assert one[rid] == hf_greedy(hf, prompt, 10), rid
    assert generate(gqa_ckpt, 2, requests) == one
    assert generate(gqa_ckpt, 4, requests) == one


@pytest.mark.parametrize("family", ["llama-gqa", "gpt2", "gpt2-odd-vocabulary"])
def test_tp2_serves_an_hf_directory_token_for_token_like_transformers(tiny_ckpt, tmp_path, family):
    """Each worker reads its slices of the safetensors (GPT-2's fused c_attn split into q/k/v); a
    vocabulary TP does not divide (513) is padded with zero rows whose logits are -inf."""
    hf = {"llama-gqa": lambda: _llama(num_key_value_heads=2), "gpt2": _gpt2,
          "gpt2-odd-vocabulary": lambda: _gpt2(vocab_size=513)}[family]()
    export = _save(hf, tiny_ckpt, tmp_path / "hf")
    got = generate(export, 2, {rid: (p, GREEDY) for rid, p in PROMPTS.items()})
    for rid, prompt in PROMPTS.items():
        assert got[rid] == hf_greedy(hf, prompt, 10), rid


def test_tp2_seeded_sampling_and_logprobs_equal_one_process(gqa_ckpt):
    """Sampling runs on the driver over the gathered logits, with each request's own generator."""
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True,
                             logprobs=3)
    requests = {"s": (PROMPTS["a"], sampled), "g": (PROMPTS["b"], GREEDY)}
    outs = {}
    for tp in (1, 2):
        engine = engine_for(gqa_ckpt, tp)
        try:
            outs[tp] = run_all(engine, requests)
        finally:
            engine.close()
    assert token_ids(outs[2]["s"]) == token_ids(outs[1]["s"])
    assert token_ids(outs[2]["g"]) == token_ids(outs[1]["g"])
    lp1 = [lp.logprob for o in outs[1]["s"] for lp in o.new_logprobs]
    lp2 = [lp.logprob for o in outs[2]["s"] for lp in o.new_logprobs]
    assert lp2 == pytest.approx(lp1, abs=1e-4)


@pytest.fixture
def logits_heads(monkeypatch) -> list[dict]:
    """The header of every logits reply the driver reads (logits_mailbox.send_rows): shape, and whether
    the rows came through the shared buffer."""
    heads: list[dict] = []
    recv = TensorParallelExecutor._recv

    def watched(self, rank, timeout=None):
        msg = recv(self, rank, timeout)
        if msg.get("t") == "logits":
            heads.append(msg)
        return msg

    monkeypatch.setattr(TensorParallelExecutor, "_recv", watched)
    return heads


def test_tp2_logits_come_through_the_shared_buffer_and_a_step_over_it_through_the_pipe_alike(gqa_ckpt, logits_heads):
    """logits_mailbox.py: decode rows land in the buffer rank 0 shares with the driver; a step with
    more rows than it holds (a prompt's logprobs, with room for 2 x 1 rows) still goes over the pipe.
    Both give one process's tokens and logprobs, and the driver lets go of the file once rank 0 mapped it."""
    scored = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=True, logprobs=2)
    requests = {"p": (PROMPTS["a"], scored), "g": (PROMPTS["b"], GREEDY)}
    outs = {}
    for tp in (1, 2):
        engine = engine_for(gqa_ckpt, tp, max_num_seqs=2)
        try:
            if tp == 2:
                mailbox = engine.runner.executor.mailbox
                assert mailbox is not None and mailbox.numel == 2 * 512
                assert mailbox.path is None  # released once rank 0 mapped it
            outs[tp] = run_all(engine, requests)
        finally:
            engine.close()
    assert {h["mailbox"] for h in logits_heads} == {True, False}
    assert max(h["shape"][0] for h in logits_heads if h["mailbox"]) <= 2 < max(h["shape"][0] for h in logits_heads)
    for rid in requests:
        assert token_ids(outs[2][rid]) == token_ids(outs[1][rid]), rid
    lps = {tp: [lp.logprob for o in outs[tp]["p"] for lp in o.new_logprobs] for tp in (1, 2)}
    assert lps[2] == pytest.approx(lps[1], abs=1e-4)
    prompt = {tp: [lp.logprob for o in outs[tp]["p"] for lp in (o.prompt_logprobs or []) if lp is not None]
              for tp in (1, 2)}
    assert len(prompt[1]) == len(PROMPTS["a"]) - 1 and prompt[2] == pytest.approx(prompt[1], abs=1e-4)


def test_tp2_a_rank_0_that_cannot_map_the_shared_buffer_leaves_the_rows_to_the_pipe(gqa_ckpt, tmp_path, logits_heads,
                                                                                    monkeypatch, caplog):
    """logits_mailbox.open_mailbox: a rank 0 that cannot open the driver's file (here a path that does
    not exist; a locked-down /proc in life) says why in its ready message; the driver warns, drops the
    buffer, and every step's rows come over the pipe: the start does not fail, the tokens are one process's."""
    monkeypatch.setattr(LogitsMailbox, "spec", lambda self: {"path": str(tmp_path / "gone"), "numel": self.numel,
                                                             "vocab_rows": self.vocab_rows})
    requests = {"a": (PROMPTS["a"], GREEDY)}
    with caplog.at_level("WARNING", logger="tessera.inference"):
        engine = engine_for(gqa_ckpt, 2, max_num_seqs=2)
    try:
        assert engine.runner.executor.mailbox is None
        got = {rid: token_ids(o) for rid, o in run_all(engine, requests).items()}
    finally:
        engine.close()
    assert "rank 0 cannot map the shared buffer" in caplog.text and "FileNotFoundError" in caplog.text
    assert logits_heads and not any(h["mailbox"] for h in logits_heads)
    assert not (tmp_path / "gone").exists()  # rank 0 made no file of its own
    assert got == generate(gqa_ckpt, 1, requests)


def test_tp2_with_ngram_speculation_gives_the_greedy_tokens(gqa_ckpt):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    requests = {rid: (p, GREEDY) for rid, p in PROMPTS.items()}
    assert generate(gqa_ckpt, 2, requests, speculative=spec) == generate(gqa_ckpt, 1, requests)


def test_tp2_serves_a_mixture_of_experts_model_like_transformers_with_its_experts_replicated_or_split(tiny_ckpt,
                                                                                                       tmp_path):
    """Mixtral (sliding window, 4 experts): attention is split over the ranks; the MoE MLPs are
    replicated on each, or with --enable-expert-parallel each rank keeps 2 of the 4 experts of every
    MoE layer, runs them on their tokens and the ranks sum the routed outputs. A Tessera (DCP)
    checkpoint of 6 experts and a shared one, added after that sum, gives the one-process tokens."""
    from hf_families import build

    hf = build("mixtral", sliding_window=7)
    export = _save(hf, tiny_ckpt, tmp_path / "hf")
    requests = {rid: (p, GREEDY) for rid, p in PROMPTS.items()}
    numel = {}
    for ep in (False, True):
        engine = engine_for(export, 2, enable_expert_parallel=ep)
        try:
            got = {rid: token_ids(o) for rid, o in run_all(engine, requests).items()}
            numel[ep] = engine.runner.executor.shard_numel
        finally:
            engine.close()
        for rid, prompt in PROMPTS.items():
            assert got[rid] == hf_greedy(hf, prompt, 10), (ep, rid)
    c = hf.config
    experts = c.num_hidden_layers * c.num_local_experts * 3 * c.hidden_size * c.intermediate_size
    assert [a - b for a, b in zip(numel[False], numel[True])] == [experts // 2] * 2
    with pytest.raises(UserError, match="drop the flag"):
        engine_for(tiny_ckpt, 2, enable_expert_parallel=True)  # a dense model: no experts to split
    moe = MoEConfig(num_experts=6, top_k=2, ffn_hidden_size=48, num_shared_experts=1, first_k_dense=1)
    ckpt = make_checkpoint(tmp_path / "dcp", tiny_config(num_layers=3, moe=moe), seed=3)
    assert generate(ckpt, 2, requests, enable_expert_parallel=True) == generate(ckpt, 1, requests)
    with pytest.raises(UserError, match="must divide the 6 experts"):
        engine_for(ckpt, 4, enable_expert_parallel=True)


def test_tessera_generate_with_tensor_parallel_writes_the_one_process_tokens(gqa_ckpt, tmp_path, capsys):
    import json

    from tessera.common.errors import run_cli
    from tessera.inference.entrypoints.generate_cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": rid, "prompt": p, "ignore_eos": True}) + "\n" for rid, p in PROMPTS.items()))
    out = tmp_path / "o.jsonl"
    argv = ["--checkpoint", str(gqa_ckpt), "--prompts", str(prompts), "--output", str(out), "--max-tokens", "10",
            "--num-kv-blocks", "64", "--tensor-parallel", "2", "--quiet"]
    with pytest.raises(SystemExit) as exc:
        run_cli(main, argv)
    assert exc.value.code == 0
    got = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert got == generate(gqa_ckpt, 1, {rid: (p, GREEDY) for rid, p in PROMPTS.items()})


def test_tessera_generate_refuses_a_tensor_parallel_size_that_does_not_fit_the_kv_heads_in_one_line(
        tiny_ckpt, tmp_path, capsys):
    from tessera.common.errors import run_cli
    from tessera.inference.entrypoints.generate_cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--checkpoint", str(tiny_ckpt), "--prompts", str(prompts), "--output",
                       str(tmp_path / "o.jsonl"), "--tensor-parallel", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tensor-parallel 3" in err[0] and "2 key/value heads" in err[0], err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize(("tp", "over", "quantization", "message"), [
    (3, {}, None, "2 key/value heads; a tensor-parallel size above them must be a multiple of them"),
    (8, {}, None, "must divide the 4 attention heads"),
    (3, {"num_heads": 6, "num_kv_heads": 3, "hidden_size": 96}, None, "must divide the 512 vocabulary rows"),
    (2, {}, "int8", "--quantization int8 with --tensor-parallel 2: not supported"),
])
def test_a_tensor_parallel_size_the_model_cannot_be_split_by_is_refused_before_loading(
        tmp_path, monkeypatch, tp, over, quantization, message):
    ckpt = make_checkpoint(tmp_path / "run", tiny_config(**over))
    monkeypatch.setattr("tessera.inference.worker.loader.load_model_tensors", lambda *a, **k: pytest.fail("weights read"))
    with pytest.raises(UserError, match=message):
        load_for_serving(ckpt, CPU, torch.float32, quantization, tensor_parallel=tp)


def test_each_worker_holds_only_its_shard_and_one_that_dies_ends_the_engine(gqa_ckpt):
    engine = engine_for(gqa_ckpt, 2)
    cfg = tiny_config(num_heads=8, num_kv_heads=4)
    total = sum(t.numel() for t in load_model_tensors(resolve_checkpoint(gqa_ckpt)).values())
    norms = cfg.hidden_size * (2 * cfg.num_layers + 1)  # replicated on both ranks
    assert engine.runner.executor.shard_numel == [(total - norms) // 2 + norms] * 2
    # Prepared as one process's model (prepare.py): each layer's stacked q/k/v and gate/up shards
    # oneDNN-packed (o/down are row-parallel layers with their own forward).
    assert engine.runner.executor.packed_linears == [2 * cfg.num_layers] * 2
    procs = list(engine.runner.executor.procs)
    try:
        run_all(engine, {"a": (PROMPTS["a"], GREEDY)})
        os.kill(procs[1].pid, signal.SIGKILL)
        engine.add_request("b", PROMPTS["b"], GREEDY)
        with pytest.raises(WorkerDied, match="worker 1"):
            engine.step()
    finally:
        engine.close()
    assert not any(p.is_alive() for p in procs)


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def tp2_server(gqa_ckpt):
    """`tessera-serve --tensor-parallel 2`: HTTP process -> engine process -> two workers."""
    from ports import SERVE, start_serve

    proc, url, _ = start_serve(SERVE, "--checkpoint", gqa_ckpt, "--quiet", "--num-kv-blocks", "64",
                               "--tensor-parallel", "2", "--torch-threads", "1", "--served-model-name", "tiny")
    wait_for_health(proc, url, 180)
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_openai_client_works_unchanged_against_a_tp2_server_and_sigterm_leaves_no_orphans(tp2_server, gqa_ckpt):
    import subprocess

    from openai import OpenAI

    proc, url = tp2_server
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    r = client.completions.create(model="tiny", prompt=PROMPTS["a"], max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 10
    one = generate(gqa_ckpt, 1, {"a": (PROMPTS["a"], GREEDY)})["a"]
    tok = load_for_serving(gqa_ckpt, CPU, torch.float32, tensor_parallel=2).tokenizer
    assert r.choices[0].text == tok.decode(one)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS["a"], max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if c.choices)
    assert streamed == r.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=5, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0, stream=True)
        if c.choices)
    assert streamed == chat.choices[0].message.content
    below = _descendants(proc.pid)
    assert len(below) >= 3  # the engine process and two workers (and maybe a resource tracker)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("tessera-serve did not exit on SIGTERM")
    assert proc.returncode == 0  # drained and stopped, not killed by the signal
    import time

    deadline = time.time() + 30
    while any(_alive(p) for p in below) and time.time() < deadline:
        time.sleep(0.2)
    assert not [p for p in below if _alive(p)]


def test_a_dead_worker_fails_requests_and_health_instead_of_hanging(tp2_server):
    """As when the engine process dies (test_engine_process): requests 500 server_error, /health 503."""
    import httpx

    proc, url = tp2_server
    from process_tree import assert_gone, descendants

    below = descendants(proc.pid)  # the engine process and its two workers
    workers = [p.pid for p in below if "spawn_main" in _cmdline(p.pid)]
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS["a"], "max_tokens": 4}, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert httpx.get(url + "/health", timeout=10).status_code == 503
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS["a"], "max_tokens": 4}, timeout=60)
    assert r.status_code == 500, r.text
    # The failed engine stopped its other worker and ended its process; the HTTP process stays up.
    assert_gone(below, "an engine whose worker died")
    assert proc.poll() is None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_tessera_serve_refuses_a_tensor_parallel_size_that_does_not_fit_the_kv_heads_in_one_line(tiny_ckpt):
    """From the engine process, before any weight is read or any worker started."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "from tessera.inference.entrypoints.serve_cli import entry; entry()", "--checkpoint",
                        str(tiny_ckpt), "--port", "18931", "--tensor-parallel", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    err = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(err) == 1 and "--tensor-parallel 3" in err[0] and "2 key/value heads" in err[0], r.stderr
    assert "Traceback" not in r.stderr
