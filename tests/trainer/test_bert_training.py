"""`tessera-train` on a tiny BERT (model kind encoder): the masked-LM objective through the CLI
from sentence-split shards, the loss falling, resume bit-exact, and the one-line refusals (a
tokenizer without [MASK], a sequence longer than the position table)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from objective_runs import (
    assert_compile_scopes_train_like_eager,
    assert_resume_is_bit_identical,
    assert_tp2_then_dp2_resume_logs_one_process_losses,
    losses,
    write_run_config,
)
from test_bert_masks import batches, bert_data

from tessera.common.errors import run_cli
from tessera.trainer.cli import main

pytest.importorskip("pysbd")
pytest.importorskip("tessera.common.models.encoder", reason="the encoder model kind (branch bert-model)")
SEQ = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    return bert_data(tmp_path_factory.mktemp("bert"), train_samples=512)


def config(data, root: Path, **training) -> Path:
    model = {"kind": "encoder", "hidden_size": 32, "num_layers": 2, "num_heads": 2, "ffn_hidden_size": 64,
             "max_seq_len": 64, "dropout": 0.1, "attention_dropout": 0.1}
    return write_run_config(root, data, model, SEQ, optim={"beta2": 0.999}, training=training)


def test_tessera_train_trains_a_tiny_bert_with_the_mlm_and_sentence_order_losses_and_the_loss_falls(data, tmp_path):
    path = config(data, tmp_path, steps=40, eval_interval=40, eval_iters=1)
    assert main(["--config", str(path), "--quiet", "schedule.warmup_steps=4"]) == 0
    got = losses(tmp_path / "run")
    first, last = sum(got[s] for s in range(1, 6)) / 5, sum(got[s] for s in range(36, 41)) / 5
    assert last < first - 0.5, (first, last)
    assert list(losses(tmp_path / "run", "eval").values())[-1] < first


def test_the_trainers_mlm_loss_equals_bert_for_pretraining_on_a_batch_of_the_mlm_batch_builder(data, tmp_path):
    transformers = pytest.importorskip("transformers")
    import numpy as np

    from tessera.common.hf.directory import load_hf_weights, read_hf_config
    from tessera.common.models.registry import kind_of
    from tessera.common.tokenizer import load_tokenizer
    from tessera.trainer.components.precision.mixed import Precision
    from tessera.trainer.objectives.mlm.loss import MLMStep, mlm_loss

    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=load_tokenizer(data["tokenizer"]).vocab_size, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)).eval()
    hf.save_pretrained(tmp_path)
    cfg, _ = read_hf_config(tmp_path)
    model = kind_of(cfg).build(cfg, seed=None)
    model.load_state_dict(load_hf_weights(tmp_path, cfg), strict=True)
    inputs, labels = batches(data).batch(np.arange(8))
    with torch.no_grad():
        ours = mlm_loss(model.eval()(inputs.tokens, token_types=inputs.token_types,
                                     attention_mask=inputs.padding_mask), labels, inputs.binary_labels)
        theirs = hf(input_ids=inputs.tokens, token_type_ids=inputs.token_types, attention_mask=inputs.padding_mask,
                    labels=labels, next_sentence_label=inputs.binary_labels).loss
        # the step's own loss: the MLM head on the labelled positions only
        step = MLMStep(model, torch.optim.SGD(model.parameters(), lr=0.0), Precision("fp32", torch.device("cpu")), 1.0)
        stepped = step.loss(inputs, labels)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stepped, theirs, atol=1e-5, rtol=1e-5)


def test_the_mlm_step_compiled_per_block_or_as_one_graph_trains_like_eager(data):
    import numpy as np

    from tessera.common.models.encoder.config import EncoderConfig
    from tessera.common.models.encoder.model import EncoderBlock
    from tessera.common.models.registry import kind_of
    from tessera.common.tokenizer import load_tokenizer
    from tessera.trainer.objectives.mlm.loss import MLMStep

    cfg = EncoderConfig(vocab_size=load_tokenizer(data["tokenizer"]).vocab_size, hidden_size=32, num_layers=3,
                        num_heads=2, ffn_hidden_size=64, max_seq_len=64, dropout=0.0, attention_dropout=0.0)
    # Three identical blocks: one graph. The head runs on the labelled positions, compiled for any count.
    assert_compile_scopes_train_like_eager(MLMStep, lambda: kind_of(cfg).build(cfg, seed=0),
                                           batches(data).batch(np.arange(8)), EncoderBlock.forward, block_graphs=1)


def test_a_resumed_bert_run_is_bit_identical_to_an_uninterrupted_one(data, tmp_path):
    assert_resume_is_bit_identical(lambda root: config(data, root), tmp_path)


def test_a_tokenizer_without_mask_is_refused_in_one_line(data, tmp_path, capsys):
    from tessera.data_prep.cli import entry as data_cli

    vocab = (data["tokenizer"] / "vocab.txt").read_text(encoding="utf-8").splitlines()
    (tmp_path / "vocab.txt").write_text("".join(t + "\n" for t in vocab if t != "[MASK]"), encoding="utf-8")
    corpus = data["mixture"].parent / "corpus.jsonl"
    assert data_cli(["prep", "--input", str(corpus), "--tokenizer", str(tmp_path / "vocab.txt"), "--split-sentences",
                     "--no-append-eod", "--output-prefix", str(tmp_path / "data/nomask"), "--quiet"]) == 0
    assert data_cli(["blend", "--data", str(tmp_path / "data/nomask_text_document"), "--seq-length", str(SEQ),
                     "--train-samples", "64", "--output", str(tmp_path / "mix"), "--quiet"]) == 0
    path = config(data, tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--config", str(path), "--quiet", f"data.tokenizer={tmp_path / 'data/tokenizer'}",
                       f"data.mixture={tmp_path / 'mix'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "[MASK]" in err[0], err
    assert not list(tmp_path.glob("run/checkpoints/*")) and not (tmp_path / "run/metrics.jsonl").exists()


def test_a_sequence_longer_than_the_position_table_is_refused_in_one_line_naming_the_field(data, tmp_path, capsys):
    path = config(data, tmp_path)
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--config", str(path), "--quiet", "training.seq_length=128"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "training.seq_length" in err[0] and "max_seq_len" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.distributed
def test_tessera_train_under_torchrun_trains_bert_under_tp2_then_resumes_under_dp2_with_one_process_losses(data, tmp_path):
    """TP2 for steps 1-3 through the CLI, then a resume under DP2 for 4-6: every step's loss and the
    final evaluation equal the uninterrupted one-process run's, so the resumed data-parallel ranks
    drew the same masks for the same samples."""
    exact = ["model.dropout=0", "model.attention_dropout=0", "training.eval_interval=6", "training.eval_iters=1"]
    assert_tp2_then_dp2_resume_logs_one_process_losses(lambda root: config(data, root), tmp_path, exact)


def test_context_parallel_for_a_masked_lm_run_is_refused_in_one_line_naming_the_field(data, tmp_path):
    from tessera.common.config import load_config
    from tessera.common.errors import UserError
    from tessera.trainer.config import TrainConfig

    with pytest.raises((UserError, ValueError)) as exc:  # while the config is validated, before any launch
        load_config(TrainConfig, config(data, tmp_path), ["parallel.context=2"])
    assert "parallel.context" in str(exc.value) and "encoder" in str(exc.value), exc.value


def test_the_example_bert_config_is_a_valid_masked_lm_run():
    from tessera.common.config import load_config
    from tessera.trainer.config import TrainConfig

    cfg = load_config(TrainConfig, Path(__file__).resolve().parents[2] / "examples/bert_tiny.yaml")
    model = cfg.resolve_model(8192)
    assert model.kind == "encoder" and model.binary_head and cfg.training.seq_length <= model.max_seq_len
