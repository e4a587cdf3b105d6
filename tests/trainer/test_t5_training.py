"""`tessera-train` on a tiny T5 (model kind encoder_decoder): span corruption built at train time
from ordinary token shards (a tokenizer trained by `tessera-data prep --extra-ids`), the loss
falling, resume bit-exact with equal samples, the trainer's loss equal to transformers', and the
one-line refusals (a tokenizer without sentinels, lengths that cannot hold the spans)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from objective_runs import (
    assert_compile_scopes_train_like_eager,
    assert_resume_is_bit_identical,
    assert_tp2_then_dp2_resume_logs_one_process_losses,
    losses,
    write_run_config,
)
from test_bert_masks import prose

from tessera.common.checkpoint import load_model_tensors, resolve_checkpoint
from tessera.common.errors import run_cli
from tessera.common.mixture import MixtureSplit
from tessera.common.tokenizer import load_tokenizer
from tessera.data_prep.cli import entry as data_cli
from tessera.trainer.cli import main
from tessera.trainer.objectives.span.batches import SpanBatches
from tessera.trainer.objectives.span.corruption import SpanOptions

ENC, DEC, EXTRA = 48, 16, 8


def t5_data(root: Path, extra_ids: int = EXTRA) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in prose(120)))
    extra = ["--extra-ids", str(extra_ids)] if extra_ids else []
    assert data_cli(["prep", "--input", str(corpus), "--train-tokenizer", "--vocab-size", "320", *extra,
                     "--output-prefix", str(root / "data/t5"), "--quiet"]) == 0
    assert data_cli(["blend", "--data", str(root / "data/t5_text_document"), "--seq-length", "64",
                     "--split", "90,10,0", "--train-samples", "256", "--valid-samples", "16",
                     "--output", str(root / "mix"), "--quiet"]) == 0
    return {"tokenizer": root / "data/tokenizer", "mixture": root / "mix"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    return t5_data(tmp_path_factory.mktemp("t5"))


def config(data, root: Path, **training) -> Path:
    eos = load_tokenizer(data["tokenizer"]).eos_id
    model = {"kind": "encoder_decoder", "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_decoder_layers": 2,
             "num_heads": 4, "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16,
             "feed_forward": "gated-gelu", "tie_word_embeddings": False, "eos_token_id": eos, "pad_token_id": eos,
             "decoder_start_token_id": eos}
    return write_run_config(root, data, model, ENC, training=training, span={"decoder_seq_length": DEC})


def batches(data, seed: int = 7) -> SpanBatches:
    tok = load_tokenizer(data["tokenizer"])
    sentinels = np.asarray([tok.token_id(f"<extra_id_{i}>") for i in range(EXTRA)])
    return SpanBatches(MixtureSplit(data["mixture"], "train"), ENC, options=SpanOptions(0.15, 3.0, ENC, DEC),
                       sentinels=sentinels, eos=tok.eos_id, pad=tok.eos_id, decoder_start=tok.eos_id, seed=seed)


def test_span_corruption_samples_are_t5s_inputs_and_targets_with_sentinels_counting_down_from_the_vocab_end(data):
    tok = load_tokenizer(data["tokenizer"])
    assert [tok.token_id(f"<extra_id_{i}>") for i in range(3)] == [tok.vocab_size - 1, tok.vocab_size - 2,
                                                                    tok.vocab_size - 3]
    b = batches(data)
    split = MixtureSplit(data["mixture"], "train")
    inputs, labels = b.batch(np.arange(16))
    assert inputs.tokens.shape == (16, ENC) and labels.shape == (16, DEC)
    for row in range(16):
        window = split[row][:b.raw_length].tolist()
        enc = inputs.tokens[row][inputs.padding_mask[row].bool()].tolist()
        target = labels[row][labels[row] != -100].tolist()
        assert enc[-1] == tok.eos_id and target[-1] == tok.eos_id
        # Put the spans back where their sentinels are: the window again.
        spans, cur = {}, None
        for t in target[:-1]:
            if t >= tok.vocab_size - EXTRA:
                cur = t
                spans[cur] = []
            else:
                spans[cur].append(t)
        rebuilt = [x for t in enc[:-1] for x in (spans[t] if t in spans else [t])]
        assert rebuilt == window
        assert len(target) - 1 - len(spans) == round(0.15 * b.raw_length)  # the noise density
        assert inputs.decoder_tokens[row, 0] == tok.eos_id
        assert inputs.decoder_tokens[row, 1:len(target)].tolist() == target[:-1]
    again, _ = batches(data).batch(np.arange(16))
    assert torch.equal(again.tokens, inputs.tokens)  # drawn from (seed, split, sample) alone
    other, _ = batches(data, seed=8).batch(np.arange(16))
    assert not torch.equal(other.tokens, inputs.tokens)


def test_tessera_train_trains_a_tiny_t5_on_span_corruption_and_the_loss_falls(data, tmp_path):
    path = config(data, tmp_path, steps=30, eval_interval=30, eval_iters=1)
    assert main(["--config", str(path), "--quiet"]) == 0
    got = losses(tmp_path / "run")
    first, last = sum(got[s] for s in range(1, 5)) / 4, sum(got[s] for s in range(27, 31)) / 4
    assert last < first - 1.0, (first, last)
    assert list(losses(tmp_path / "run", "eval").values())[-1] < first


def test_a_resumed_t5_run_is_bit_identical_to_an_uninterrupted_one(data, tmp_path):
    assert_resume_is_bit_identical(lambda root: config(data, root), tmp_path)


def test_t5_training_with_selective_or_full_recompute_gives_the_weights_of_training_without(data, tmp_path):
    runs = {}
    for mode in ("none", "selective", "full"):
        path = config(data, tmp_path / mode, steps=2, recompute=mode)
        assert main(["--config", str(path), "--quiet"]) == 0
        runs[mode] = load_model_tensors(resolve_checkpoint(tmp_path / mode / "run/checkpoints"))
    for mode in ("selective", "full"):
        assert all(torch.equal(runs[mode][k], runs["none"][k]) for k in runs["none"]), mode


def test_the_trainers_span_loss_equals_transformers_t5_on_a_batch_of_the_span_batch_builder(data, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tessera.common.hf.directory import load_hf_weights, read_hf_config
    from tessera.common.models.registry import kind_of
    from tessera.trainer.components.precision.mixed import Precision
    from tessera.trainer.objectives.span.loss import SpanStep

    tok = load_tokenizer(data["tokenizer"])
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=tok.vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=tok.eos_id,
        eos_token_id=tok.eos_id, decoder_start_token_id=tok.eos_id)).eval()
    hf.save_pretrained(tmp_path)
    cfg, _ = read_hf_config(tmp_path)
    model = kind_of(cfg).build(cfg, seed=None)
    model.load_state_dict(load_hf_weights(tmp_path, cfg), strict=True)
    inputs, labels = batches(data).batch(np.arange(8))
    step = SpanStep(model.eval(), torch.optim.SGD(model.parameters(), lr=0.0), Precision("fp32", torch.device("cpu")), 1.0)
    with torch.no_grad():
        ours = step.loss(inputs, labels)
        theirs = hf(input_ids=inputs.tokens, attention_mask=inputs.padding_mask, labels=labels).loss
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_the_span_step_compiled_per_block_trains_like_eager_with_one_graph_per_kind_of_block(data):
    from tessera.common.models.encoder_decoder.config import T5Config
    from tessera.common.models.encoder_decoder.model import T5Block
    from tessera.common.models.registry import kind_of
    from tessera.trainer.objectives.span.loss import SpanStep

    tok = load_tokenizer(data["tokenizer"])
    cfg = T5Config(vocab_size=tok.vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=3,
                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                   eos_token_id=tok.eos_id, pad_token_id=tok.eos_id, decoder_start_token_id=tok.eos_id)
    # Encoder blocks and decoder blocks (cross-attention): two graphs for six blocks.
    assert_compile_scopes_train_like_eager(SpanStep, lambda: kind_of(cfg).build(cfg, seed=0),
                                           batches(data).batch(np.arange(8)), T5Block.forward, block_graphs=2,
                                           scopes=(False, "blocks"))


def test_tessera_train_from_an_imported_t5_starts_at_the_loss_transformers_gives_on_its_first_batch(data, tmp_path):
    import transformers

    from tessera.ckpt_convert.cli import run as ckpt

    tok = load_tokenizer(data["tokenizer"])
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=tok.vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
        tie_word_embeddings=False, dropout_rate=0.0, pad_token_id=tok.eos_id, eos_token_id=tok.eos_id,
        decoder_start_token_id=tok.eos_id)).eval()
    hf.lm_head.weight = torch.nn.Parameter(0.05 * torch.randn(tok.vocab_size, 32))
    hf.save_pretrained(tmp_path / "hf")
    for f in data["tokenizer"].iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    assert ckpt(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ck"),
                 "--quiet"]) == 0
    path = config(data, tmp_path / "ft", steps=1)
    assert main(["--config", str(path), "--quiet", f"checkpoint.init_from={tmp_path / 'ck'}"]) == 0
    inputs, labels = batches(data, seed=1234).batch(np.arange(8))  # step 1's samples, at training.seed
    with torch.no_grad():
        want = hf(input_ids=inputs.tokens, attention_mask=inputs.padding_mask, labels=labels).loss.item()
    assert losses(tmp_path / "ft/run")[1] == pytest.approx(want, abs=1e-5)


def test_a_tokenizer_without_sentinels_and_lengths_too_short_for_the_spans_are_refused_in_one_line(
        data, tmp_path, capsys):
    plain = t5_data(tmp_path / "plain", extra_ids=0)
    path = config(data, tmp_path)
    for overrides, words in (([f"data.tokenizer={plain['tokenizer']}", f"data.mixture={plain['mixture']}"],
                              ("<extra_id_0>", "--extra-ids")),
                             (["span.decoder_seq_length=2"], ("span.decoder_seq_length",)),
                             (["training.seq_length=64"], ("mixture samples hold 65 tokens", "--seq-length 69"))):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            run_cli(main, ["--config", str(path), "--quiet", *overrides])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1 and all(w in err[0] for w in words), err
        assert not list(tmp_path.glob("run/checkpoints/*")) and not (tmp_path / "run/metrics.jsonl").exists()


@pytest.mark.distributed
def test_tessera_train_under_torchrun_trains_t5_under_tp2_then_resumes_under_dp2_with_one_process_losses(data, tmp_path):
    """TP2 for steps 1-3 through the CLI, then a resume under DP2 for 4-6: every step's loss and the
    final evaluation equal the uninterrupted one-process run's, so the resumed data-parallel ranks
    drew the same span-corruption samples as the uninterrupted run."""
    exact = ["training.eval_interval=6", "training.eval_iters=1"]
    assert_tp2_then_dp2_resume_logs_one_process_losses(lambda root: config(data, root), tmp_path, exact)


def test_pipeline_parallel_for_a_t5_run_is_refused_in_one_line_naming_why(data, tmp_path):
    from tessera.common.config import load_config
    from tessera.common.errors import UserError
    from tessera.trainer.config import TrainConfig
    from tessera.trainer.inputs import check_inputs

    cfg = load_config(TrainConfig, config(data, tmp_path), ["parallel.pipeline=2"])
    with pytest.raises(UserError) as exc:  # as a 2-process launch checks it, before the model is built
        check_inputs(cfg, world_size=2)
    msg = str(exc.value)
    assert "\n" not in msg and "pipeline" in msg and "encoder" in msg and "not built" in msg, msg


def test_extra_ids_without_a_trained_tokenizer_is_refused_in_one_line(data, tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "a b c"}) + "\n")
    with pytest.raises(SystemExit) as exc:
        run_cli(data_cli, ["prep", "--input", str(corpus), "--tokenizer", str(data["tokenizer"]), "--extra-ids", "4",
                           "--output-prefix", str(tmp_path / "out/x"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "--extra-ids 4" in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_example_t5_config_is_a_valid_span_corruption_run():
    from tessera.common.config import load_config
    from tessera.trainer.config import TrainConfig

    cfg = load_config(TrainConfig, Path(__file__).resolve().parents[2] / "examples/t5_tiny.yaml")
    model = cfg.resolve_model(8192)
    assert model.kind == "encoder_decoder" and cfg.span.decoder_seq_length < cfg.training.seq_length
