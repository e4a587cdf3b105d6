"""lm-evaluation-harness against a live tessera-serve gets transformers' numbers.

lm-eval's `local-completions` model scores loglikelihood tasks through /v1/completions with
`echo: true, logprobs: 1, max_tokens: 1` over batches of token-id prompts, and reads
`token_logprobs[ctxlen:-1]`: a server that drops the first prompt token's entry shifts every
continuation by one token and the harness exits 0 with wrong numbers. The same harness's `hf`
model scores the same requests with transformers on the same Hugging Face export; per request
loglikelihoods, accuracies and perplexities must agree. Offline: the tasks are YAML files
written here over JSONL data generated here (the `json` dataset builder reads local files).
"""

from __future__ import annotations

import json
import random

import pytest
from live_server import LiveServer
from test_hf_serving import _llama, _save

from tessera.inference.entrypoints.server import ServerLimits

lm_eval = pytest.importorskip("lm_eval")

WORDS = ["alpha", "beta", "gamma", "delta", "parse", "value", "return", "import", "class", "string", "json",
         "text", "wrap", "indent", "decode", "encode", "object", "list", "width", "line"]
# The harness's context window (the served model holds 256 positions). lm-eval's API models keep
# one position for the generated token and cut rolling windows of max_length - 2 tokens (+ 1 of
# context); its hf model cuts windows of max_length: the reference gets MAX_LENGTH - 2 so that
# both score the same windows.
MAX_LENGTH = 96


def _write_tasks(root) -> list[str]:
    rng = random.Random(0)
    mc = [{"context": " ".join(rng.choices(WORDS, k=rng.randint(3, 9))),
           "choices": [" " + " ".join(rng.choices(WORDS, k=rng.randint(1, 3))) for _ in range(3)],
           "label": rng.randrange(3)} for _ in range(6)]
    # Documents longer than MAX_LENGTH tokens too, so rolling windows are exercised.
    ppl = [{"text": " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))} for _ in range(4)]
    for name, rows in (("mc", mc), ("ppl", ppl)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tessera_mc.yaml").write_text(f"""\
task: tessera_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""")
    (root / "tessera_ppl.yaml").write_text(f"""\
task: tessera_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'ppl.jsonl'}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
    return ["tessera_mc", "tessera_ppl"]


def _run(model: str, model_args: dict, tasks: list[str], root) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=TaskManager(include_path=str(root)),
                           log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def test_lm_eval_local_completions_equals_transformers(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    export = _save(_llama(num_key_value_heads=2), tiny_ckpt, tmp_path / "hf")
    tasks = _write_tasks(tmp_path)
    reference = _run("hf", {"pretrained": str(export), "device": "cpu", "dtype": "float32",
                                  "max_length": MAX_LENGTH - 2, "batch_size": 4},
                     tasks, tmp_path)
    server = LiveServer(export, block_size=8, num_kv_blocks=256,
                        limits=ServerLimits(max_prompt_tokens=200, max_tokens=16, max_prompts=8))
    try:
        served = _run("local-completions", {
            "base_url": server.url + "/v1/completions", "model": "tiny", "tokenizer": str(export),
            "tokenizer_backend": "huggingface", "max_length": MAX_LENGTH, "batch_size": 4, "max_retries": 1,
        }, tasks, tmp_path)
    finally:
        server.stop()
    for task in tasks:
        ours = sorted(served["samples"][task], key=lambda s: s["doc_id"])
        theirs = sorted(reference["samples"][task], key=lambda s: s["doc_id"])
        assert len(ours) == len(theirs) > 0
        for a, b in zip(ours, theirs):
            # one (loglikelihood, is_greedy) per request (per choice; per document for rolling)
            got = [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in a["resps"]]
            want = [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in b["resps"]]
            assert got == pytest.approx(want, abs=1e-4), (task, a["doc_id"])
        for metric, value in reference["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                assert served["results"][task][metric] == pytest.approx(value, rel=1e-5, abs=1e-6), (task, metric)
