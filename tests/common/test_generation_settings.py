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
