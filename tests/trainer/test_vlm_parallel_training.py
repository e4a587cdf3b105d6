"""A tiny LLaVA (CLIP tower + Llama LM) trained under the parallel runtime, built on the meta device
as tessera-train builds it (each rank allocates and initialises only its shards: sharded_init, the
model's init_module), takes the steps one process takes: TP2, TP2 with sequence parallel, PP2 (tower and projector on the first stage), DP2 and FSDP2,
CP2 (every context rank embeds whole rows, then keeps its two sequence chunks: images span the
chunks), fp32, batches with zero, one and two images per row; the per-step losses and pre-clip gradient
norms within 1e-5 relative, the parameters after the steps within 1e-5 normwise of one process
with torch's AdamW, and then the evaluation loss of a held-out batch. Stage 1 (projector only) and
stage 2 (projector + language model) freezing under FSDP2, TP2, TP2 + SP, DP2 and PP2 (whose second
stage has nothing to train): the same, and the frozen weights bit-identical to their initial
values. DP2 and FSDP2 (and DP2 at stage 1) with one data rank's rows all text. DP2 with
parallel.overlap_param_gather takes exactly the steps it takes without. A language model with tied embeddings under PP2 too, and a 4-layer one under interleaved PP2 (two
model chunks per rank). Packed rows (two samples a row, each
with positions from 0 and attention within itself) under TP2 + SP, PP2 and CP2. Then `tessera-train` itself under
PP2 with stage-1 freezing and full recompute: the losses and parameter norms one process logs, and
a run stopped after 2 steps and resumed ends bit-identical to an uninterrupted one. An FSDP2
rank's build peak stays well under the whole model's fp32 bytes, and a SigLIP tower with its
pooling head starts from the one-process weights under FSDP2 too.

One torchrun launch runs everything: this file is also the worker (`torchrun ... this_file out.json
straight.yaml split.yaml`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

IMAGE_TOKEN = 60
TEXT = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
            max_seq_len=32, tie_embeddings=False)
VISION = dict(arch="clip", hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, image_size=16, patch_size=8)
# vision_feature_layer -2: the tower's last block is never read (as in LLaVA), so it must not train.
MODEL = dict(kind="vision_language", vision=VISION, text=TEXT, image_token_id=IMAGE_TOKEN, vision_feature_layer=-2)
TRAIN = dict(steps=2, global_batch=8, micro_batch=2, seq=16)
EVAL = 99  # the held-out batch
LAYOUTS = {"tp2": dict(tensor=2), "tp2_sp": dict(tensor=2), "pp2": dict(pipeline=2), "dp2": dict(data=2),
           "fsdp2": dict(data=2, data_shard=2), "cp2": dict(context=2)}
STAGE_1, STAGE_2 = ("vision", "language_model"), ("vision",)
FROZEN = {"fsdp2_stage1": ("fsdp2", STAGE_1), "tp2_stage2": ("tp2", STAGE_2), "dp2_stage1": ("dp2", STAGE_1),
          "tp2_sp_stage1": ("tp2_sp", STAGE_1), "pp2_stage1": ("pp2", STAGE_1)}
# A language model with tied embeddings under PP2: the last stage's head is its own copy of the
# first stage's (vocab-parallel) embedding, kept equal by the embedding group.
TIED = {**MODEL, "text": {**TEXT, "tie_embeddings": True}}
# Interleaved 1F1B: PP2 with two model chunks per rank, a 4-layer language model (the first chunk
# holding the tower, the projector and one block).
INTERLEAVED = {**MODEL, "text": {**TEXT, "num_layers": 4}}
# One data rank's rows carry no image (text-only samples, as LLaVA's data has them): the tower
# still runs on its micro-batches (a zero image, features times 0), so FSDP2's all-gathers and DP2's
# gradient buckets line up with the rank whose rows have images; under stage 1 (only the projector
# trains) its loss still has a gradient to take.
TEXT_RANK = {"dp2_text_rank": ("dp2", ()), "fsdp2_text_rank": ("fsdp2", ()), "dp2_stage1_text_rank": ("dp2", STAGE_1)}
# data.pack_samples rows: a sample of 12 positions (its images in them) and one of 4.
PACKED = {"tp2_sp_packed": "tp2_sp", "pp2_packed": "pp2", "cp2_packed": "cp2"}
BUILD_PEAK = "build peak over the model's fp32 bytes"
# A SigLIP tower with its pooling head (its probe drawn after the head's submodules): the meta
# build's weights under FSDP2, before any step, are the one-process ones.
SIGLIP = {**MODEL, "vision": {**VISION, "arch": "siglip", "head": True}}


@pytest.mark.distributed
def test_llava_trains_under_tp_sp_pp_dp_fsdp_and_frozen_stages_like_one_process_and_resumes_bit_exact(tmp_path):
    pytest.importorskip("PIL")
    sys.path.insert(0, str(Path(__file__).parent))
    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
    from objective_parity import launch, over
    from vlm_fixtures import image_text_data, vlm_config

    from tessera.common.checkpoint import load_model_tensors, resolve_checkpoint
    from tessera.trainer.cli import main

    data = image_text_data(tmp_path / "data", n=24, train_samples=64)
    runs = {name: vlm_config(data, tmp_path / name, freeze=list(STAGE_1), global_batch_size=4, micro_batch_size=2,
                             recompute="full")
            for name in ("one", "straight", "split")}
    assert main(["--config", str(runs["one"]), "--quiet", "logging.params_norm=true"]) == 0
    errors = launch(__file__, tmp_path / "errors.json", str(runs["straight"]), str(runs["split"]))
    assert set(errors) == set(LAYOUTS) | set(FROZEN) | set(PACKED) | set(TEXT_RANK) | {
        "pp2_tied", "pp2_interleaved", "siglip_fsdp2_init", "dp2_overlap_param_gather"}, errors
    # overlap_param_gather is exact: the same collectives, waited for before any weight is read.
    assert set(errors.pop("dp2_overlap_param_gather").values()) == {0.0}, errors
    siglip = errors.pop("siglip_fsdp2_init")
    assert siglip["initial weights"] == 0.0 and siglip["tensors"] > 30 and siglip[BUILD_PEAK] < 0.75, siglip
    for name in [*FROZEN, *(n for n, (_, freeze) in TEXT_RANK.items() if freeze)]:
        assert errors[name].pop("frozen weights changed") == 0.0 and errors[name].pop("frozen tensors") > 10, errors[name]
    # Built on the meta device, an FSDP2 rank allocates only its half of the weights (plus one
    # replayed global tensor): measured 0.64 (SigLIP 0.62) of the whole model's fp32 bytes;
    # building the whole model on each rank and cutting it peaked at 1.10 (SigLIP 1.08).
    assert errors["fsdp2"].pop(BUILD_PEAK) < 0.75, errors["fsdp2"]
    assert not over(errors, 1e-5), errors

    a = load_model_tensors(resolve_checkpoint(tmp_path / "straight/run/checkpoints"))
    b = load_model_tensors(resolve_checkpoint(tmp_path / "split/run/checkpoints"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def logged(run: Path, key: str = "loss") -> dict[int, float]:
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r[key] for r in records if r["kind"] == "train"}

    assert logged(tmp_path / "straight/run") == logged(tmp_path / "split/run")
    assert sorted(logged(tmp_path / "split/run")) == [1, 2, 3, 4]
    # The torchrun run logs what one process logs: losses and the trained parameters' norm.
    for key in ("loss", "params_norm"):
        want, got = logged(tmp_path / "one/run", key), logged(tmp_path / "straight/run", key)
        assert sorted(got) == sorted(want) and all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), key


# ---- the worker (under torchrun) -------------------------------------------------------------------
def _batch(step: int, cfg, packed: bool = False, text_rank: bool = False):
    """The global batch of a step: rows with 0, 1 and 2 images (their feature tokens in runs), labels
    on about half the text positions (at least the last), none on image tokens; `packed`: each row
    two samples (positions 0-11 holding the images, then 0-3), as data.pack_samples lays them out;
    `text_rank`: the second half of the rows (data rank 1's under DP2) without images."""
    from tessera.trainer.objectives.documents import IGNORE_INDEX
    from tessera.trainer.objectives.multimodal.batches import VisionLanguageBatch

    b, t, n = TRAIN["global_batch"], TRAIN["seq"], cfg.image_seq_len
    g = torch.Generator().manual_seed(300 + step)
    counts = torch.tensor([2, 1, 0, 1, 2, 0, 1, 2]).roll(step)
    if text_rank:
        counts[b // 2:] = 0
    tokens = torch.randint(0, IMAGE_TOKEN, (b, t), generator=g)
    for row, count in enumerate(counts.tolist()):
        for k in range(count):
            tokens[row, 1 + k * (n + 1):1 + k * (n + 1) + n] = IMAGE_TOKEN
    pixels = torch.randn(b, 2, 3, 16, 16, generator=g) * (torch.arange(2)[None, :] < counts[:, None])[..., None, None, None]
    counted = (torch.rand(b, t, generator=g) < 0.5) & (tokens != IMAGE_TOKEN)
    counted[:, -1] = True
    labels = torch.where(counted, torch.randint(0, TEXT["vocab_size"], (b, t), generator=g), IGNORE_INDEX)
    if not packed:
        return VisionLanguageBatch(tokens, pixels, counts), labels
    cut = 12
    positions = torch.cat([torch.arange(cut), torch.arange(t - cut)]).expand(b, t)
    documents = (torch.arange(t) >= cut).long().expand(b, t)
    return VisionLanguageBatch(tokens, pixels, counts, positions.clone(), documents.clone()), labels


def _reference(cfg, freeze: tuple[str, ...], packed: bool = False, text_rank: bool = False):
    """One process: the plain model (parts frozen as training.freeze does), torch's AdamW over the
    parameters that train, clipping; each micro-batch's mean answer loss / micro-batches, as
    VisionLanguageStep takes it. Returns losses, pre-clip gradient norms, parameters."""
    from objective_parity import reference_training

    from tessera.common.models import registry
    from tessera.trainer.components.model_setup import apply_freeze
    from tessera.trainer.objectives.multimodal.loss import vision_language_loss

    model = registry.kind_of(cfg).build(cfg, seed=0)
    apply_freeze(model, freeze)
    norms = []
    losses, params = reference_training(model, lambda step: _batch(step, cfg, packed, text_rank),
                                        vision_language_loss, TRAIN, norms)
    mb, n = TRAIN["micro_batch"], TRAIN["global_batch"] // TRAIN["micro_batch"]
    with torch.no_grad():  # evaluation after the steps: a held-out batch's micro-batch means, averaged
        batch, labels = _batch(EVAL, cfg, packed, text_rank)
        losses.append(sum(vision_language_loss(model, batch[slice(i * mb, (i + 1) * mb)],
                                               labels[slice(i * mb, (i + 1) * mb)]).item() for i in range(n)) / n)
    return losses, norms, {k: v.detach().clone() for k, v in params.items()}


def _runtime(name: str, layout_kw: dict, cfg, freeze: tuple[str, ...] = (), overlap: bool = False):
    """The runtime as tessera-train builds it: the model on the meta device (each rank allocates
    and initialises only its shards, sharded_init), training.freeze applied. Returns it, its
    groups, and under FSDP2 the most bytes any rank held while it was built over the whole
    model's fp32 weights."""
    import contextlib

    from objective_parity import worst_over_ranks
    from parallel_harness import OPTIM
    from plan_worker import PeakBytes

    from tessera.common.layout import ParallelLayout
    from tessera.common.models import registry
    from tessera.common.parallel.state import build_groups, set_groups
    from tessera.trainer.components.model_setup import apply_freeze
    from tessera.trainer.config import OptimConfig, ParallelConfig, TrainingConfig
    from tessera.trainer.objectives.registry import parallel_objective
    from tessera.trainer.parallel.runtime import ParallelRuntime

    layout = ParallelLayout(**layout_kw)
    groups = build_groups(layout)
    set_groups(groups)
    training = TrainingConfig(seq_length=TRAIN["seq"], global_batch_size=TRAIN["global_batch"],
                              micro_batch_size=TRAIN["micro_batch"], seed=0)  # the reference's init seed
    parallel = ParallelConfig(**layout.model_dump(exclude={"data"}), sequence_parallel=name.startswith("tp2_sp"),
                              overlap_param_gather=overlap)

    def build():  # as ParallelEngine's builder
        model = registry.kind_of(cfg).build(cfg, device="meta", seed=None)
        apply_freeze(model, freeze)
        return model

    measure = name.startswith("fsdp2")
    with PeakBytes() if measure else contextlib.nullcontext() as held:
        rt = ParallelRuntime.build(cfg, groups, training, parallel, OptimConfig(**OPTIM), build_model=build,
                                   objective=parallel_objective(cfg))
    peak = worst_over_ranks({"peak": held.peak / (4 * cfg.num_params())})["peak"] if measure else None
    return rt, groups, peak


def _global_piece(p, value, groups):
    """This rank's tensor-parallel piece of a global tensor, and the parameter `p` whole over FSDP."""
    from torch.distributed.tensor import DTensor

    from tessera.common.parallel.layers import shard_dim_of

    got = p.data.full_tensor() if isinstance(p.data, DTensor) else p.data
    dim = shard_dim_of(p)
    return got, value if groups.tp == 1 or dim is None else value.chunk(groups.tp, dim=dim)[groups.tp_rank]


def _initial_weights(name: str, layout_kw: dict, cfg) -> dict[str, float]:
    """A meta build's weights against the one-process build of the seed, before any step: the
    largest difference and the tensors compared."""
    import torch.distributed as dist

    from tessera.common.models import registry

    want = dict(registry.kind_of(cfg).build(cfg, seed=0).named_parameters())
    rt, groups, peak = _runtime(name, layout_kw, cfg)
    worst = torch.zeros(())
    for pname, p in rt.named_global_params().items():
        got, value = _global_piece(p, want[pname].detach(), groups)
        worst = torch.maximum(worst, (got - value).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"initial weights": float(worst), "tensors": len(rt.named_global_params()), BUILD_PEAK: peak}


def _train(name: str, layout_kw: dict, cfg, reference, freeze: tuple[str, ...], initial,
           packed: bool = False, text_rank: bool = False) -> dict[str, float]:
    import torch.distributed as dist
    from objective_parity import worst_over_ranks

    rt, groups, peak = _runtime(name, layout_kw, cfg, freeze)
    ref_losses, ref_norms, ref_params = reference
    rows = TRAIN["global_batch"] // groups.dp_ep
    mine = slice(groups.dp_ep_rank * rows, (groups.dp_ep_rank + 1) * rows)
    errors = {}
    for step in range(TRAIN["steps"]):
        batch, labels = _batch(step, cfg, packed, text_rank)
        result = rt.train_step(batch[mine], labels[mine])
        errors[f"step {step} loss"] = abs(result.loss - ref_losses[step]) / abs(ref_losses[step])
        errors[f"step {step} grad norm"] = abs(result.grad_norm - ref_norms[step]) / ref_norms[step]
    batch, labels = _batch(EVAL, cfg, packed, text_rank)
    errors["eval loss"] = abs(rt.eval_step(batch[mine], labels[mine]) - ref_losses[-1]) / ref_losses[-1]
    diff, norm = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    changed, frozen = torch.zeros(()), torch.zeros(())
    for pname, p in rt.named_global_params().items():
        got, want = _global_piece(p, ref_params[pname], groups)
        diff += (got.double() - want.double()).pow(2).sum()
        norm += want.double().pow(2).sum()
        if pname.startswith(freeze):
            frozen += 1
            changed = torch.maximum(changed, (got - _global_piece(p, initial[pname], groups)[1]).abs().max())
    errors["params after steps (normwise)"] = float((diff / norm).sqrt())
    out = worst_over_ranks(errors)
    if name == "fsdp2":
        out[BUILD_PEAK] = peak
    if freeze:
        dist.all_reduce(changed, op=dist.ReduceOp.MAX)
        out.update({"frozen weights changed": float(changed), "frozen tensors": float(frozen)})
    return out


def _overlap(cfg, steps: int = 3) -> dict[str, float]:
    """DP2 with the distributed optimizer, parallel.overlap_param_gather on against off: the largest
    difference of the step losses and of the weights after the steps (exact: 0). The gathers are
    deferred to their waits, other ranks' slices NaN until then (parallel_harness), so a weight
    read before its wait shows whatever the timing."""
    import torch.distributed as dist
    from parallel_harness import deferred_param_gathers

    runs = []
    for overlap in (False, True):
        rt, groups, _ = _runtime("dp2", LAYOUTS["dp2"], cfg, overlap=overlap)
        rows = TRAIN["global_batch"] // groups.dp_ep
        mine = slice(groups.dp_ep_rank * rows, (groups.dp_ep_rank + 1) * rows)
        with deferred_param_gathers():
            losses = [rt.train_step(*(x[mine] for x in _batch(step, cfg))).loss for step in range(steps)]
        runs.append((losses, {k: v.detach().clone() for k, v in rt.named_global_params().items()}))
    (off, off_params), (on, on_params) = runs
    worst = torch.stack([(torch.tensor(off) - torch.tensor(on)).abs().max(),  # NaN stays NaN
                         torch.stack([(off_params[k] - on_params[k]).abs().max() for k in off_params]).max()])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"losses, overlap on - off": float(worst[0]), "weights, overlap on - off": float(worst[1])}


def _resume(straight: str, split: str) -> None:
    """tessera-train under PP2 (the second stage has nothing to train), uninterrupted and
    stopped-then-resumed, in this launch's process group."""
    import tessera.trainer.components.distributed as distributed
    from tessera.trainer.cli import main

    distributed.shutdown_runtime = lambda: None  # the launch's process group serves every run
    layout = ["parallel.pipeline=2", "logging.params_norm=true"]
    assert main(["--config", straight, "--quiet", *layout]) == 0
    assert main(["--config", split, "--quiet", *layout, "training.exit_after_steps=2"]) == 0
    assert main(["--config", split, "--quiet", *layout, "--resume"]) == 0


def _main() -> None:
    from tessera.common.models import registry
    from tessera.common.parallel.state import destroy_distributed, init_distributed

    sys.path.insert(0, str(Path(__file__).parent.parent / "parallel"))  # parallel_harness: the reference AdamW
    torch.set_num_threads(1)
    init_distributed()
    cfg = registry.model_config(MODEL)
    initial = {k: v.detach().clone() for k, v in registry.kind_of(cfg).build(cfg, seed=0).named_parameters()}
    references = {freeze: _reference(cfg, freeze) for freeze in ((), STAGE_1, STAGE_2)}
    errors = {name: _train(name, kw, cfg, references[()], (), initial) for name, kw in LAYOUTS.items()}
    for name, (layout, freeze) in FROZEN.items():
        errors[name] = _train(name, LAYOUTS[layout], cfg, references[freeze], freeze, initial)
    packed = _reference(cfg, (), packed=True)
    for name, layout in PACKED.items():
        errors[name] = _train(name, LAYOUTS[layout], cfg, packed, (), initial, packed=True)
    for name, (layout, freeze) in TEXT_RANK.items():
        reference = _reference(cfg, freeze, text_rank=True)
        errors[name] = _train(name, LAYOUTS[layout], cfg, reference, freeze, initial, text_rank=True)
    errors["dp2_overlap_param_gather"] = _overlap(cfg)
    tied = registry.model_config(TIED)
    errors["pp2_tied"] = _train("pp2_tied", LAYOUTS["pp2"], tied, _reference(tied, ()), (), {})
    deep = registry.model_config(INTERLEAVED)
    errors["pp2_interleaved"] = _train("pp2_interleaved", dict(pipeline=2, virtual_stages=2), deep,
                                       _reference(deep, ()), (), {})
    errors["siglip_fsdp2_init"] = _initial_weights("fsdp2", LAYOUTS["fsdp2"], registry.model_config(SIGLIP))
    if torch.distributed.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(errors))
    _resume(sys.argv[2], sys.argv[3])
    destroy_distributed()


if __name__ == "__main__":
    _main()
