"""Structured output (llguidance): response_format json_object / json_schema and vLLM's
guided_json / guided_regex / guided_choice, in completions and chat, streamed too, composed with
continuous batching (constrained and free requests in one batch, one masked fill)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
import torch
from inference_helpers import make_engine, run_all, token_ids
from live_server import LiveServer

from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.core.structured_spec import StructuredSpec
from tessera.inference.entrypoints.server import ServerLimits
from tessera.inference.sample.structured import apply_bitmask, grammar_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    s = LiveServer(tiny_ckpt, block_size=8, num_kv_blocks=512, max_num_seqs=64,
                   limits=ServerLimits(max_prompt_tokens=64, max_tokens=200, max_prompts=16))
    yield s
    s.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300)


def test_json_schema_outputs_of_100_sampled_requests_parse_and_validate(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    def one(i: int) -> list[dict]:
        r = post(server, "/v1/completions", {"prompt": f"Person {i}:", "n": 10, "max_tokens": 150, "temperature": 1.0,
                                             "seed": i, "response_format": fmt})
        assert r.status_code == 200, r.text
        return r.json()["choices"]

    # 10 requests x n=10 at once: constrained sequences decode together in every step.
    with ThreadPoolExecutor(10) as pool:
        choices = [c for cs in pool.map(one, range(10)) for c in cs]
    assert len(choices) == 100
    texts = set()
    for c in choices:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["text"]), SCHEMA)
        texts.add(c["text"])
    assert len(texts) > 20  # sampled, not one greedy answer (the tiny model is peaked: 43 distinct seen)
    assert server.wait_idle()


def test_json_object_regex_and_choice_in_chat_completions_and_streams(server):
    messages = [{"role": "user", "content": "give me JSON"}]
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 120, "temperature": 1.0, "seed": 3,
                                              "response_format": {"type": "json_object"}}).json()
    assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    # streamed chat deltas join into text matching the regex
    pieces = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": 30, "temperature": 1.0, "seed": 5, "stream": True,
            "guided_regex": r"[a-z]{3}-[0-9]{2}"}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                pieces.append(chunk["choices"][0]["delta"].get("content") or "")
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", "".join(pieces)), pieces
    choices = ["yes", "no", "maybe later"]
    got = post(server, "/v1/completions", {"prompt": "Answer:", "n": 8, "max_tokens": 20, "temperature": 1.0,
                                           "seed": 1, "guided_choice": choices}).json()["choices"]
    assert {c["text"] for c in got} <= set(choices)
    got = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 60, "temperature": 1.0, "seed": 2,
                                           "guided_json": SCHEMA, "stream": True, "stream_options": {"include_usage": True}})
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in got.text.splitlines()
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)
    got = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 60, "temperature": 0,
                                           "structured_outputs": {"choice": ["left", "right"]}}).json()
    assert got["choices"][0]["text"] in ("left", "right")


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "a("}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_regex": "a+", "min_tokens": 2}, None),
])
def test_a_bad_constraint_is_a_400_naming_its_field(server, body, param):
    r = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text
    else:
        assert "min_tokens" in r.json()["error"]["message"]


def test_free_requests_batched_with_constrained_ones_are_unchanged(tiny_ckpt):
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    alone = run_all(make_engine(tiny_ckpt, block_size=8, num_kv_blocks=128), {"free": ([5, 6, 7], free)})
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=128)
    mixed = {"free": ([5, 6, 7], free)}
    for i in range(4):
        mixed[f"json{i}"] = ([9, 10, i], SamplingParams(max_tokens=150, temperature=1.0, seed=i,
                                                        structured=StructuredSpec(kind="json", value=SCHEMA)))
    outs = run_all(engine, mixed)
    assert token_ids(outs["free"]) == token_ids(alone["free"])
    for i in range(4):
        text = "".join(o.new_text for o in outs[f"json{i}"])
        jsonschema.validate(json.loads(text), SCHEMA)
        assert outs[f"json{i}"][-1].finish_reason == "stop"


def test_the_bitmask_is_applied_to_the_listed_rows_only():
    torch.manual_seed(0)
    logits = torch.randn(4, 70)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32)
    rows = torch.tensor([1, 3])
    out = logits.clone()
    apply_bitmask(out, rows, bitmask)
    expected = logits.clone()
    for r, mask in zip(rows.tolist(), bitmask.tolist()):
        for t in range(70):
            if not (mask[t // 32] >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    assert torch.equal(out, expected)


def test_the_bitmask_of_every_row_and_one_wider_than_the_bitmask_mask_as_the_listed_rows_do():
    torch.manual_seed(1)
    logits = torch.randn(2, 70)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 2), dtype=torch.int32)  # covers 64 of 70 tokens
    every, listed = logits.clone(), logits.clone()
    apply_bitmask(every, None, bitmask)
    apply_bitmask(listed, torch.tensor([0, 1]), bitmask)
    assert torch.equal(every, listed)
    assert torch.isinf(every[:, 64:]).all()  # past the bitmask: disallowed
    for r, mask in enumerate(bitmask.tolist()):
        for t in range(64):
            assert bool((mask[t // 32] >> (t % 32)) & 1) == bool(torch.isfinite(every[r, t]))


def _constrained(grammars, spec, output_ids=()):
    """A sequence as the mask code sees it: a matcher advanced by `output_ids`."""
    from types import SimpleNamespace

    seq = SimpleNamespace(matcher=grammars.matcher(spec), output_ids=[], ahead_mask=None)
    for t in output_ids:
        assert seq.matcher.consume_token(t)
        seq.output_ids.append(t)
    return seq


def test_masks_computed_ahead_equal_masks_computed_when_sampling_and_a_stale_one_is_not_used(tiny_ckpt):
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=64)
    grammars, vocab = engine.grammars, engine.loaded.config.vocab_size
    spec = StructuredSpec(kind="json", value=SCHEMA)
    prefix = grammars.tokenizer.tokenize_str('{"name":"ab')
    seqs = [_constrained(grammars, spec), _constrained(grammars, spec, prefix),
            _constrained(grammars, StructuredSpec(kind="choice", value=["yes", "no"]))]
    fresh = grammar_bitmask(seqs, vocab)  # nothing computed ahead: all rows now
    assert not torch.equal(fresh[0], fresh[1]) and not torch.equal(fresh[0], fresh[2])
    grammars.compute_ahead(seqs)
    grammars.wait()
    assert all(s.ahead_mask is not None for s in seqs)
    assert torch.equal(grammar_bitmask(seqs, vocab), fresh)
    assert torch.equal(grammar_bitmask(seqs[::-1], vocab), fresh.flip(0))  # rows taken by sequence
    # The first sequence advances after its mask was computed: its old mask is not used.
    token = prefix[0]
    assert seqs[0].matcher.consume_token(token)
    seqs[0].output_ids.append(token)
    now = grammar_bitmask(seqs, vocab)
    assert torch.equal(now[0], grammar_bitmask([_constrained(grammars, spec, [token])], vocab)[0])
    assert not torch.equal(now[0], fresh[0]) and torch.equal(now[1:], fresh[1:])


def test_matchers_of_one_grammar_are_independent_copies(tiny_ckpt):
    """Matchers are copies of one compiled grammar: advancing one leaves the others, and the
    cached original, at the start."""
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=64)
    grammars, vocab = engine.grammars, engine.loaded.config.vocab_size
    spec = StructuredSpec(kind="json", value=SCHEMA)
    start = grammar_bitmask([_constrained(grammars, spec)], vocab)
    advanced = _constrained(grammars, spec, grammars.tokenizer.tokenize_str('{"name":"x'))
    later = _constrained(grammars, spec)
    assert not torch.equal(grammar_bitmask([advanced], vocab), start)
    assert torch.equal(grammar_bitmask([later], vocab), start)
