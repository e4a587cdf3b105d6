"""`tessera-ckpt ... --overwrite` replaces only what the verb itself would have written.

It replaced whatever was at --output once the new artifact was complete: `export --output ~/
--overwrite` deleted the home folder. Now an existing output is replaced only when it is an empty
folder or an artifact of the verb's kind (fileio.check_replaceable); anything else, a file, or a
link is one line, exit 2, with nothing written or removed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt_helpers import make_checkpoint, refused, tiny_llama

from tessera.ckpt_convert.cli import run

VERBS = {
    "reshard": ["reshard", "--checkpoint", "CK", "--tensor-parallel", "1", "--pipeline-parallel", "1"],
    "export-hf": ["export", "--format", "hf", "--checkpoint", "CK"],
    "export-trtllm": ["export", "--format", "trtllm", "--checkpoint", "CK"],
    "export-megatron": ["export", "--format", "megatron", "--checkpoint", "CK"],
    "import-hf": ["import", "--format", "hf", "--input", "HF"],
    "import-megatron": ["import", "--format", "megatron", "--input", "MG", "--model-config", "CFG"],
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    cfg = tiny_llama(num_layers=1)
    make_checkpoint(root / "ck", cfg, tokenizer_dir)
    run(["export", "--format", "hf", "--checkpoint", str(root / "ck"), "--output", str(root / "hf"), "--quiet"])
    run(["export", "--format", "megatron", "--checkpoint", str(root / "ck"), "--output", str(root / "mg"), "--quiet"])
    (root / "model.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    return {"CK": root / "ck", "HF": root / "hf", "MG": root / "mg", "CFG": root / "model.json"}


def argv(verb: str, inputs: dict[str, Path], output: Path) -> list[str]:
    return [str(inputs[a]) if a in inputs else a for a in VERBS[verb]] + ["--output", str(output), "--quiet"]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` (the folder itself included) with a file's bytes (None: a folder)."""
    return {str(p.relative_to(root.parent)): (p.read_bytes() if p.is_file() else None)
            for p in [root, *sorted(root.rglob("*"))]}


@pytest.mark.parametrize("verb", VERBS)
def test_a_folder_of_other_files_a_file_or_a_link_is_refused_with_overwrite_and_kept(tmp_path, inputs, capsys,
                                                                                     verb):
    victim = tmp_path / "home"
    (victim / "photos").mkdir(parents=True)
    (victim / "notes.txt").write_text("keep me")
    (victim / "photos" / "a.jpg").write_bytes(bytes(range(256)))
    before = tree(tmp_path)
    err = refused(capsys, [*argv(verb, inputs, victim), "--overwrite"])
    assert f"--output {victim}: holds 2 files or folders that are not a " in err and "remove it" in err, err
    assert tree(tmp_path) == before  # nothing removed, nothing staged beside it

    lone = tmp_path / "model.bin"
    lone.write_bytes(b"\x00" * 64)
    err = refused(capsys, [*argv(verb, inputs, lone), "--overwrite"])
    assert f"--output {lone}: is a file, not a " in err, err
    assert lone.read_bytes() == b"\x00" * 64

    # A link to a folder the verb could replace: judged as a link, and what it leads to stays.
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    err = refused(capsys, [*argv(verb, inputs, link), "--overwrite"])
    assert f"--output {link}: is a symbolic link" in err, err
    assert link.is_symlink() and target.is_dir() and not any(target.iterdir())


def names(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("verb", VERBS)
def test_the_verbs_own_earlier_output_and_an_empty_folder_are_replaced(tmp_path, inputs, verb):
    """Replaced as a whole (DCP's .metadata holds a fresh id per save, so names are compared)."""
    out = tmp_path / "out"
    assert run(argv(verb, inputs, out)) == 0
    first = names(out)
    assert run([*argv(verb, inputs, out), "--overwrite"]) == 0
    assert names(out) == first
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run([*argv(verb, inputs, empty), "--overwrite"]) == 0
    assert names(empty) == first


@pytest.mark.parametrize("verb", VERBS)
def test_the_verbs_own_output_with_a_users_file_put_in_it_is_refused_and_kept(tmp_path, inputs, capsys, verb):
    """Replacing deletes the whole folder, so a folder holding the artifact and anything else
    (a checkpoint_dir that was the user's project folder, notes beside an export) is not the artifact."""
    out = tmp_path / "out"
    assert run(argv(verb, inputs, out)) == 0
    (out / "notes.txt").write_text("keep me")
    before = tree(tmp_path)
    err = refused(capsys, [*argv(verb, inputs, out), "--overwrite"])
    assert f"--output {out}: holds {len(list(out.iterdir()))} files or folders that are not a " in err, err
    assert tree(tmp_path) == before


def test_the_checkpoint_recogniser_takes_each_form_a_checkpoint_output_has(tmp_path, inputs):
    """A checkpoints directory with its pointer, one without it (pointer lost, iterations kept); not
    a folder whose iteration never got its sidecar (a save cut short), nor one iteration directory:
    the verbs write a checkpoints directory, and one put in place of a run's iteration would leave
    that run's pointer on a folder with no sidecar (its resume broken, the iteration lost)."""
    import shutil

    from tessera.common.checkpoint import POINTER, SIDECAR, is_checkpoint_output

    whole = tmp_path / "whole"
    shutil.copytree(inputs["CK"], whole)
    assert is_checkpoint_output(whole) and not is_checkpoint_output(whole / "iter_0000010")
    (whole / POINTER).unlink()
    assert is_checkpoint_output(whole)
    (whole / "iter_0000010" / SIDECAR).unlink()
    assert not is_checkpoint_output(whole) and not is_checkpoint_output(whole / "iter_0000010")
    (whole / POINTER).write_text("10\n")
    assert is_checkpoint_output(whole)
    # What a trainer's save in progress leaves beside them is the checkpoint's; anything else is not.
    (whole / ".iter_0000011.partial").mkdir()
    (whole / f".{POINTER}.tmp-123-0123abcd").write_text("11\n")
    assert is_checkpoint_output(whole)
    (whole / "train.py").write_text("print('mine')\n")
    assert not is_checkpoint_output(whole)


def test_import_hf_llava_parts_refuses_a_folder_of_other_files_and_replaces_its_own(tmp_path, tokenizer_dir, capsys):
    from test_vlm_llava_parts import _parts

    _parts(tmp_path, tokenizer_dir, "clip")
    verb = ["import", "--format", "hf-llava-parts", "--vision", str(tmp_path / "vision"), "--language",
            str(tmp_path / "lm"), "--quiet", "--output"]
    victim = tmp_path / "home"
    victim.mkdir()
    (victim / "notes.txt").write_text("keep me")
    before = tree(tmp_path)
    err = refused(capsys, [*verb, str(victim), "--overwrite"])
    assert f"--output {victim}: holds 1 files or folders that are not a Tessera checkpoint" in err, err
    assert tree(tmp_path) == before
    assert run([*verb, str(tmp_path / "out")]) == 0
    first = names(tmp_path / "out")
    assert run([*verb, str(tmp_path / "out"), "--overwrite"]) == 0
    assert names(tmp_path / "out") == first


@pytest.mark.parametrize("verb, inside, given", [("export-hf", ".", "."), ("import-hf", "iter_0000000", "..")])
def test_an_output_given_as_dot_or_dotdot_is_the_folder_it_names(tmp_path, inputs, monkeypatch, verb, inside, given):
    """`--output . --overwrite` from inside the verb's earlier output (or `..` from inside its
    iteration) replaces that folder: `.` and `..` are no names to stage a sibling under or rename."""
    out = tmp_path / "out"
    assert run(argv(verb, inputs, out)) == 0
    first = names(out)
    monkeypatch.chdir(out / inside)
    assert run([*argv(verb, inputs, Path(given)), "--overwrite"]) == 0
    assert names(out) == first and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_iteration_directory_of_another_run_is_not_replaced_by_a_checkpoints_directory(tmp_path, inputs, capsys):
    import shutil

    run_b = tmp_path / "b" / "checkpoints"
    shutil.copytree(inputs["CK"], run_b)
    iteration = run_b / "iter_0000010"
    before = tree(tmp_path / "b")
    err = refused(capsys, [*argv("reshard", inputs, iteration), "--overwrite"])
    assert f"--output {iteration}: holds " in err and "not a Tessera checkpoint" in err, err
    assert tree(tmp_path / "b") == before
