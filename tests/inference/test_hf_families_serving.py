"""Serving every model family from a directory transformers saved (random tiny models built at test
time): greedy generations equal transformers' `generate` token for token, through the paged KV
cache with sliding windows shorter than the prompt and MoE layers in the model runner."""

from __future__ import annotations

import pytest
from hf_families import CASES, build
from inference_helpers import hf_greedy, make_engine, run_all, token_ids
from test_hf_serving import _save

from tessera.inference.core.sampling_params import SamplingParams

PROMPTS = {"a": [4, 9, 200, 31, 77, 5, 6, 7, 8, 120, 3], "b": [17, 300, 2, 2, 45, 1, 99]}


@pytest.mark.parametrize("name", list(CASES))
def test_family_is_served_token_for_token_like_transformers(tiny_ckpt, tmp_path, name):
    """Two requests at once, so decode steps go through the grouped decode path and the prefill of
    one (block size 4: windows span several blocks) through the paged kernel's reference."""
    family, over = CASES[name]
    hf = build(family, **over)
    export = _save(hf, tiny_ckpt, tmp_path / "hf")
    engine = make_engine(export, num_kv_blocks=64, block_size=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = run_all(engine, {rid: (p, params) for rid, p in PROMPTS.items()})
    for rid, prompt in PROMPTS.items():
        assert token_ids(outs[rid]) == hf_greedy(hf, prompt, 12), rid
