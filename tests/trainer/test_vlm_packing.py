"""Packed vision-language samples (data.pack_samples): several whole samples per row, each with its
own positions and attention, so each sample's logits and the loss are those of the samples alone;
resume bit-exact; refused for a text model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_vlm_training import losses
from vlm_fixtures import image_text_data, vlm_config, vlm_model

from tessera.common.checkpoint import load_model_tensors, resolve_checkpoint
from tessera.trainer.cli import main

pytest.importorskip("PIL")

ROW = 64  # the tiny model's max_seq_len: two or three samples of 20-30 positions a row


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """The fixture's shard, blended for rows of ROW tokens (a mixture's seq_length bounds training's)."""
    from tessera.data_prep.cli import entry as data_main

    root = tmp_path_factory.mktemp("vlm_packed")
    out = image_text_data(root)
    out["mixture"] = root / "mix64"
    assert data_main(["blend", "--data", str(out["prefix"]), "--seq-length", str(ROW), "--train-samples", "256",
                      "--split", "1,0,0", "--output", str(out["mixture"]), "--quiet"]) == 0
    return out


def test_each_sample_of_a_packed_row_has_its_own_logits_and_the_loss_is_the_per_token_mean_of_the_samples_unpacked(data):
    from tessera.common.mixture import MixtureSplit
    from tessera.common.models.registry import model_config
    from tessera.common.models.vision_language.model import build_model
    from tessera.trainer.objectives.multimodal.batches import VisionLanguageBatches, default_processor
    from tessera.trainer.objectives.multimodal.loss import vision_language_loss

    cfg = model_config(vlm_model(data["tokenizer"]))
    model = build_model(cfg, seed=3).eval()

    def builder(pack: bool) -> VisionLanguageBatches:
        return VisionLanguageBatches(MixtureSplit(data["mixture"]), ROW, model=cfg, processor=default_processor(cfg),
                                     pack=pack)

    packed, alone = builder(True), builder(False)
    rows = [packed.packing.row(r) for r in range(4)]
    samples = np.arange(rows[0].start, rows[-1].stop)
    assert [n for row in rows for n in row] == samples.tolist()  # consecutive: the unpacked pass's samples, in order
    assert all(len(row) >= 2 for row in rows)
    inputs, labels = packed.batch(np.arange(4))
    one, one_labels = alone.batch(samples)
    # several images per sample inside a packed row, every image of the row's samples in order
    assert any(int(one.num_images[n]) == 2 and len(row) >= 2 for row in rows for n in row)
    assert torch.equal(inputs.images(), one.images())
    with torch.no_grad():
        got = model(inputs.tokens, pixels=inputs.images(), **inputs.model_inputs())
        want = model(one.tokens, pixels=one.images())
        for r, row in enumerate(rows):
            at = 0
            for n in row:
                size = int(packed.sample_positions(np.array([n]))[0])
                torch.testing.assert_close(got[r, at:at + size], want[n - samples[0], :size], atol=1e-5, rtol=1e-5)
                assert torch.equal(labels[r, at:at + size], one_labels[n - samples[0], :size])
                at += size
            assert (labels[r, at:] == -100).all()  # padding counts nothing
        torch.testing.assert_close(vision_language_loss(model, inputs, labels),
                                   vision_language_loss(model, one, one_labels), atol=1e-5, rtol=1e-5)


def test_a_resumed_packed_vision_language_run_is_bit_identical_to_an_uninterrupted_one(data, tmp_path, capsys):
    """...and a resume with data.pack_samples flipped or another row length (its data position
    counts packed rows of it) is refused in one line naming the field."""
    from tessera.common.errors import run_cli

    packed = ["--quiet", "data.pack_samples=true"]
    straight = vlm_config(data, tmp_path / "straight", seq_length=ROW)
    assert main(["--config", str(straight), *packed]) == 0
    split = vlm_config(data, tmp_path / "split", seq_length=ROW)
    assert main(["--config", str(split), *packed, "training.exit_after_steps=2"]) == 0
    for changed, field in ((["--quiet", "data.pack_samples=false"], "data.pack_samples"),
                           ([*packed, f"training.seq_length={ROW - 8}"], "training.seq_length")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            run_cli(main, ["--config", str(split), *changed, "--resume"])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1 and field in err[0], err
    assert main(["--config", str(split), *packed, "--resume"]) == 0
    a = load_model_tensors(resolve_checkpoint(tmp_path / "straight/run/checkpoints"))
    b = load_model_tensors(resolve_checkpoint(tmp_path / "split/run/checkpoints"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(tmp_path / "straight/run") == losses(tmp_path / "split/run")


def test_pack_samples_for_a_text_model_is_refused_in_one_line(data, tmp_path, capsys):
    from tessera.common.errors import run_cli

    path = vlm_config(data, tmp_path, model={"vocab_size": 300, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                                             "ffn_hidden_size": 64, "max_seq_len": 64})
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--config", str(path), "--quiet", "data.pack_samples=true"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "data.pack_samples packs vision-language" in err[0], err


def test_a_sample_longer_than_a_packed_row_gets_a_row_of_its_own_and_is_refused_there_as_unpacked(data):
    from tessera.common.errors import UserError
    from tessera.common.mixture import MixtureSplit
    from tessera.common.models.registry import model_config
    from tessera.trainer.objectives.multimodal.batches import VisionLanguageBatches, default_processor

    cfg = model_config(vlm_model(data["tokenizer"]))
    row = 24  # one-image samples (about 20 positions) fit, two-image ones (about 29) do not
    packed = VisionLanguageBatches(MixtureSplit(data["mixture"]), row, model=cfg, processor=default_processor(cfg),
                                   pack=True)
    sizes = packed.sample_positions(np.arange(32))
    long = int(np.argmax(sizes > row))
    assert sizes[long] > row
    r = next(r for r in range(32) if long in packed.packing.row(r))
    assert packed.packing.row(r) == range(long, long + 1)
    with pytest.raises(UserError, match=r"sample \d+ is \d+ tokens .* over training.seq_length \+ 1 \(25\)"):
        packed.batch(np.array([r]))


def test_samples_of_no_positions_still_close_packed_rows_instead_of_scanning_forever():
    from tessera.trainer.objectives.multimodal.packing import SamplePacking

    packing = SamplePacking(lambda ns: np.zeros(len(ns), dtype=np.int64), 8)
    assert packing.row(0) == range(0, 8) and packing.row(1) == range(8, 16)
