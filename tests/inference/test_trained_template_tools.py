"""The chat template `tessera-data prep --train-tokenizer` writes renders tool use: the tools when
given, an assistant's tool calls (content null or empty) as the server's Hermes parser reads them
back, the tool's result and the final answer, through the HTTP chat API as the official openai
client sends them."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from inference_helpers import corpus as inference_corpus
from inference_helpers import make_checkpoint, tiny_config
from live_server import LiveServer

from tessera.common.checkpoint import resolve_checkpoint
from tessera.inference.entrypoints.server import ServerLimits
from tessera.inference.entrypoints.tools import parse_hermes

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def history(content):
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": content, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
            {"role": "assistant", "content": "It is 21 C."},
            {"role": "user", "content": "And tomorrow?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tiny model served with a tokenizer trained by `tessera-data prep --train-tokenizer`."""
    from tessera.data_prep.cli import entry as data_entry

    root = tmp_path_factory.mktemp("trained")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in inference_corpus()))
    assert data_entry(["prep", "--input", str(corpus), "--train-tokenizer", "--vocab-size", "512",
                       "--output-prefix", str(root / "prep" / "base"), "--quiet"]) == 0
    ckpt = resolve_checkpoint(make_checkpoint(root / "run", tiny_config(max_seq_len=1024)))
    shutil.rmtree(ckpt / "tokenizer")
    shutil.copytree(root / "prep" / "tokenizer", ckpt / "tokenizer")
    s = LiveServer(ckpt, limits=ServerLimits(max_prompt_tokens=1000, max_tokens=8), block_size=16, num_kv_blocks=80)
    yield s
    s.stop()


@pytest.mark.parametrize("content", [None, ""])
def test_tool_call_history_renders_and_parses_back_with_the_servers_parser(server, content):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    reply = client.chat.completions.create(model="tiny", messages=history(content), tools=TOOLS, max_tokens=2)
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")
    ids = httpx.post(server.url + "/tokenize", json={"messages": history(content), "tools": TOOLS,
                                                     "add_generation_prompt": True}, timeout=30).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text  # the tools are listed
    turns = text.split("<|endoftext|>\n")
    call_turn = next(t for t in turns if t.startswith("<|assistant|>\n<tool_call>"))
    said, calls = parse_hermes(call_turn[len("<|assistant|>\n"):])
    assert said is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    assert "<|tool|>\n21 C" in turns and "<|assistant|>\nIt is 21 C." in turns
    assert text.endswith("<|user|>\nAnd tomorrow?<|endoftext|>\n<|assistant|>\n")


def test_without_tools_the_trained_template_renders_as_before(server):
    ids = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                     timeout=30).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text == "<|begin_of_text|><|user|>\nhi<|endoftext|>\n<|assistant|>\n"
