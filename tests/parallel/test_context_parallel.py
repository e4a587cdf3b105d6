"""Context parallel trains like one process: CP2 (x DP2), CP2 x TP2 with sequence parallel,
CP2 x PP2 (1F1B; each stage's context group gathers its own keys/values, positions travel with
the micro-batches; the tied head on the last stage), and CP2 (x DP2) and CP2 x PP2 over packed
documents (positions restart per document, attention stays inside each, EOD inputs carry no
loss), in one 4-process torchrun launch (gloo/CPU, fp32, 10 steps of the tiny Llama, sequence
16: four chunks of 4 tokens, rank i holding chunks i and 3-i).

Per-step losses within 1e-5 and pre-clip gradient norms within 1e-4 of the single-process
reference, final weights (from each job's layout-free DCP checkpoint) as in test_parity, and
parameters bit-identical across context (and data, tensor) replicas. Also: the chunk
assignment, and the refusal of a sequence that 2C chunks do not divide.
"""

from __future__ import annotations

import json

import parallel_harness as H
import pytest
import torch
from test_parity import assert_close_seq, assert_weights, torchrun

from tessera.common.errors import UserError
from tessera.common.layout import ParallelLayout, validate_layout
from tessera.common.parallel.context_parallel import local_token_index

STEPS = 10
NORM_RTOL = 1e-4


def test_context_ranks_hold_balanced_causal_chunks():
    # 2C = 8 chunks of 2 tokens: rank i holds chunk i and chunk 7 - i.
    assert local_token_index(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert local_token_index(16, 4, 3).tolist() == [6, 7, 8, 9]
    held = torch.cat([local_token_index(16, 4, r) for r in range(4)])
    assert sorted(held.tolist()) == list(range(16))


def test_a_sequence_that_2c_chunks_do_not_divide_is_refused_in_one_line():
    cfg = H.model_config()
    with pytest.raises(UserError) as e:
        validate_layout(cfg, ParallelLayout(context=3), seq_len=16)
    assert "--context-parallel 3" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError) as e:  # with FSDP, as without
        validate_layout(cfg, ParallelLayout(context=2, data=2, data_shard=2), seq_len=18)
    assert "--context-parallel 2: seq_len (18)" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.distributed
def test_context_parallel_with_data_tensor_pipeline_parallel_and_packed_documents_matches_one_process(tmp_path):
    torch.set_num_threads(1)
    norms: list[float] = []
    ref_losses, ref_model, _ = H.reference_run(H.model_config(), STEPS, grad_norms=norms)
    doc_norms: list[float] = []
    doc_losses, doc_model, _ = H.reference_run(H.model_config(), STEPS, grad_norms=doc_norms, documents=True)

    def job(name, layout, parallel=None, **kw):
        return dict(name=name, layout=layout, training=dict(micro_batch_size=1), parallel=parallel or {}, steps=STEPS,
                    save=str(tmp_path / name), out=str(tmp_path / f"{name}.json"), **kw)

    jobs = [
        job("cp2_dp2", dict(context=2, data=2)),
        job("cp2_tp2", dict(context=2, tensor=2), dict(sequence_parallel=True), meta=True),
        job("cp2_dp2_documents", dict(context=2, data=2), per_token_loss=True, documents=True),
        job("cp2_pp2", dict(context=2, pipeline=2)),
        job("cp2_pp2_documents", dict(context=2, pipeline=2), per_token_loss=True, documents=True, meta=True),
    ]
    torchrun(4, {"jobs": jobs}, tmp_path, timeout=400)

    for name, losses, grad_norms, model in (("cp2_dp2", ref_losses, norms, ref_model),
                                            ("cp2_tp2", ref_losses, norms, ref_model),
                                            ("cp2_dp2_documents", doc_losses, doc_norms, doc_model),
                                            ("cp2_pp2", ref_losses, norms, ref_model),
                                            ("cp2_pp2_documents", doc_losses, doc_norms, doc_model)):
        r = json.loads((tmp_path / f"{name}.json").read_text())
        assert_close_seq(r["losses"], losses, name)
        for i, (got, want) in enumerate(zip(r["grad_norms"], grad_norms)):
            assert abs(got - want) <= NORM_RTOL * want, f"{name}: step {i}: grad norm {got} vs {want}"
        assert r["divergence"] == [0.0, 0.0], f"{name}: replicas diverged {r['divergence']}"
        assert_weights(tmp_path / name, model, name)
