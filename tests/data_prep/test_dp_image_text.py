"""`tessera-data prep --format image-text`: LLaVA JSON, Parquet and WebDataset tars become one
image-text shard (masked tokens + the images' own bytes) that verify, inspect and blend accept;
a bad image is one line naming the record, exit 2, nothing written."""

from __future__ import annotations

import io
import json
import shutil
import tarfile

import numpy as np
import pytest
from dp_helpers import run, user_error

from tessera.common.indexed_dataset import IndexedDataset, bin_path
from tessera.common.models.vision_language.image_shard import image_store_prefix, sample_images
from tessera.common.shard import open_loss_mask, read_shard_manifest
from tessera.common.tokenizer import load_tokenizer

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _png(color, size=(12, 10), mode="RGB", fmt="PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture
def vlm_tokenizer(tokenizer_dir, tmp_path):
    """The session tokenizer with <image> as a special token and a chat template."""
    from tokenizers import Tokenizer as HfTokenizer

    d = tmp_path / "vlm_tok"
    shutil.copytree(tokenizer_dir, d)
    tok = HfTokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens(["<image>"])
    tok.save(str(d / "tokenizer.json"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return d


def _llava(tmp_path, images: dict[str, bytes], records: list) -> object:
    folder = tmp_path / "imgs"
    folder.mkdir(exist_ok=True)
    for name, data in images.items():
        (folder / name).write_bytes(data)
    path = folder / "llava.json"
    path.write_text(json.dumps(records))
    return path


def _turns(q, a):
    return [{"from": "human", "value": q}, {"from": "gpt", "value": a}]


def test_llava_json_parquet_and_webdataset_become_one_shard_that_verify_inspect_and_blend_accept(
        vlm_tokenizer, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    red, blue, green = _png("red"), _png("blue", mode="P"), _png("green", (9, 14), fmt="JPEG")
    llava = _llava(tmp_path, {"r.png": red, "b.png": blue}, [
        {"id": "0", "image": "r.png", "conversations": _turns("<image>\nWhat colour?", "red")},
        {"id": "1", "image": ["r.png", "b.png"], "conversations": _turns("Compare.", "red then blue")},
    ])
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "<image> shape?"},
                                           {"role": "assistant", "content": "a square"}]],
                             "images": [[{"bytes": green, "path": "g.jpg"}]]}), parquet)
    tar = tmp_path / "wds.tar"
    with tarfile.open(tar, "w") as t:
        for name, data in (("s0.jpg", green), ("s0.txt", b"a green box")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    prefix = tmp_path / "out" / "vl_conversations_document"
    assert run(["prep", "--format", "image-text", "--input", llava, parquet, tar, "--tokenizer", vlm_tokenizer,
                "--output-prefix", tmp_path / "out" / "vl", "--quiet"]) == 0

    tok = load_tokenizer(vlm_tokenizer)
    image_id = tok.token_id("<image>")
    ds = IndexedDataset(prefix)
    mask = open_loss_mask(prefix, ds.num_tokens)
    store = IndexedDataset(image_store_prefix(prefix))
    # inputs in sorted order: llava.json, p.parquet, wds.tar
    assert [sample_images(store, d) for d in range(ds.num_documents)] == [[red], [red, blue], [green], [green]]
    for d, answer in enumerate(["red", "red then blue", "a square", "a green box"]):
        start, n = ds.document_range(d)
        ids, m = np.asarray(ds.document_tokens(d)), np.asarray(mask[start:start + n])
        assert int((ids == image_id).sum()) == len(sample_images(store, d))
        assert not m[ids == image_id].any()  # placeholders are never targets
        assert tok.decode([int(i) for i in ids[m == 1]], skip_special_tokens=True).strip() == answer
    manifest = read_shard_manifest(prefix)
    assert manifest.loss_mask and manifest.model_extra["images"]["num_images"] == 5

    capsys.readouterr()
    assert run(["verify", prefix]) == 0
    verified = capsys.readouterr().out
    assert "4 documents" in verified and ", 5 images" in verified
    assert run(["inspect", prefix, "--docs", "1"]) == 0
    report = capsys.readouterr().out
    assert "images: 5" in report and "image 1: PNG 12x10 P" in report
    assert run(["blend", "--data", prefix, "--seq-length", "8", "--train-samples", "4", "--split", "1,0,0",
                "--output", tmp_path / "mix", "--quiet"]) == 0


def test_verify_names_the_image_store_when_a_byte_of_an_image_changed(vlm_tokenizer, tmp_path, capsys):
    llava = _llava(tmp_path, {"r.png": _png("red")}, [{"image": "r.png", "conversations": _turns("<image>", "red")}])
    assert run(["prep", "--format", "image-text", "--input", llava, "--tokenizer", vlm_tokenizer,
                "--output-prefix", tmp_path / "vl", "--quiet"]) == 0
    prefix = tmp_path / "vl_conversations_document"
    assert run(["verify", prefix]) == 0
    store_bin = bin_path(image_store_prefix(prefix))
    data = bytearray(store_bin.read_bytes())
    data[-5] ^= 0xFF
    store_bin.write_bytes(bytes(data))
    line = user_error(["verify", prefix], capsys)
    assert str(store_bin) in line and "sha256" in line


def _sixteen_bit() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8), 40000, dtype=np.uint16)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("bad,expect,extra", [
    (b"not an image at all", "not a readable image", []),
    (_png("red", (40, 40))[:60], "not a readable image", []),
    (_png("red", (40, 40)), "over the limit of 1000 pixels", ["--max-image-pixels", "1000"]),
    (_sixteen_bit(), "image mode I;16 is not supported", []),
], ids=["not-an-image", "truncated", "over-pixel-limit", "16-bit"])
def test_a_corrupt_truncated_oversized_or_16_bit_image_is_one_line_naming_the_record_and_nothing_is_written(
        vlm_tokenizer, tmp_path, capsys, bad, expect, extra):
    llava = _llava(tmp_path, {"ok.png": _png("red"), "bad.png": bad}, [
        {"image": "ok.png", "conversations": _turns("<image>", "red")},
        {"image": "bad.png", "conversations": _turns("<image>", "??")},
    ])
    out = tmp_path / "out"
    out.mkdir()
    line = user_error(["prep", "--format", "image-text", "--input", llava, "--tokenizer", vlm_tokenizer,
                       "--output-prefix", out / "vl", "--quiet", *extra], capsys)
    assert line.startswith(f"tessera-data: {llava}:record 1 image 0: ") or f"{llava}:record 1 image 0: " in line
    assert expect in line
    assert list(out.iterdir()) == []


def test_a_tokenizer_without_the_image_placeholder_is_refused_in_one_line(tokenizer_dir, tmp_path, capsys):
    d = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    llava = _llava(tmp_path, {"r.png": _png("red")}, [{"image": "r.png", "conversations": _turns("<image>", "red")}])
    line = user_error(["prep", "--format", "image-text", "--input", llava, "--tokenizer", d,
                       "--output-prefix", tmp_path / "vl", "--quiet"], capsys)
    assert "'<image>' is not one token of the tokenizer" in line


def test_merge_refuses_an_image_text_shard_in_one_line_rather_than_drop_its_images(vlm_tokenizer, tmp_path, capsys):
    llava = _llava(tmp_path, {"r.png": _png("red")}, [{"image": "r.png", "conversations": _turns("<image>", "red")}])
    assert run(["prep", "--format", "image-text", "--input", llava, "--tokenizer", vlm_tokenizer,
                "--output-prefix", tmp_path / "vl", "--quiet"]) == 0
    prefix = tmp_path / "vl_conversations_document"
    line = user_error(["merge", "--inputs", prefix, "--output-prefix", tmp_path / "merged"], capsys)
    assert f"{prefix}.json: an image-text shard" in line
    assert not list(tmp_path.glob("merged*"))


def _tar(path, members):
    with tarfile.open(path, "w") as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:  # a link, which must never be followed
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            else:
                info.size = len(data)
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def test_a_webdataset_sample_keeps_several_images_in_order_and_a_malformed_one_is_skipped_or_named(
        vlm_tokenizer, tmp_path, capsys):
    red, blue = _png("red"), _png("blue")
    conv = json.dumps({"conversations": _turns("<image> and <image>?", "red, blue")}).encode()
    tar = _tar(tmp_path / "w.tar", [("a.0.png", red), ("a.1.png", blue), ("a.json", conv), ("a.2.png", None),
                                    ("b.png", red), ("b.json", b"{not json")])
    prefix = tmp_path / "vl_conversations_document"
    assert run(["prep", "--format", "image-text", "--input", tar, "--tokenizer", vlm_tokenizer,
                "--output-prefix", tmp_path / "vl", "--quiet"]) == 0
    store = IndexedDataset(image_store_prefix(prefix))
    assert store.num_documents == 1 and sample_images(store, 0) == [red, blue]
    assert read_shard_manifest(prefix).model_extra["skipped"]["total"] == 1
    line = user_error(["prep", "--format", "image-text", "--input", tar, "--tokenizer", vlm_tokenizer,
                       "--output-prefix", tmp_path / "again", "--on-error", "fail", "--quiet"], capsys)
    assert f"{tar}:2: KEY.json is not JSON" in line and "(b)" in line
    assert not list(tmp_path.glob("again*"))


def test_overwrite_replaces_an_image_store_only_when_it_is_one(vlm_tokenizer, tmp_path, capsys):
    """The image store beside an image-text shard is part of prep's output: a file of the user's at
    its name is refused (with --overwrite too) and kept; prep's own store is replaced."""
    llava = _llava(tmp_path, {"r.png": _png("red")}, [{"image": "r.png", "conversations": _turns("<image>", "red")}])
    prep = ["prep", "--format", "image-text", "--input", llava, "--tokenizer", vlm_tokenizer,
            "--output-prefix", tmp_path / "vl", "--quiet"]
    theirs = bin_path(image_store_prefix(tmp_path / "vl_conversations_document"))
    theirs.write_bytes(b"my photos")
    assert "already exists" in user_error(prep, capsys)
    line = user_error([*prep, "--overwrite"], capsys)
    assert f"{theirs} exists and is not a shard" in line, line
    assert theirs.read_bytes() == b"my photos" and not (tmp_path / "vl_conversations_document.json").exists()
    theirs.unlink()
    assert run(prep) == 0
    assert run([*prep, "--overwrite"]) == 0
    assert run(["verify", tmp_path / "vl_conversations_document"]) == 0


def test_overwrite_never_leaves_the_earlier_shard_beside_the_new_image_store(vlm_tokenizer, tmp_path, monkeypatch):
    """While prep --overwrite publishes, a token shard under its final name is never the earlier
    run's beside the new image store: its manifest's image checksum is that of the store there."""
    import hashlib
    import os
    from pathlib import Path

    llava = _llava(tmp_path, {"r.png": _png("red"), "g.png": _png("green")},
                   [{"image": "r.png", "conversations": _turns("<image>", "red")}])
    prep = ["prep", "--format", "image-text", "--input", llava, "--tokenizer", vlm_tokenizer,
            "--output-prefix", tmp_path / "vl", "--quiet"]
    assert run(prep) == 0
    _llava(tmp_path, {"r.png": _png("red"), "g.png": _png("green")},
           [{"image": "g.png", "conversations": _turns("<image>", "green")}])  # the same files, another image
    shard = tmp_path / "vl_conversations_document"
    store_bin = bin_path(image_store_prefix(shard))
    checked, real_replace = [], os.replace

    def replace(src, dst):
        real_replace(src, dst)
        manifest = Path(f"{shard}.json")
        if manifest.exists() and store_bin.exists():
            wanted = json.loads(manifest.read_text())["images"]["checksums"]["bin"]
            assert hashlib.sha256(store_bin.read_bytes()).hexdigest() == wanted, f"after replacing {dst}"
        checked.append(Path(dst).name)

    monkeypatch.setattr(os, "replace", replace)
    assert run([*prep, "--overwrite"]) == 0
    assert store_bin.name in checked, checked
    monkeypatch.undo()
    assert run(["verify", shard]) == 0
