"""An odd vocabulary under tensor parallel: padded (Megatron's rule at TP2) it trains exactly like
the unpadded model in one process, tied (GPT-2 style) and untied, with sequence parallel."""

from __future__ import annotations

import json

import parallel_harness as H
import pytest
import torch
from test_parity import STEPS, assert_close_seq, torchrun

from tessera.common.checkpoint import load_model_tensors

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

GPT2 = dict(arch="gpt2", norm="layernorm", activation="gelu", position="learned", bias=True, num_kv_heads=4)


def test_odd_vocabulary_trains_under_tp2_like_one_process(tmp_path):
    torch.set_num_threads(1)
    jobs = {
        "gpt2_tied_127": dict(model={**GPT2, "vocab_size": 127, "tie_embeddings": True}, sp=False),
        "llama_untied_251": dict(model={"vocab_size": 251, "tie_embeddings": False}, sp=True),
    }
    spec = {"jobs": []}
    for name, job in jobs.items():
        padded = H.model_config(**job["model"]).padded_for(2)
        assert padded.vocab_rows == 256
        spec["jobs"].append(dict(name=name, layout=dict(tensor=2), steps=STEPS, save=str(tmp_path / name),
                                 model={**job["model"], "padded_vocab_size": padded.vocab_rows},
                                 training=dict(micro_batch_size=4), parallel=dict(sequence_parallel=job["sp"]),
                                 out=str(tmp_path / f"{name}.json")))
    torchrun(2, spec, tmp_path)
    for name, job in jobs.items():
        cfg = H.model_config(**job["model"])  # no padding, one process
        want, model, _ = H.reference_run(cfg, STEPS)
        assert_close_seq(json.loads((tmp_path / f"{name}.json").read_text())["losses"], want, name)
        stored = load_model_tensors(tmp_path / name)
        diff_sq = ref_sq = 0.0
        for pname, ref in model.named_parameters():
            got = stored[pname]
            if pname in ("embed_tokens.weight", "lm_head.weight"):
                assert got.shape[0] == 256 and not got[cfg.vocab_size:].any(), pname  # padding stays zero
                got = got[:cfg.vocab_size]
            diff_sq += (got - ref.detach()).pow(2).sum().item()
            ref_sq += ref.detach().pow(2).sum().item()
        assert (diff_sq / ref_sq) ** 0.5 < 1e-5, name
