"""BERT samples from sentence-split shards (tessera.trainer.objectives.mlm): the pair layout of Megatron's
BERT dataset, 15% masking with 80/10/10 and whole words, and masks that are a function of the seed
and the sample number alone: a resumed run, a data-parallel rank and a single process read the
same masks for the same sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.common.mixture import MixtureSplit
from tessera.common.tokenizer import load_tokenizer
from tessera.data_prep.cli import entry as data_cli
from tessera.trainer.objectives.batches import MicroBatchPlan
from tessera.trainer.objectives.documents import IGNORE_INDEX
from tessera.trainer.objectives.mlm.batches import MLMBatches
from tessera.trainer.objectives.mlm.samples import MaskingOptions

pytest.importorskip("pysbd")

WORDS = ("river rain bridge town school mayor heron boat tree cloud water level evening morning children "
         "shop friday monday unbelievable reconstruction measurement shallows").split()
SEQ = 32


def prose(n_docs: int, seed: int = 0) -> list[str]:
    """Documents of a few short sentences each over a small vocabulary (long words split into ## pieces)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        sentences = []
        for _ in range(int(rng.integers(1, 7))):
            words = [WORDS[i] for i in rng.integers(0, len(WORDS), int(rng.integers(3, 12)))]
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(sentences))
    return docs


def bert_data(root: Path, docs: int = 160, vocab: int = 96, train_samples: int = 256) -> dict[str, Path]:
    """A WordPiece tokenizer, a sentence-split shard and a mixture, made by `tessera-data`."""
    import json

    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in prose(docs)))
    assert data_cli(["prep", "--input", str(corpus), "--train-tokenizer", "--tokenizer-type", "wordpiece",
                     "--vocab-size", str(vocab), "--split-sentences", "--no-append-eod",
                     "--output-prefix", str(root / "data/bert"), "--quiet"]) == 0
    assert data_cli(["blend", "--data", str(root / "data/bert_text_document"), "--seq-length", str(SEQ),
                     "--split", "90,10,0", "--train-samples", str(train_samples), "--valid-samples", "16",
                     "--output", str(root / "mix"), "--quiet"]) == 0
    return {"tokenizer": root / "data/tokenizer", "mixture": root / "mix"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    return bert_data(tmp_path_factory.mktemp("bert"))


def batches(data, binary_head=True, seed=7, **options) -> MLMBatches:
    return MLMBatches(MixtureSplit(data["mixture"], "train"), SEQ, tokenizer=load_tokenizer(data["tokenizer"]),
                      options=MaskingOptions(binary_head=binary_head, **options), seed=seed)


def test_samples_are_cls_a_sep_b_sep_with_token_types_padding_and_15_percent_masked(data):
    b = batches(data)
    tok = load_tokenizer(data["tokenizer"])
    cls, sep, pad, mask = (tok.token_id(t) for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]"))
    inputs, labels = b.batch(np.arange(64))
    assert inputs.tokens.shape == labels.shape == (64, SEQ) and inputs.binary_labels.shape == (64,)
    masked = replaced = kept = 0
    for row in range(64):
        t, ty, pm, lab = (x[row].numpy() for x in (inputs.tokens, inputs.token_types, inputs.padding_mask, labels))
        n = int(pm.sum())
        assert (pm[:n] == 1).all() and (pm[n:] == 0).all() and (t[n:] == pad).all() and (lab[n:] == IGNORE_INDEX).all()
        original = np.where(lab != IGNORE_INDEX, lab, t)
        seps = np.flatnonzero(original[:n] == sep)
        assert original[0] == cls and len(seps) == 2 and seps[-1] == n - 1  # binary head: always two segments
        assert (ty[:seps[0] + 1] == 0).all() and (ty[seps[0] + 1:n] == 1).all() and (ty[n:] == 0).all()
        picked = np.flatnonzero(lab != IGNORE_INDEX)
        # at most 15% of the tokens (Megatron's budget may allow none in a short sample or under a long word)
        assert len(picked) <= max(1, round(0.15 * n)) and not set(picked) & {0, *seps.tolist()}
        masked += len(picked)
        replaced += int((t[picked] == mask).sum())
        kept += int((t[picked] == lab[picked]).sum())
    assert masked > 64 and 0.7 < replaced / masked < 0.9 and 0.03 < kept / masked < 0.2
    assert 0.3 < inputs.binary_labels.float().mean().item() < 0.7  # sentence order swapped about half the time


def test_whole_word_masking_masks_every_piece_of_a_word(data):
    b = batches(data, max_ngram=1)
    vocab = load_tokenizer(data["tokenizer"]).backend.get_vocab()
    pieces = {i for t, i in vocab.items() if t.startswith("##")}
    specials = {vocab["[CLS]"], vocab["[SEP]"]}  # a piece right after one starts a (truncated) word
    inputs, labels = b.batch(np.arange(64))
    seen = 0
    for row in range(64):
        lab = labels[row].numpy()
        original = np.where(lab != IGNORE_INDEX, lab, inputs.tokens[row].numpy())
        for i in range(1, SEQ):
            # a continuation is labelled exactly when the piece before it is
            if original[i] in pieces and original[i - 1] not in specials:
                assert (lab[i] != IGNORE_INDEX) == (lab[i - 1] != IGNORE_INDEX)
                seen += lab[i] != IGNORE_INDEX
    assert seen > 0


def test_a_sample_has_the_same_masks_after_resume_under_dp2_and_in_any_batch(data):
    one = batches(data)
    step_rows = one.batch(np.arange(8, 16))  # step 2 of a global batch of 8, one process
    resumed = batches(data)  # a fresh builder, as after a restart, asked for the same step
    for dp_rank in range(2):  # data-parallel rank r of 2 reads its contiguous half of the step
        plan = MicroBatchPlan(8, 2, dp_rank, 2)
        for m, (inputs, labels) in enumerate(resumed.micro_batches(plan, consumed_samples=8)):
            rows = slice(dp_rank * 4 + m * 2, dp_rank * 4 + m * 2 + 2)
            assert np.array_equal(labels.numpy(), step_rows[1][rows].numpy())
            for name in ("tokens", "token_types", "padding_mask", "binary_labels"):
                assert np.array_equal(getattr(inputs, name).numpy(), getattr(step_rows[0], name)[rows].numpy())
    other_seed = batches(data, seed=8).batch(np.arange(8, 16))
    assert not np.array_equal(other_seed[1].numpy(), step_rows[1].numpy())


def test_without_the_binary_head_a_sample_is_one_segment(data):
    inputs, labels = batches(data, binary_head=False).batch(np.arange(32))
    assert (inputs.binary_labels == IGNORE_INDEX).all() and (inputs.token_types == 0).all()


def test_the_binary_target_is_sentence_order_or_next_sentence_from_another_document():
    from tessera.trainer.objectives.mlm.samples import make_pair

    run = [np.array([1, 2]), np.array([3, 4]), np.array([5, 6])]
    seen = set()
    for seed in range(40):
        for nsp in (False, True):
            rng = np.random.default_rng(seed)
            a, b, flipped, _ = make_pair(run, 100, MaskingOptions(binary_head=True, next_sentence=nsp), rng,
                                         lambda rng, need: [np.array([90, 91, 92])])
            whole = np.concatenate(run).tolist()
            if not flipped:  # in order: A then B, the run itself
                assert a.tolist() + b.tolist() == whole
            elif nsp:  # B from elsewhere, A the run's start
                assert b.tolist() == [90, 91, 92] and whole[:len(a)] == a.tolist()
            else:  # swapped
                assert b.tolist() + a.tolist() == whole
            seen.add((nsp, flipped))
    assert seen == {(False, False), (False, True), (True, False), (True, True)}


def test_next_sentence_batches_draw_b_from_the_split_and_stay_deterministic(data):
    one = batches(data, next_sentence=True).batch(np.arange(32))
    again = batches(data, next_sentence=True).batch(np.arange(32))
    assert all(torch.equal(getattr(one[0], f), getattr(again[0], f)) for f in ("tokens", "binary_labels"))
    assert 0 < int(one[0].binary_labels.sum()) < 32


def test_shards_not_split_into_sentences_are_refused_in_one_line_naming_the_shard(data, tmp_path):
    from tessera.common.errors import ArtifactError

    corpus = data["mixture"].parent / "corpus.jsonl"
    assert data_cli(["prep", "--input", str(corpus), "--tokenizer", str(data["tokenizer"]), "--no-append-eod",
                     "--output-prefix", str(tmp_path / "whole"), "--quiet"]) == 0  # one sequence per document
    assert data_cli(["blend", "--data", str(tmp_path / "whole_text_document"), "--seq-length", str(SEQ),
                     "--train-samples", "16", "--output", str(tmp_path / "mix"), "--quiet"]) == 0
    with pytest.raises(ArtifactError, match="whole_text_document.*--split-sentences") as exc:
        MLMBatches(MixtureSplit(tmp_path / "mix", "train"), SEQ, tokenizer=load_tokenizer(data["tokenizer"]),
                   options=MaskingOptions(binary_head=True), seed=1)
    assert "\n" not in str(exc.value)
