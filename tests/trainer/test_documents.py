"""Packed documents: data.reset_position_ids, reset_attention_mask, eod_mask_loss.

The method is parity: a sample packing several documents, with positions and attention reset,
must give each document the logits it gets when run alone; the per-token loss over micro-batches
of unequal counted tokens must equal the loss of the whole batch at once; and a run with the
options on must train (CLI, mixture from the fixtures) with the loss a hand computation gives.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import SEQ
from trainer_fixtures import build_mixture, run_tool, stdlib_lines

from tessera.common.config import load_config
from tessera.common.errors import run_cli
from tessera.common.models.causal_lm.config import preset
from tessera.common.models.causal_lm.model import build_model
from tessera.trainer.cli import main
from tessera.trainer.components.model_setup import prepare_model
from tessera.trainer.components.optimizer.optim import build_optimizer
from tessera.trainer.components.precision.mixed import Precision
from tessera.trainer.config import OptimConfig, TrainConfig
from tessera.trainer.inputs import check_inputs
from tessera.trainer.objectives.batches import MixtureBatches
from tessera.trainer.objectives.documents import IGNORE_INDEX, DocumentMasking
from tessera.trainer.objectives.step import TrainStep

CPU = torch.device("cpu")
BIN = Path(sys.executable).parent
EOD = 0
ALL = DocumentMasking(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


def test_positions_documents_and_labels_follow_megatrons_definition():
    # The EOD token ends its document; the token after it starts the next at position 0.
    inputs = torch.tensor([[5, EOD, 7, 8, EOD, 9], [3, 4, 5, 6, 7, 8]])
    labels = torch.tensor([[EOD, 7, 8, EOD, 9, 2], [4, 5, 6, 7, 8, EOD]])
    got = ALL.model_inputs(inputs)
    assert got["positions"].tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert got["document_ids"].tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    # No loss where the input is EOD (predicting a new document from the old one's context).
    assert ALL.mask_labels(inputs, labels).tolist() == [[EOD, IGNORE_INDEX, 8, EOD, IGNORE_INDEX, 2],
                                                        [4, 5, 6, 7, 8, EOD]]
    only_positions = DocumentMasking(EOD, reset_position_ids=True)
    assert set(only_positions.model_inputs(inputs)) == {"positions"}
    assert torch.equal(only_positions.mask_labels(inputs, labels), labels)
    assert DocumentMasking(EOD).model_inputs(inputs) == {}


def documents(vocab: int, lengths: list[int], seed: int) -> list[torch.Tensor]:
    """Random documents of the given lengths (EOD-free), each but the last ended by EOD."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]
    return [torch.cat([d, torch.tensor([EOD])]) for d in docs[:-1]] + [docs[-1]]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_documents_get_the_logits_they_get_alone(arch):
    """Two packed rows with different boundaries (learned positions for GPT-2, RoPE + GQA for Llama)."""
    cfg = (preset("tiny", vocab_size=97, num_kv_heads=2) if arch == "llama" else
           preset("tiny", vocab_size=97, arch="gpt2", norm="layernorm", position="learned", activation="gelu",
                  bias=True, tie_embeddings=True, num_kv_heads=4))
    model = build_model(cfg, seed=3).eval()
    rows = [documents(cfg.vocab_size, [4, 9, 6], seed=1), documents(cfg.vocab_size, [11, 9], seed=2)]
    packed = torch.stack([torch.cat(r) for r in rows])
    assert packed.shape == (2, 21)
    with torch.no_grad():
        together = model(packed, **ALL.model_inputs(packed))
        plain = model(packed)
        for b, docs in enumerate(rows):
            start = 0
            for doc in docs:
                alone = model(doc.unsqueeze(0))[0]
                torch.testing.assert_close(together[b, start:start + len(doc)], alone, rtol=1e-5, atol=1e-5)
                start += len(doc)
    # Without the options the later documents see the earlier ones: the logits differ.
    assert (plain[0, 5:] - together[0, 5:]).abs().max() > 1e-3
    # Under bf16 autocast the mask is built in bf16 (SDPA needs q's dtype): same logits to bf16 precision.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(packed, **ALL.model_inputs(packed))
    torch.testing.assert_close(low.float(), together, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("recompute, chunk", [("none", None), ("selective", None), ("full", 16)])
def test_per_token_loss_over_micro_batches_equals_the_whole_batch(recompute, chunk):
    """eod_mask_loss: 4 rows as 2 micro-batches with different counted tokens give the same loss and
    the same accumulated gradients as 1 micro-batch of 4 rows (a mean of micro-batch means would not),
    with the mask through recomputed attention or blocks and through the chunked loss too."""
    cfg = preset("tiny", vocab_size=61)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, cfg.vocab_size, (4, 25), generator=gen)
    tokens[0, [3, 9, 15, 20]] = EOD  # the first micro-batch loses 4 labels, the second 1
    tokens[3, 12] = EOD
    inputs, labels = tokens[:, :-1], ALL.mask_labels(tokens[:, :-1], tokens[:, 1:])
    optim_cfg = OptimConfig(lr=1e-3, grad_clip=0.0)
    results = []
    for split in ([slice(0, 4)], [slice(0, 2), slice(2, 4)]):
        model = prepare_model(cfg, CPU, seed=0, recompute=recompute)
        step = TrainStep(model, build_optimizer(model, optim_cfg), Precision("fp32", CPU), 0.0,
                         loss_chunk_tokens=chunk, documents=ALL)
        loss, _, _ = step([(inputs[s], labels[s]) for s in split], len(split), CPU)
        results.append((float(loss), [p.grad.clone() for p in model.parameters()]))
    (loss_whole, grads_whole), (loss_split, grads_split) = results
    # The reference: F.cross_entropy over every counted token of the batch, from the initial model.
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        logits = model(inputs, **ALL.model_inputs(inputs))
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    assert loss_whole == pytest.approx(float(want), rel=1e-6)
    assert loss_split == pytest.approx(loss_whole, rel=1e-6)
    for a, b in zip(grads_whole, grads_split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


@pytest.fixture(scope="module")
def short_documents(artifacts, tmp_path_factory) -> dict[str, Path]:
    """A mixture of one-line documents (the session tokenizer), so samples hold several."""
    return build_mixture(tmp_path_factory.mktemp("lines"), seq_length=SEQ, valid_docs=40,
                         tokenizer_dir=artifacts["tokenizer"], texts=stdlib_lines())


def test_a_run_with_document_options_logs_the_hand_computed_loss(make_config, short_documents):
    """CLI, one process, both evaluation and training with all three options: the first step's
    logged loss equals the initial model's per-token loss over the first global batch."""
    config = make_config(data={"mixture": str(short_documents["mixture"]), "reset_position_ids": True,
                               "reset_attention_mask": True, "eod_mask_loss": True},
                         training={"steps": 2, "eval_interval": 2, "eval_iters": 2})
    assert main(["--config", str(config), "--quiet"]) == 0
    cfg = load_config(TrainConfig, config)
    inputs_checked = check_inputs(cfg)
    documents = inputs_checked.documents
    assert documents == DocumentMasking(inputs_checked.tokenizer.eos_id, True, True, True)
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    split = MixtureBatches(_split(cfg), cfg.training.seq_length, documents)
    inputs, labels = split.batch(torch.arange(cfg.training.global_batch_size).numpy())
    assert (labels == IGNORE_INDEX).sum() >= 4, "the first batch should hold document boundaries"
    model = build_model(inputs_checked.model, seed=cfg.training.seed)
    with torch.no_grad():
        logits = model(inputs, **documents.model_inputs(inputs))
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    assert train[1]["loss"] == pytest.approx(float(want), rel=1e-5)
    assert any(r["kind"] == "eval" for r in records)


def _split(cfg: TrainConfig):
    from tessera.common.mixture import MixtureSplit
    return MixtureSplit(cfg.data.mixture, cfg.data.train_split)


def test_document_options_need_an_eos_token(make_config, artifacts, tmp_path, capsys):
    tokenizer = tmp_path / "tokenizer-without-eos"
    shutil.copytree(artifacts["tokenizer"], tokenizer)
    config_file = tokenizer / "tokenizer_config.json"
    settings = json.loads(config_file.read_text())
    settings.pop("eos_token", None)
    config_file.write_text(json.dumps(settings))
    config = make_config(data={"tokenizer": str(tokenizer), "eod_mask_loss": True})
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--config", str(config), "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no eos token" in err[0] and str(tokenizer) in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_batch_without_counted_tokens_steps_on_zero_gradients(precision):
    """Every label masked: loss 0 and zero gradients (not nan, no fp16 scaler crash), like a parallel run."""
    cfg = preset("tiny", vocab_size=61)
    model = prepare_model(cfg, CPU, seed=0)
    step = TrainStep(model, build_optimizer(model, OptimConfig(lr=1e-3)), Precision(precision, CPU), 1.0,
                     documents=ALL)
    tokens = torch.full((2, 9), EOD)
    inputs, labels = tokens[:, :-1], ALL.mask_labels(tokens[:, :-1], tokens[:, 1:])
    assert (labels == IGNORE_INDEX).all()
    loss, norm, stepped = step([(inputs[:1], labels[:1]), (inputs[1:], labels[1:])], 2, CPU)
    assert float(loss) == 0.0 and float(norm) == 0.0 and stepped
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_end_of_document_token_comes_from_the_shards(make_config, short_documents, tmp_path, capsys):
    """The id tessera-data prep recorded as eod_id wins over the tokenizer's eos; a shard prepared
    with --no-append-eod is refused (one line, exit 2)."""
    root = tmp_path / "copy"
    shutil.copytree(short_documents["mixture"].parent, root)
    shard_json = root / "shard" / "stdlib.json"
    shard = json.loads(shard_json.read_text())
    options = {"mixture": str(root / "mixture"), "reset_attention_mask": True, "check_fingerprints": False}
    shard_json.write_text(json.dumps({**shard, "eod_id": 7}))
    cfg = load_config(TrainConfig, make_config(data=options))
    assert check_inputs(cfg).documents.eod_id == 7
    shard_json.write_text(json.dumps({**shard, "append_eod": False}))
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--config", str(make_config(data=options)), "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--no-append-eod" in err[0] and "shard/stdlib.json" in err[0]


def _records(run_dir: Path, kind: str) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == kind}


@pytest.mark.slow
@pytest.mark.distributed
def test_parallel_layouts_match_one_process_with_document_options(make_config, short_documents, tmp_path):
    """TP=2 x PP=2 interleaved (sequence parallel: positions and masks over the gathered sequence;
    vocab-parallel loss with ignored labels; per-chunk positions and document ids through the
    interleaved schedule) and DP=2 x PP=2 (1F1B; counted tokens all-reduced over data ranks) log
    the one-process training and validation losses."""
    sections = dict(data={"mixture": str(short_documents["mixture"]), "reset_position_ids": True,
                          "reset_attention_mask": True, "eod_mask_loss": True},
                    model={"num_layers": 4},
                    training={"global_batch_size": 8, "steps": 3, "eval_interval": 3, "eval_iters": 2})
    reference = make_config("reference", **sections)
    assert main(["--config", str(reference), "--quiet"]) == 0
    want = _records(tmp_path / "reference", "train")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, nproc, flags in [("tp2pp2x2", 4, ["--tensor-parallel", "2", "--pipeline-parallel", "2",
                                                "--virtual-stages", "2"]),
                               ("dp2pp2", 4, ["--pipeline-parallel", "2"])]:
        config = make_config(name, **sections)
        run_tool([str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", "-m", "tessera.trainer",
                  "--config", str(config), "--quiet", *flags], tmp_path, timeout=300, env=env)
        got = _records(tmp_path / name, "train")
        assert sorted(got) == [1, 2, 3]
        for step in got:
            assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), (name, step)
            assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-4), (name, step)
    # Every layout evaluates the same valid samples as one process (eval_iters = 2 global batches; the
    # data-parallel ranks take their rows of each), token-weighted across the batches in all (a mean
    # of the two batches' means is ~6e-6 off here).
    for name in ("tp2pp2x2", "dp2pp2"):
        assert _records(tmp_path / name, "eval")[3]["valid_loss"] == pytest.approx(
            _records(tmp_path / "reference", "eval")[3]["valid_loss"], rel=1e-6), name
