"""Completion logprobs exact for evaluation harnesses (OpenAI/vLLM's shape), checked against
transformers on the same Hugging Face export: echo returns every prompt token (the first with a
null logprob), text_offset indexes the returned text, max_tokens 0 scores the prompt only,
token-id and batched prompts get prompt logprobs; /tokenize and /detokenize as vLLM defines
them. The lm-evaluation-harness run itself is in test_lm_eval.py."""

from __future__ import annotations

import httpx
import pytest
import torch
from live_server import LiveServer
from test_hf_serving import _llama, _save

from tessera.common.tokenizer import load_tokenizer

PROMPTS = ["def parse(text):\n    return", "import json, os", "x = [1, 2, 3]"]


@pytest.fixture(scope="module")
def hf_export(tiny_ckpt, tmp_path_factory):
    hf = _llama(num_key_value_heads=2)
    return hf, _save(hf, tiny_ckpt, tmp_path_factory.mktemp("hf") / "hf")


@pytest.fixture(scope="module")
def server(hf_export):
    s = LiveServer(hf_export[1], block_size=8, num_kv_blocks=256)
    yield s
    s.stop()


def hf_token_logprobs(hf, ids: list[int]) -> list[float]:
    """transformers' logprob of each token after the first, given the tokens before it."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    return [float(lps[p, ids[p + 1]]) for p in range(len(ids) - 1)]


def complete(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_returns_every_prompt_token_and_the_first_has_a_null_logprob(server, hf_export):
    tok = load_tokenizer(hf_export[1])
    r = complete(server, prompt=PROMPTS[0], max_tokens=2, logprobs=3, echo=True)
    lp = r["choices"][0]["logprobs"]
    ids = tok.encode(PROMPTS[0])
    assert len(lp["tokens"]) == len(ids) + 2 == r["usage"]["prompt_tokens"] + 2
    assert lp["tokens"][:len(ids)] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = hf_token_logprobs(hf_export[0], ids)
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=1e-4)
    # top_logprobs hold the top 3 and the chosen token (vLLM: up to n + 1 entries; fewer when two
    # tokens spell the same text, e.g. two halves of a UTF-8 character both shown as U+FFFD)
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[token] == pytest.approx(value, abs=1e-6) and len(top) <= 4
        assert max(top.values()) >= value


def test_text_offsets_index_the_returned_text(server):
    for prompt in PROMPTS:
        r = complete(server, prompt=prompt, max_tokens=5, logprobs=0, echo=True)
        text, lp = r["choices"][0]["text"], r["choices"][0]["logprobs"]
        n = r["usage"]["prompt_tokens"]
        assert text.startswith(prompt)
        offsets = lp["text_offset"] + [len(text)]
        assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[n] == len(prompt)
        for i, token in enumerate(lp["tokens"][:n]):
            assert text[offsets[i]:offsets[i + 1]] == token  # ASCII prompts: each token spells its slice
        # Generated tokens (random weights: often half a UTF-8 character) index the rest of the text.
        assert "".join(text[offsets[i]:offsets[i + 1]] for i in range(n, n + 5)) == text[len(prompt):]
    # Without echo, offsets start at 0 of the generated text.
    choice = complete(server, prompt=PROMPTS[1], max_tokens=4, logprobs=1)["choices"][0]
    assert choice["logprobs"]["text_offset"][0] == 0 and len(choice["logprobs"]["tokens"]) == 4


def test_max_tokens_zero_with_echo_scores_the_prompt_only(server, hf_export):
    tok = load_tokenizer(hf_export[1])
    r = complete(server, prompt=PROMPTS[2], max_tokens=0, logprobs=1, echo=True)
    choice = r["choices"][0]
    ids = tok.encode(PROMPTS[2])
    assert choice["text"] == PROMPTS[2] and choice["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0 and len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(hf_token_logprobs(hf_export[0], ids), abs=1e-4)
    # Without echo there is nothing to return: max_tokens 0 stays a 400.
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 0}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_batched_token_id_prompts_get_their_own_prompt_logprobs(server, hf_export):
    prompts = [[5, 17, 300, 42, 9, 88], [200, 3], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 1]]
    r = complete(server, prompt=prompts, max_tokens=1, logprobs=1, echo=True)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    for ids, choice in zip(prompts, r["choices"]):
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(ids) + 1 and got[0] is None
        assert got[1:len(ids)] == pytest.approx(hf_token_logprobs(hf_export[0], ids), abs=1e-4)


def test_streamed_echo_logprobs_equal_the_unstreamed(server):
    body = dict(prompt=PROMPTS[0], max_tokens=4, logprobs=2, echo=True)
    whole = complete(server, **body)["choices"][0]
    text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", server.url + "/v1/completions", json={"temperature": 0, "stream": True, **body},
                      timeout=60) as r:
        import json
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                for k in merged:
                    merged[k] += choice["logprobs"][k]
    assert text == whole["text"]
    assert merged == whole["logprobs"]


def test_tokenize_and_detokenize_as_vllm_defines_them(server, hf_export):
    tok = load_tokenizer(hf_export[1])
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[0], "return_token_strs": True}, timeout=30).json()
    ids = tok.encode(PROMPTS[0])
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == server.engine.max_model_len
    assert r["token_strs"] == [tok.backend.id_to_token(t) for t in ids]
    # Chat form: the same prompt tokens /v1/chat/completions counts.
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    used = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1},
                      timeout=30).json()["usage"]["prompt_tokens"]
    assert chat["count"] == used and chat["token_strs"] is None
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()
    assert back == {"prompt": PROMPTS[0]}
    for path, body, param in [("/detokenize", {"tokens": [10**6]}, "tokens"),
                              ("/detokenize", {"tokens": [True]}, "tokens"),
                              ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model")]:
        bad = httpx.post(server.url + path, json=body, timeout=30)
        assert bad.status_code in (400, 404) and bad.json()["error"]["param"].startswith(param), (path, body, bad.text)
