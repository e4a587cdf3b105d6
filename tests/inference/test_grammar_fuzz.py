"""Property-based fuzzing of structured-output constraints: whatever grammar, JSON schema, regex
or choice list a client sends, the answer is never a 5xx, a stream never ends in a server error,
no process dies, and the server's memory stays bounded.

Bounded: EXAMPLES generated requests (hypothesis, derandomized: CI runs the same cases every
time) through an in-process ASGI client against the thread engine and a tiny model, max_tokens
at most 4. The generators mix well-formed constraints (so many reach the engine and sample) with
the shapes that once killed the server: rule chains, `$ref` fan-out, nested counted repetition,
long choice lists, special tokens outside the vocabulary, broken syntax.
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inference_helpers import assert_alive_and_drained, make_engine

from tessera.inference.engine.frontend import AsyncEngine
from tessera.inference.entrypoints.grammar_check import PROCESSES
from tessera.inference.entrypoints.server import OpenAIServer, ServerLimits

EXAMPLES = 1000
# What the server process may grow by over the run: the engine keeps up to 64 compiled grammars
# (Grammars._CACHED) and the check up to 1,024 verdicts; measured growth on this machine: see
# docs/security.md. Before the static bounds one schema alone took 18 GiB.
RSS_BOUND = 200 * 2**20

small_int = st.integers(0, 20)
big_int = st.sampled_from([0, 1, 2, 999, 1000, 2000, 5000, 10**5, 10**9])
count = st.one_of(small_int, big_int)

# ---- regexes ------------------------------------------------------------------------------------
regex_atom = st.sampled_from(["a", "b", "xy", "[a-z]", "[0-9]", r"\d", r"\w", ".", "[^a]", r"\.", "[{]", "é"])
regex = st.recursive(regex_atom, lambda inner: st.one_of(
    st.tuples(inner, inner).map("".join),
    st.tuples(inner, inner).map(lambda t: f"{t[0]}|{t[1]}"),
    inner.map(lambda r: f"({r})"),
    st.tuples(inner, count).map(lambda t: f"({t[0]}){{{t[1]}}}"),
    st.tuples(inner, small_int, count).map(lambda t: f"({t[0]}){{{t[1]},{t[2]}}}"),
    inner.map(lambda r: f"({r})*"), inner.map(lambda r: f"({r})+?"),
), max_leaves=10)
junk_regex = st.text(alphabet="ab()[]{}|*+?\\.^$,0123456789-~", max_size=24)

# ---- Lark grammars ------------------------------------------------------------------------------
lark_item = st.one_of(
    st.text(alphabet="abc xyz{}()", min_size=1, max_size=5).map(json.dumps),
    regex.map(lambda r: "/" + r.replace("/", "") + "/"),
    st.sampled_from(["<[0]>", "<[511]>", "<[512]>", "<[99999]>", "<[1-3]>", "<|endoftext|>", "<|bos|>", "<|nope|>",
                     "r1", "r2", "undefined_rule", '%json {"type": "integer"}', '%json {"$ref": "#"}']),
)
lark_expr = st.recursive(lark_item, lambda inner: st.one_of(
    st.lists(inner, min_size=1, max_size=3).map(" ".join),
    st.lists(inner, min_size=2, max_size=3).map(" | ".join),
    inner.map(lambda e: f"({e})"),
    st.tuples(inner, count).map(lambda t: f"({t[0]}){{{t[1]}}}"),
    st.tuples(inner, small_int, count).map(lambda t: f"({t[0]}) ~ {t[1]}..{t[2]}"),
    inner.map(lambda e: f"({e})*"), inner.map(lambda e: f"[{e}]"),
), max_leaves=8)


def chain(n: int) -> str:
    return "\n".join(["start: r0"] + [f'r{i}: r{i + 1} "x"' for i in range(n)] + [f'r{n}: "y"'])


lark = st.one_of(
    st.tuples(lark_expr, lark_expr, lark_expr).map(lambda t: f"start: {t[0]}\nr1: {t[1]}\nr2: {t[2]}"),
    lark_expr.map(lambda e: f"start: {e}"),
    st.sampled_from([1, 10, 300, 499, 600, 2000, 6000]).map(chain),
    st.text(max_size=40),
)

# ---- JSON schemas -------------------------------------------------------------------------------
schema_leaf = st.one_of(
    st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
                     {"type": "null"}, {}, {"type": "string", "maxLength": 10**9}, {"type": "string", "minLength": 3},
                     {"type": "integer", "minimum": -1e300, "maximum": 1e300}, {"type": "number", "multipleOf": 1e-300},
                     {"enum": [1, "a", None]}, {"const": "x"}, {"$ref": "#/$defs/d0"}, {"$ref": "#"},
                     {"$ref": "#/nope"}, {"type": "wat"}, {"type": ["string", "integer"]}]),
    regex.map(lambda r: {"type": "string", "pattern": r}),
)
key = st.text(alphabet="abcxyz_", min_size=1, max_size=4)
schema = st.recursive(schema_leaf, lambda inner: st.one_of(
    st.dictionaries(key, inner, max_size=3).map(lambda p: {"type": "object", "properties": p, "required": list(p)[:2],
                                                           "additionalProperties": False}),
    st.tuples(inner, small_int, count).map(lambda t: {"type": "array", "items": t[0], "minItems": t[1],
                                                      "maxItems": t[2]}),
    st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs}),
    st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"allOf": xs}),
    st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"oneOf": xs}),
), max_leaves=10)


def fanout(levels: int) -> dict:
    defs = {"d0": {"type": "object", "properties": {"a": {"type": "string"}}}}
    for i in range(1, levels + 1):
        defs[f"d{i}"] = {"allOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"$ref": f"#/$defs/d{i - 1}"}]}
    return {"$defs": defs, "$ref": f"#/$defs/d{levels}"}


def ref_chain(levels: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(levels)}
    defs[f"d{levels}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


top_schema = st.one_of(
    schema,
    st.tuples(schema, schema).map(lambda t: {"$defs": {"d0": t[0]}, **t[1]} if isinstance(t[1], dict) else t[1]),
    st.integers(1, 40).map(fanout),
    st.sampled_from([5, 30, 100, 1000]).map(ref_chain),
    schema.map(json.dumps),
)
choices = st.one_of(
    st.lists(st.text(max_size=6), max_size=20),
    st.sampled_from([10, 999, 1000, 1001, 2001, 5000]).map(lambda n: [f"c{i}" for i in range(n)]),
)

constraint = st.one_of(
    st.tuples(st.just("guided_regex"), st.one_of(regex, junk_regex)),
    st.tuples(st.just("guided_grammar"), lark),
    st.tuples(st.just("guided_json"), top_schema),
    st.tuples(st.just("guided_choice"), choices),
    st.tuples(st.just("response_format"), schema.map(
        lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}})),
    st.tuples(st.just("structured_outputs"), st.one_of(regex.map(lambda r: {"regex": r}),
                                                       lark.map(lambda g: {"grammar": g}))),
)
request = st.fixed_dictionaries({
    "path": st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    "constraint": constraint,
    "max_tokens": st.integers(1, 4),
    "temperature": st.sampled_from([0.0, 1.0]),
    "stream": st.booleans(),
})
FUZZ = dict(deadline=None, derandomize=True, database=None, print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                   HealthCheck.function_scoped_fixture])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _body(req: dict) -> dict:
    field, value = req["constraint"]
    body = {"max_tokens": req["max_tokens"], "temperature": req["temperature"], "stream": req["stream"], field: value}
    if req["path"] == "/v1/completions":
        return {"prompt": "x", **body}
    return {"messages": [{"role": "user", "content": "x"}], **body}


@pytest.mark.timeout(600)
def test_fuzzed_grammars_schemas_and_regexes_never_get_a_5xx_kill_a_process_or_grow_the_server(tiny_ckpt):
    from fastapi.testclient import TestClient

    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=256, max_num_seqs=16)
    frontend = AsyncEngine(engine)
    limits = ServerLimits(max_prompt_tokens=48, max_tokens=4, max_prompts=4, max_body_bytes=4 * 2**20)
    server = OpenAIServer(frontend, "tiny", limits, frontend.metrics)
    statuses: list[int] = []
    with TestClient(server.build_app()) as client:
        for warm in ({"guided_json": {"type": "object"}}, {"guided_regex": "[a-z]+"}):  # lazy set-ups, before measuring
            assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **warm}).status_code == 200
        before = rss_bytes()
        start = time.monotonic()

        @settings(max_examples=EXAMPLES, **FUZZ)
        @given(request)
        def fuzz(req):
            body = _body(req)
            r = client.post(req["path"], content=json.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code < 500, (body, r.text[:500])
            if r.status_code == 200 and body["stream"]:
                assert r.text.rstrip().endswith("data: [DONE]"), (body, r.text[-300:])
                assert "server_error" not in r.text, (body, r.text[-500:])
            assert server.grammar_check.num_processes <= PROCESSES
            statuses.append(r.status_code)

        fuzz()
        took = time.monotonic() - start
        growth = rss_bytes() - before
        counts = {s: statuses.count(s) for s in sorted(set(statuses))}
        print(f"\n{len(statuses)} requests in {took:.1f} s, statuses {counts}, server RSS growth "
              f"{growth / 2**20:.0f} MiB")
        assert_alive_and_drained(client, frontend, engine)
    assert growth < RSS_BOUND, growth
    # Both kinds of answer are common: the fuzzer reached the engine, not only the validators.
    assert statuses.count(200) >= 60 and statuses.count(400) >= 60, counts
