"""generation_config.json's settings survive HF -> import -> reshard -> export, and transformers
reads the export's file back with the same values."""

from __future__ import annotations

import json

from ckpt_helpers import make_checkpoint, tiny_llama

from tessera.ckpt_convert.cli import run
from tessera.common.checkpoint import read_sidecar, resolve_checkpoint

# As Meta's Llama-3-Instruct ships it (its end ids: <|end_of_text|>, <|eom_id|>... here ids of the tiny vocab),
# plus every sampling field vLLM takes and keys Tessera ignores.
LLAMA3_LIKE = {"bos_token_id": 0, "do_sample": True, "eos_token_id": [1, 7, 5], "temperature": 0.6, "top_p": 0.9,
               "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 77,
               "transformers_version": "4.40.0.dev0", "num_beams": 1, "pad_token_id": None}
KEPT = ("do_sample", "eos_token_id", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def test_generation_settings_survive_import_reshard_and_export(tmp_path, tokenizer_dir, capsys):
    from transformers import GenerationConfig

    make_checkpoint(tmp_path / "orig", tiny_llama(), tokenizer_dir)
    hf = tmp_path / "hf"
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "orig"), "--output", str(hf),
                "--quiet"]) == 0
    (hf / "generation_config.json").write_text(json.dumps(LLAMA3_LIKE))
    steps = [["import", "--format", "hf", "--input", str(hf), "--output", str(tmp_path / "imported")],
             ["reshard", "--checkpoint", str(tmp_path / "imported"), "--output", str(tmp_path / "tp2"),
              "--tensor-parallel", "2", "--pipeline-parallel", "2"],
             ["export", "--format", "hf", "--checkpoint", str(tmp_path / "tp2"), "--output", str(tmp_path / "out")]]
    for argv in steps:
        assert run([*argv, "--quiet"]) == 0, argv
    record = read_sidecar(resolve_checkpoint(tmp_path / "tp2")).generation
    assert record is not None and record.eos_token_ids == [1, 7, 5] and record.max_new_tokens == 77
    assert run(["info", str(tmp_path / "tp2")]) == 0
    assert ("generation   end ids [1, 7, 5], temperature 0.6, top_p 0.9, top_k 20, min_p 0.05, repetition_penalty 1.1, "
            "max_new_tokens 77, do_sample True") in capsys.readouterr().out
    written = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert {k: written[k] for k in KEPT} == {k: LLAMA3_LIKE[k] for k in KEPT}
    assert written["_from_model_config"] is False  # transformers' flag: not just the model config's ids
    original, exported = GenerationConfig.from_pretrained(hf), GenerationConfig.from_pretrained(tmp_path / "out")
    for k in KEPT:
        assert getattr(exported, k) == getattr(original, k), k


def test_a_sidecar_written_before_the_record_loads_and_exports_the_tokenizers_ids_as_before(tmp_path, tokenizer_dir,
                                                                                           capsys):
    make_checkpoint(tmp_path / "orig", tiny_llama(), tokenizer_dir)
    sidecar = resolve_checkpoint(tmp_path / "orig") / "tessera_checkpoint.json"
    data = json.loads(sidecar.read_text())
    del data["generation"]  # as an older Tessera wrote it (the sidecar is not among its own checksums)
    sidecar.write_text(json.dumps(data))
    assert read_sidecar(sidecar.parent).generation is None
    assert run(["info", str(sidecar.parent), "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["generation"] is None
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "orig"), "--output", str(tmp_path / "hf"),
                "--quiet"]) == 0
    written = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert written == {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
