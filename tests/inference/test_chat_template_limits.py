"""A chat template comes with the model and may be hostile: every render is bounded (loop
iterations, sizes, output, time, memory), a render over a limit ends its request with a 400 that
names the limit and its flag, and renders run in processes of their own, so /health and plain
completions answer while runaway templates render. `tessera-data prep --format chat` renders
with the same bounds."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer

from tessera.common.chat_template import RenderLimits
from tessera.common.checkpoint import resolve_checkpoint
from tessera.inference.entrypoints.server import ServerLimits

# The model's template: plain chat unless a client's chat_template_kwargs steer it into one of
# these (a template that loops over what a client sends is the same risk).
HOSTILE = (
    "{%- if attack == 'loops' -%}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    "{%- elif attack == 'repeat' -%}{{ 'a' * 10**10 }}"
    "{%- elif attack == 'output' -%}{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}"
    "{%- elif attack == 'slow' -%}{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}"
    "{% endmacro %}{{ f(0) }}"
    "{%- elif attack == 'memory' -%}{% set ns = namespace(l=[]) %}{% for i in range(4000) %}"
    "{% set ns.l = ns.l + ['a' * 1000000 ~ i] %}{% endfor %}"
    "{%- elif attack == 'doubling' -%}{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{%- elif attack == 'set_block' -%}{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
    "{% set t %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = t %}{% endfor %}"
    "{%- elif attack == 'width' -%}{{ '%0999999999d' % 1 }}"
    "{%- elif attack == 'center' -%}{{ 'x'|center(10**9) }}"
    "{%- elif attack == 'replace' -%}{% set s = 'a' * 100000 %}{{ s|replace('a', s) }}"
    "{%- elif attack == 'one_long_call' -%}{{ ('a ' * 1000000)|wordwrap(1)|length }}"
    "{%- else -%}{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}{%- endif -%}"
)
LIMITS = RenderLimits(timeout_s=3.0, max_iterations=50_000, max_chars=2_000_000, max_memory_mb=256)


@pytest.fixture(scope="module")
def hostile_ckpt(tiny_ckpt, tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("hostile") / "iter_0000001"
    shutil.copytree(resolve_checkpoint(tiny_ckpt), ckpt)
    (ckpt / "tokenizer" / "chat_template.jinja").write_text(HOSTILE)
    return ckpt


def _server(ckpt: Path, limits: RenderLimits = LIMITS) -> LiveServer:
    return LiveServer(ckpt, limits=ServerLimits(max_prompt_tokens=64, max_tokens=16, max_prompts=4,
                                                max_body_bytes=20_000, chat_template=limits),
                      block_size=8, num_kv_blocks=64)


def _chat(url: str, attack: str | None, timeout: float = 60) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    if attack:
        body["chat_template_kwargs"] = {"attack": attack}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def server(hostile_ckpt):
    s = _server(hostile_ckpt)
    yield s
    s.stop()


@pytest.mark.parametrize("attack, flag, says", [
    ("loops", "--chat-template-max-iterations", "more than 50,000 loop iterations"),
    ("repeat", "--chat-template-max-chars", "a value of 10,000,000,000"),
    ("output", "--chat-template-max-chars", "an output of"),
    ("slow", "--chat-template-max-iterations", "macro calls"),
    ("doubling", "--chat-template-max-chars", "a value of 2,097,152"),
    ("set_block", "--chat-template-max-chars", "a value of 2,097,152"),
    ("width", "--chat-template-max-chars", "a formatted field of 999,999,999"),
    ("center", "--chat-template-max-chars", "a width or count argument of 1,000,000,000"),
    ("replace", "--chat-template-max-chars", "a value of 10,000,000,000"),
    ("memory", "--chat-template-max-memory", "out of memory"),
])
def test_a_runaway_chat_template_ends_its_request_with_a_400_naming_the_limit(server, attack, flag, says):
    r = _chat(server.url, attack)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] and flag in error["message"], error
    assert error["param"] == "messages" and error["code"] == "chat_template_limit"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    plain = _chat(server.url, None)  # the same template, not steered: still serves
    assert plain.status_code == 200, plain.text
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "chat_template_kwargs": {"attack": attack}}, timeout=60)
    assert tokenized.status_code == 400 and flag in tokenized.text


@pytest.mark.timeout(120)
def test_health_and_completions_answer_while_runaway_templates_render(hostile_ckpt):
    """Two renders that run until the time limit hold both template processes; /health and a
    completion (which need the event loop and the tokenizer threads, not those) answer meanwhile."""
    s = _server(hostile_ckpt, RenderLimits(timeout_s=4.0, max_iterations=10**9, max_chars=2_000_000))
    try:
        assert _chat(s.url, None).status_code == 200  # both children are not started yet: one is now
        hostile: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: hostile.append(_chat(s.url, "slow"))) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(s.openai._template_procs._busy) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(s.openai._template_procs._busy) == 2, "both runaway renders are under way"
        started = time.monotonic()
        health = httpx.get(s.url + "/health", timeout=30)
        health_s = time.monotonic() - started
        started = time.monotonic()
        done = httpx.post(s.url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4, "temperature": 0},
                          timeout=30)
        completion_s = time.monotonic() - started
        still_rendering = len(s.openai._template_procs._busy) == 2 and not hostile
        for t in threads:
            t.join(60)
        print(f"/health {health_s:.3f} s, completion {completion_s:.3f} s while two templates rendered")
        assert health.status_code == 200 and done.status_code == 200, (health.text, done.text)
        assert still_rendering, "answered only after the runaway renders ended"
        assert [r.status_code for r in hostile] == [400, 400]
        assert all("took longer than 4 s" in r.text and "--chat-template-timeout" in r.text for r in hostile)
    finally:
        s.stop()


def test_a_render_the_sandbox_cannot_interrupt_is_killed_at_the_time_limit(hostile_ckpt, monkeypatch):
    """One filter call (wordwrap over 2 MB) runs in C and Python code the sandbox's checks never
    see: its process is killed at the time limit (no grace here) and the next render gets a new one."""
    from tessera.inference.entrypoints import tokenizer_process

    monkeypatch.setattr(tokenizer_process, "RENDER_GRACE_S", 0.0)
    s = _server(hostile_ckpt, RenderLimits(timeout_s=0.3, max_chars=2_000_000))
    try:
        r = _chat(s.url, "one_long_call")
        assert r.status_code == 400 and "took longer than 0.3 s" in r.text, r.text
        assert s.openai._template_procs.num_processes == 0  # killed, not left running
        assert _chat(s.url, None).status_code == 200
    finally:
        s.stop()


def test_a_render_child_that_starts_slower_than_a_short_render_limit_still_serves(hostile_ckpt, monkeypatch):
    """A child's start is not a render: with --chat-template-timeout 0.2 and a start of 0.6 s (a
    loaded machine), the first chat request is answered, not a 503."""
    import sys

    from tessera.inference.entrypoints import tokenizer_process

    monkeypatch.setattr(tokenizer_process, "RENDER_GRACE_S", 0.0)
    monkeypatch.setattr(tokenizer_process._Child, "command", [
        "sh", "-c", 'sleep 0.6; exec "$@"', "sh", sys.executable, "-m", tokenizer_process.__name__])
    s = _server(hostile_ckpt, RenderLimits(timeout_s=0.2))
    try:
        r = _chat(s.url, None)
        assert r.status_code == 200, r.text
    finally:
        s.stop()


@pytest.mark.timeout(120)
def test_prep_chat_data_stops_at_a_runaway_template_with_one_line(tmp_path, capsys):
    """tessera-data prep --format chat renders with the same bounds (in process): a template past
    the loop limit is one line naming the tokenizer, exit 2, and no shard."""
    from inference_helpers import train_tokenizer

    from tessera.data_prep.cli import main as data_main

    tok = tmp_path / "tok"
    train_tokenizer(tok)
    (tok / "chat_template.jinja").write_text(
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    with pytest.raises(SystemExit) as exc:
        data_main(["prep", "--input", str(data), "--format", "chat", "--tokenizer", str(tok),
                   "--output-prefix", str(tmp_path / "out" / "sft"), "--quiet"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exc.value.code == 2 and len(err) == 1, err
    assert "loop iterations" in err[0] and str(tok) in err[0], err
    assert not list(tmp_path.glob("out/sft*.bin"))


@pytest.mark.parametrize("flag, value", [("--chat-template-timeout", "0"), ("--chat-template-timeout", "nan"),
                                         ("--chat-template-max-iterations", "0"), ("--chat-template-max-chars", "-1"),
                                         ("--chat-template-max-memory", "0")])
def test_a_chat_template_limit_that_is_not_positive_is_refused_at_start(tmp_path, capsys, flag, value):
    from tessera.common.errors import run_cli
    from tessera.inference.entrypoints.serve_cli import main

    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--checkpoint", str(tmp_path), flag, value])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and flag in err, err


@pytest.mark.parametrize("template", [
    "{{ '{:{}}'.format('a', 10**8) }}",  # a format width from the arguments
    "{{ '{0:{1[0]}}'.format('a', [10**8]) }}",  # ... from inside one
    "{{ '%.*f' % (10**8, 1.5) }}",  # a precision from the arguments
    "{{ '%*s' | format(10**8, 'a') }}",
    "{{ ('a\\n' * 100) | indent(10**6) }}",  # a width under the cap, once per line
    "{{ ('\\t' * 100).expandtabs(10**6) }}",  # ... once per tab
    "{{ lipsum(20000) }}",  # paragraphs of up to 100 words
    "{{ ([['a'] * 10**5] * 100) | sum(start=[]) | length }}",  # one list of 100 x 10**5 items
    "{% set s = 'a' * 10**6 %}{{ [s] * 100 }}",  # a list's text: its items' text
    "{% set s = 'a' * 10**6 %}{{ ([s] * 100) | tojson }}",
    "{% set s = 'a' * 10**6 %}{{ 'x' ~ ([s] * 100) }}",
    "{% set s = 'a' * 10**6 %}{{ '%s' % ([s] * 100,) }}",
    "{% set s = 'a' * 10**6 %}{{ '{}'.format([s] * 100) }}",
    "{% set s = 'a' * 10**6 %}{{ [[s] * 100] | join }}",
])
def test_a_width_or_count_that_multiplies_past_the_size_limit_is_refused_before_the_value_is_built(template):
    """In process (prep --format chat, tessera-generate) nothing bounds a render's memory but these
    checks: a result a width or count makes too large is refused before it is allocated."""
    import tracemalloc

    from tessera.common.chat_template import ChatTemplateLimit, render_template

    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateLimit) as exc:
            render_template(template, {}, [], False, {}, RenderLimits())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert exc.value.limit == "max_chars"
    assert peak < 4 * 2**20, f"{peak / 2**20:.0f} MiB allocated before the refusal"
