"""Tool calling through the official openai client, streamed and not: tools and tool-call
history reach the chat template (one that renders them, written here), `required` and named
choices are enforced by the grammar engine, `auto` output is parsed (Hermes <tool_call> and
Llama-3 JSON), and streamed tool-call deltas rebuild the same calls."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from live_server import LiveServer
from test_hf_serving import _llama, _save

from tessera.inference.entrypoints.server import ServerLimits
from tessera.inference.entrypoints.tools import ToolCallStream, parse_hermes, parse_llama3_json

# A Hermes-style template (small: the model holds 256 positions): tools in a system block, earlier calls as <tool_call> JSON, tool
# results as their own turns.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>Tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}. "
    "Call as <tool_call>{json}</tool_call>{{ eos_token }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'tool' %}[{{ m['tool_call_id'] }}] {% endif %}{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    export = _save(_llama(num_key_value_heads=2), tiny_ckpt, tmp_path_factory.mktemp("hf") / "hf")
    cfg = json.loads((export / "tokenizer_config.json").read_text())
    (export / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TOOL_TEMPLATE}))
    s = LiveServer(export, block_size=8, num_kv_blocks=256,
                   limits=ServerLimits(max_prompt_tokens=250, max_tokens=120, max_prompts=8))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused")


def _check_calls(calls, names=SCHEMAS) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(stream) -> tuple[str, dict[int, dict], str | None]:
    """Rebuild content and tool calls from stream deltas, as OpenAI clients do."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None  # the id and name come once, in the call's first delta
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, calls, reason


def test_required_tool_choice_returns_valid_tool_calls_streamed_and_not(client):
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=100)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls)
        content, calls, reason = _streamed(client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
            max_tokens=100, stream=True))
        assert reason == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_a_named_tool_choice_calls_that_function_and_streams_its_arguments(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                       temperature=1.0, seed=1, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, names={"get_time"})
    _, calls, reason = _streamed(client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=named, temperature=1.0, seed=1, max_tokens=60,
        stream=True))
    assert reason == "stop" and calls[0]["name"] == "get_time"
    assert calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments


def test_auto_tool_calls_are_parsed_from_hermes_output(client):
    # The model decides under "auto"; a regex makes this random model write one Hermes call.
    regex = r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "c"\}\}</tool_call>'
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=80,
                  extra_body={"guided_regex": regex})
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"})]
    content, calls, reason = _streamed(client.chat.completions.create(**kwargs, stream=True))
    assert (content, reason) == ("Sure. ", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris", "unit": "c"})]
    # tool_choice none: plain content, no calls
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=5, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_tools_and_tool_call_history_reach_the_chat_template(server):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=30).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert "Tools: get_weather get_time. Call as <tool_call>" in text  # the tools block
    assert '<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert text.endswith("<|tool|>[call_1] 21 C<|endoftext|><|assistant|>")
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, extra, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **extra}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_parsers_read_hermes_and_llama3_json_calls():
    content, calls = parse_hermes('Let me check.<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
                                  '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert content == "Let me check." and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                          for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert parse_hermes("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    content, calls = parse_llama3_json('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert parse_llama3_json("The answer is {x}")[1] == []
    # Streaming holds back only what could start a call.
    s = ToolCallStream("auto", "hermes")
    assert s.feed("Hi <tool") == [{"content": "Hi "}]
    assert s.feed('_call>{"name": "a", "arguments": {}}</tool_call>') == []
    out = s.finish()
    assert out[0]["tool_calls"][0]["function"] == {"name": "a", "arguments": ""}
    assert out[1]["tool_calls"][0]["function"] == {"arguments": "{}"}
    s = ToolCallStream("auto", "llama3_json")
    assert s.feed("  ") == [] and s.feed("plain") == [{"content": "  plain"}] and s.finish() == []
