"""Property-based fuzzing of hostile chat templates: whatever a model's template does (nested
loops over huge ranges, repetition, powers, format widths, recursive macros, doubling
concatenation, set blocks, recursive loops, filters that build large values), a chat request
gets a 200 or a 400, never a 5xx; the server never dies, answers /health and an ordinary
completion afterwards, and its own memory stays flat (renders run in bounded child processes).

Bounded: 60 generated templates (hypothesis, derandomized), each rendered once through the
server's chat endpoint under small limits (0.5 s, 20,000 iterations, 200,000 characters,
128 MiB), so the whole run takes seconds.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inference_helpers import make_engine

from tessera.common.chat_template import RenderLimits
from tessera.inference.engine.frontend import AsyncEngine
from tessera.inference.entrypoints.server import OpenAIServer, ServerLimits

EXAMPLES = 60
LIMITS = RenderLimits(timeout_s=0.5, max_iterations=20_000, max_chars=200_000, max_memory_mb=128)

size = st.sampled_from(["0", "3", "1000", "99999", "10**6", "10**9", "10**10"])
text = st.sampled_from(["'a'", "'ab '", "(messages|tojson)", "messages[0]['content']", "'%s%s'"])


def _value() -> st.SearchStrategy[str]:
    return st.one_of(
        size.map(lambda n: f"range({n})"),
        st.tuples(text, size).map(lambda a: f"({a[0]} * {a[1]})"),
        size.map(lambda n: f"([1, 2] * {n})"),
        st.tuples(size, st.sampled_from(["2", "99", "10**6"])).map(lambda a: f"({a[0]} ** {a[1]})"),
        size.map(lambda n: f"('%0' ~ {n} ~ 'd') % 7"),
        size.map(lambda n: f"('{{:>' ~ {n} ~ '}}').format(7)"),
        st.tuples(text, size).map(lambda a: f"({a[0]}|center({a[1]}))"),
        text.map(lambda t: f"({t}|replace('a', {t} * 500))"),
        text.map(lambda t: f"(({t} * 20000)|wordwrap(1))"),
        size.map(lambda n: f"(range({n})|map('string')|join(','))"),
        size.map(lambda n: f"(messages|tojson(indent={n}))"),
        text.map(lambda t: f"({t} ~ {t})"),
    )


def _statement(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    value = _value()
    return st.one_of(
        st.tuples(value, inner).map(lambda a: "{% for i in " + a[0] + " %}" + a[1] + "{% endfor %}"),
        st.tuples(st.sampled_from(["3", "30", "10**6"]), inner).map(
            lambda a: "{% macro m(n) %}{% if n < " + a[0] + " %}" + a[1] + "{{ m(n + 1) }}{{ m(n + 1) }}{% endif %}"
                      "{% endmacro %}{{ m(0) }}"),
        st.tuples(st.sampled_from(["5", "40"]), inner).map(
            lambda a: "{% set ns = namespace(s='ab') %}{% for i in range(" + a[0] + ") %}{% set ns.s = ns.s ~ ns.s %}"
                      + a[1] + "{% endfor %}{{ ns.s|length }}"),
        inner.map(lambda a: "{% set t %}" + a + a + "{% endset %}{{ t }}{{ t }}"),
        inner.map(lambda a: "{% for x in [[1, [2, [3]]]] recursive %}" + a
                            + "{% if x is iterable %}{{ loop(x) }}{% endif %}{% endfor %}"),
    )


leaf = st.one_of(_value().map(lambda v: "{{ " + v + " }}"), _value().map(lambda v: "{% set x = " + v + " %}{{ x|length }}"),
                 st.just("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"))
template = st.lists(st.recursive(leaf, _statement, max_leaves=4), min_size=1, max_size=3).map("".join)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the process's memory from /proc")
@pytest.mark.timeout(600)
def test_fuzzed_hostile_chat_templates_never_get_a_5xx_or_harm_the_server(tiny_ckpt, monkeypatch):
    from fastapi.testclient import TestClient

    from tessera.inference.entrypoints import tokenizer_process

    monkeypatch.setattr(tokenizer_process, "RENDER_GRACE_S", 0.5)  # a killed render ends sooner
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=64, max_num_seqs=4)
    frontend = AsyncEngine(engine)
    limits = ServerLimits(max_prompt_tokens=48, max_tokens=4, max_prompts=2, max_body_bytes=20_000,
                          chat_template=LIMITS)
    server = OpenAIServer(frontend, "tiny", limits, frontend.metrics)
    special = server._template[1]  # type: ignore[index]
    statuses: dict[int, int] = {}
    with TestClient(server.build_app()) as client:
        before = _rss_mib()

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(template)
        def render(source):
            server._template = (source, special)  # as if it were the model's own template
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi a"}],
                                                          "max_tokens": 2})
            assert r.status_code in (200, 400), (source, r.status_code, r.text[:300])
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

        render()
        grown = _rss_mib() - before
        assert frontend.healthy and client.get("/health").status_code == 200
        ok = client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    print(f"statuses {statuses}; server memory grew {grown:.1f} MiB")
    assert sum(statuses.values()) == EXAMPLES and statuses.get(400, 0) >= EXAMPLES // 3, statuses
    assert grown < 100, f"the server itself grew {grown:.0f} MiB while templates rendered in their processes"
