"""Issue #31's bad input for serving embeddings, as a user meets it: an encoder directory that
declares no pooling, a --max-model-len above an encoder's position table, an input longer than the
position table when sentence_bert_config.json promises more. One line (exit 2) or HTTP 400, and
the server keeps serving. (Input lists above the limit and embeddings on a generative model without
pooling: test_embeddings.py and test_embeddings_encoder.py.)"""

from __future__ import annotations

import httpx
import pytest
from embeddings_helpers import make_bert_dir, pooled_variant, sentences
from live_server import LiveServer

from tessera.common.errors import run_cli
from tessera.inference.entrypoints.server import ServerLimits

POSITIONS = 64  # the tiny BERT's position table


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_bert_dir(tmp_path_factory.mktemp("bert") / "base", positions=POSITIONS)


def _serve_error(argv, capsys) -> str:
    from tessera.inference.entrypoints.serve_cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_cli(main, [*argv, "--no-engine-process"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("tp", [1, 2])
def test_tessera_serve_on_an_encoder_that_declares_no_pooling_is_refused_in_one_line_before_any_worker_starts(
        bert, capsys, monkeypatch, tp):
    from tessera.inference.worker.tensor_parallel import executor

    def no_workers(*args, **kwargs):
        raise AssertionError("tensor-parallel workers started before the refusal")

    monkeypatch.setattr(executor.TensorParallelExecutor, "__init__", no_workers)
    err = _serve_error(["--checkpoint", str(bert), "--tensor-parallel", str(tp)], capsys)
    assert str(bert) in err and "declares no pooling" in err and "modules.json" in err, err


def test_tessera_serve_with_max_model_len_above_an_encoders_position_table_is_refused_in_one_line(
        bert, tmp_path, capsys):
    directory = pooled_variant(bert, tmp_path / "bert-cls", "cls")
    err = _serve_error(["--checkpoint", str(directory), "--max-model-len", str(POSITIONS + 1)], capsys)
    assert "--max-model-len" in err and str(POSITIONS) in err, err


def test_an_input_longer_than_the_position_table_is_a_400_even_when_sentence_bert_config_allows_more(bert, tmp_path):
    directory = pooled_variant(bert, tmp_path / "bert-mean", "mean", max_seq_length=4 * POSITIONS)
    long_text = " ".join(sentences(20))
    srv = LiveServer(directory, limits=ServerLimits(max_prompt_tokens=200, max_tokens=100, max_prompts=4,
                                                    max_body_bytes=200_000, max_embedding_inputs=8))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            r = http.post("/v1/embeddings", json={"input": ["short", long_text]})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "input", r.text
            assert "input[1]" in err["message"] and str(POSITIONS) in err["message"] and "\n" not in err["message"]
            cut = http.post("/v1/embeddings", json={"input": long_text, "truncate_prompt_tokens": -1})
            assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == POSITIONS, cut.text
            assert srv.async_engine.healthy and http.get("/health").status_code == 200
    finally:
        srv.stop()
