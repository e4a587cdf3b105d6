"""generation_config.json -> the typed record (tessera.common.hf.generation): what is kept, what is
ignored, and the one-line refusal of a malformed value naming the file and the field."""

from __future__ import annotations

import pytest

from tessera.common.errors import ArtifactError
from tessera.common.hf.generation import GenerationSettings, generation_settings


def test_kept_fields_ignored_keys_and_nulls():
    g = generation_settings({"eos_token_id": [128001, 128009, 128001], "temperature": 0.6, "top_p": 0.9, "top_k": None,
                             "do_sample": True, "transformers_version": "4.40", "num_beams": 1}, "g.json")
    assert g == GenerationSettings(eos_token_ids=[128001, 128009], temperature=0.6, top_p=0.9, do_sample=True)
    assert g.to_hf() == {"eos_token_id": [128001, 128009], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    assert generation_settings({"eos_token_id": 2}, "g.json").to_hf() == {"eos_token_id": 2}
    assert generation_settings({"eos_token_id": []}, "g.json").eos_token_ids == []


@pytest.mark.parametrize("data, message", [
    ({"temperature": "hot"}, "field temperature is 'hot'; expected a number in [0, 100]"),
    ({"temperature": float("nan")}, "field temperature is nan"),
    ({"top_p": 0}, "field top_p is 0; expected a number in (0, 1]"),
    ({"top_k": 1.5}, "field top_k is 1.5; expected an integer >= -1"),
    ({"top_k": True}, "field top_k is True"),
    ({"min_p": 2}, "field min_p is 2"),
    ({"repetition_penalty": 0}, "field repetition_penalty is 0"),
    ({"max_new_tokens": 0}, "field max_new_tokens is 0; expected an integer >= 1"),
    ({"do_sample": "yes"}, "field do_sample is 'yes'; expected true or false"),
    ({"eos_token_id": [1, -2]}, "field eos_token_id is [1, -2]; expected a token id or a list of them"),
    ({"eos_token_id": "</s>"}, "field eos_token_id is '</s>'"),
    ([1, 2], "expected a JSON object"),
])
def test_a_malformed_value_is_one_line_naming_the_file_and_field(data, message):
    with pytest.raises(ArtifactError) as exc:
        generation_settings(data, "/m/generation_config.json")
    assert str(exc.value).startswith("/m/generation_config.json: ") and message in str(exc.value)
    assert len(str(exc.value).splitlines()) == 1


def test_a_record_out_of_range_is_refused_as_a_sidecar_field():
    with pytest.raises(ValueError, match="top_p is 1.5"):
        GenerationSettings(top_p=1.5)


# Files real repositories ship: reading one never fails; what the sampler cannot take is set aside.
ODD = {"temperature": 0, "do_sample": False, "top_k": 0, "top_p": 0, "min_p": "0.1", "eos_token_id": [2, None, -1]}


def test_an_odd_generation_config_reads_its_good_values_and_sets_the_others_aside():
    from tessera.common.hf.generation import lenient_generation_settings

    g = lenient_generation_settings(ODD, "/m/generation_config.json")
    assert g == GenerationSettings(eos_token_ids=[2], temperature=0.0, top_k=0, do_sample=False,
                                   ignored={"top_p": 0, "min_p": "0.1", "eos_token_id": [2, None, -1]})
    assert lenient_generation_settings({"eos_token_id": None}, "g.json") == GenerationSettings()
    assert "ignored" not in g.to_hf()  # an export writes back only what was kept


def test_under_vllm_the_sampling_fields_are_not_read_and_bad_end_ids_are_dropped_with_a_warning():
    from tessera.common.hf.generation import for_serving, lenient_generation_settings

    warned: list[str] = []
    g = for_serving(lenient_generation_settings(ODD, "/m/g.json"), "vllm", "/m/g.json", warned.append)
    assert g == GenerationSettings(eos_token_ids=[2])
    assert warned == ["/m/g.json: field eos_token_id is [2, None, -1]; ignored (expected a token id or a list of them)"]


@pytest.mark.parametrize("data, field", [
    ({"top_p": 0}, "top_p is 0; expected a number in (0, 1]"),  # vLLM: "top_p must be in (0, 1]"
    ({"temperature": -1}, "temperature is -1"),  # vLLM: "temperature must be non-negative"
    ({"temperature": "0.7"}, "temperature is '0.7'"),  # vLLM compares it with numbers: a TypeError
    ({"top_k": -2}, "top_k is -2"),
    ({"min_p": 1.5}, "min_p is 1.5"),
    ({"repetition_penalty": 0}, "repetition_penalty is 0"),  # vLLM: "must be greater than zero"
    ({"max_new_tokens": 0}, "max_new_tokens is 0"),  # vLLM: max_tokens must be at least 1
])
@pytest.mark.parametrize("mode", ["auto", "/folder"])
def test_under_auto_a_default_vllms_sampler_refuses_too_is_one_line_with_the_way_out(data, field, mode):
    from tessera.common.hf.generation import for_serving, lenient_generation_settings

    with pytest.raises(ArtifactError) as exc:
        for_serving(lenient_generation_settings(data, "/m/g.json"), mode, "/m/g.json")
    msg = str(exc.value)
    assert msg.startswith(f"/m/g.json: field {field}") and "--generation-config vllm" in msg
    assert len(msg.splitlines()) == 1


def test_under_auto_a_default_vllm_takes_but_the_sampler_cannot_is_dropped_with_a_warning():
    from tessera.common.hf.generation import for_serving, lenient_generation_settings

    warned: list[str] = []
    g = for_serving(lenient_generation_settings({"temperature": 150, "repetition_penalty": 0.001, "top_p": 0.9,
                                                 "do_sample": "yes"}, "/m/g.json"), "auto", "/m/g.json", warned.append)
    assert g.sampling() == {"top_p": 0.9}
    assert warned == ["/m/g.json: field temperature is 150; ignored (expected a number in [0, 100])",
                      "/m/g.json: field repetition_penalty is 0.001; ignored (expected a number in [0.01, 10])"]
    # greedy (temperature 0 with do_sample false), top_k 0 (off), no end id: all served as they are
    g = for_serving(lenient_generation_settings({"temperature": 0, "do_sample": False, "top_k": 0,
                                                 "eos_token_id": None}, "/m/g.json"), "auto", "/m/g.json")
    assert g == GenerationSettings(temperature=0.0, top_k=0, do_sample=False)


def test_a_generation_config_that_is_not_json_is_read_as_absent_with_a_warning(tmp_path):
    # transformers raises OSError for it and vLLM then serves without the file; a trailing comma is
    # enough (real repositories have shipped one).
    from tessera.common.hf.generation import read_generation_config

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2, "temperature": 0.6,}')
    warned: list[str] = []
    assert read_generation_config(tmp_path, warn=warned.append) is None
    assert len(warned) == 1 and warned[0].startswith(f"{tmp_path / 'generation_config.json'}: not valid JSON")
    assert "ignored" in warned[0]
    (tmp_path / "generation_config.json").write_text("[2]")  # JSON, not an object: transformers fails on it too
    with pytest.raises(ArtifactError, match="expected a JSON object"):
        read_generation_config(tmp_path, warn=warned.append)
