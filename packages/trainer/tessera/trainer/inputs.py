"""What a training run is checked against before anything is built: `check_inputs`.

It validates everything that can be validated without building the model (config vs mixture vs
tokenizer vs world size and parallel layout vs the checkpoint being resumed or initialised from)
and raises UserError / ArtifactError with one line. What it learns travels to the loop as
`CheckedInputs`, so nothing is read twice: the model config with its vocabulary padded for this
tensor-parallel size (`pad_vocabulary`), the resolved layout, the document masking options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from tessera.common.checkpoint import read_sidecar, resolve_checkpoint
from tessera.common.errors import ArtifactError, UserError
from tessera.common.layers.sdpa_backend import sdpa_backend_problem
from tessera.common.layout import ParallelLayout, validate_layout
from tessera.common.mixture import (
    MANIFEST,
    MixtureManifest,
    mixture_fingerprint,
    read_mixture_manifest,
    resolve_prefix,
)
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.shard import first_problem, read_shard_manifest
from tessera.common.tokenizer import Tokenizer, load_tokenizer
from tessera.trainer.components.checkpoint.storage import latest_checkpoint
from tessera.trainer.components.distributed import pick_device
from tessera.trainer.components.precision.float8 import float8_backend
from tessera.trainer.config import PLACEHOLDER_VOCAB, TrainConfig
from tessera.trainer.objectives.documents import DocumentMasking


@dataclass
class CheckedInputs:
    """What check_inputs learned, so nothing is read twice."""

    model: ModelConfig
    manifest: MixtureManifest
    mixture_fingerprint: str
    tokenizer: Tokenizer
    resume_from: Path | None
    layout: ParallelLayout
    pipeline_layers: list[int] | None = None  # layers per stage (parallel runs)
    init_from: Path | None = None  # checkpoint.init_from, resolved; None when resuming this run's own
    documents: DocumentMasking | None = None  # data.reset_position_ids / reset_attention_mask / eod_mask_loss

    @property
    def parallel(self) -> bool:
        """Whether the run needs the parallel runtime (anything but one plain process)."""
        return self.layout.world_size > 1


def check_inputs(cfg: TrainConfig, world_size: int = 1, resume: bool = False) -> CheckedInputs:
    """Every check that needs files or the world size; raises UserError before any work."""
    t = cfg.training
    if t.precision == "fp8":  # the backend's checks need only the config and this machine: first
        processes = max(world_size, cfg.parallel.model_parallel_size * cfg.parallel.data_shard)
        problem = float8_backend(t.fp8_backend).problem(t, cfg.resolve_model(PLACEHOLDER_VOCAB),
                                                        pick_device(t.device, 0), processes)
        if problem:
            raise UserError(problem)
    if problem := sdpa_backend_problem(t.attention_backend, pick_device(t.device, 0), "training.attention_backend"):
        raise UserError(problem)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if t.threads is not None and cpus and t.threads > cpus:  # 10^5 made torch start 10^5 threads and crash
        raise UserError(f"training.threads ({t.threads}) is more than the {cpus} CPUs this process may use; set "
                        "at most that, or leave it unset for torch's choice")
    layout = cfg.parallel.layout(world_size)
    readers = layout.batch_readers
    size = f"data-parallel size ({layout.data})" + (f" x expert-parallel size ({layout.expert})"
                                                     if layout.expert > 1 else "")
    if t.global_batch_size % (t.micro_batch_size * readers):
        raise UserError(f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                        f"training.micro_batch_size ({t.micro_batch_size}) x {size}")
    if t.rampup_batch_size is not None:
        start, increment, _ = t.rampup_batch_size
        sizes = range(start, t.global_batch_size, increment)
        bad = [b for b in sizes if b % (t.micro_batch_size * readers)]
        if bad:
            raise UserError(f"training.rampup_batch_size {list(t.rampup_batch_size)}: batch sizes {bad} are not "
                            f"multiples of training.micro_batch_size ({t.micro_batch_size}) x {size}; pick a "
                            "start and increment that are")
    if layout.world_size > 1:
        check_parallel_options(cfg)
    manifest = read_mixture_manifest(cfg.data.mixture)
    manifest_path = Path(cfg.data.mixture) / MANIFEST
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.fingerprint != manifest.tokenizer_fingerprint:
        raise ArtifactError(f"{manifest_path}: mixture was built with another tokenizer "
                            f"({manifest.tokenizer_fingerprint[:19]}…) than data.tokenizer {cfg.data.tokenizer} "
                            f"({tokenizer.fingerprint[:19]}…); use the tokenizer the data was prepared with")
    if manifest.seq_length < t.seq_length:
        raise ArtifactError(f"{manifest_path}: mixture was built for seq_length {manifest.seq_length}, shorter than "
                            f"training.seq_length {t.seq_length}; rebuild it with `tessera-data blend --seq-length "
                            f"{t.seq_length}` or lower training.seq_length")
    evaluating = bool(t.eval_interval or t.eval_only)
    for split in [cfg.data.train_split] + ([cfg.data.valid_split] if evaluating and cfg.data.valid_split else []):
        info = manifest.splits.get(split)
        if info is None or info.num_samples == 0:
            raise ArtifactError(f"{manifest_path}: mixture has no samples in split {split!r} "
                                f"(needed by data.{'train' if split == cfg.data.train_split else 'valid'}_split)")
    if t.eval_only and not any(split and manifest.splits.get(split) and manifest.splits[split].num_samples
                               for split in (cfg.data.valid_split, cfg.data.test_split)):
        raise ArtifactError(f"{manifest_path}: training.eval_only has nothing to evaluate: no samples in "
                            f"data.valid_split ({cfg.data.valid_split}) or data.test_split ({cfg.data.test_split})")
    try:
        model = cfg.resolve_model(manifest.vocab_size)
    except ValidationError as exc:  # only the mixture's vocabulary is new here (the rest was validated)
        raise ArtifactError(f"{manifest_path}: vocab_size {manifest.vocab_size} does not give a valid model "
                            f"({first_problem(exc)}); blend shards of a smaller tokenizer") from None
    if model.vocab_size < manifest.vocab_size:
        raise UserError(f"model.vocab_size ({model.vocab_size}) is smaller than the mixture's vocabulary "
                        f"({manifest.vocab_size}, {manifest_path})")
    resume_from = latest_checkpoint(cfg.checkpoint_dir) if resume else None
    fingerprint = mixture_fingerprint(cfg.data.mixture)
    existing = resume_from or (cfg.checkpoint.init_from if cfg.checkpoint.init_from is not None else None)
    model = pad_vocabulary(model, cfg, layout.tensor, read_sidecar(resolve_checkpoint(existing)).model
                           if existing is not None else None)
    if resume_from is not None:
        sidecar = read_sidecar(resume_from)
        if sidecar.model != model and hasattr(model, "padded_vocab_size") and sidecar.model == model.model_copy(
                update={"padded_vocab_size": getattr(sidecar.model, "padded_vocab_size", None)}):
            raise ArtifactError(f"{resume_from}: checkpoint's {sidecar.model.vocab_rows} vocabulary rows do not divide "
                                f"tensor parallel {layout.tensor}; `tessera-ckpt reshard` it to this layout (which "
                                "re-pads them) and resume from that")
        if sidecar.model != model:
            raise ArtifactError(f"{resume_from}: checkpoint holds a different model than the config "
                                "(compare model sections); resume with the config it was trained with")
        # data.pack_samples: consumed_samples counts packed rows of training.seq_length, not samples,
        # so another packing or row length would silently skip or repeat data (unknown: not checked).
        packed = t.seq_length if cfg.data.pack_samples else None
        saved = getattr(sidecar, "packed_seq_length", packed)
        if saved != packed and (saved is None or packed is None):
            raise ArtifactError(f"{resume_from}: data.pack_samples is {packed is not None} but the checkpoint was "
                                f"trained with {saved is not None} (its data position counts "
                                f"{'packed rows' if saved else 'samples'}); resume with "
                                f"data.pack_samples={str(saved is not None).lower()}")
        if saved != packed:
            raise ArtifactError(f"{resume_from}: training.seq_length is {packed} but the checkpoint packed rows of "
                                f"{saved} (data.pack_samples: its data position counts rows); resume with "
                                f"training.seq_length={saved}")
        if sidecar.mixture_fingerprint not in (None, fingerprint):
            raise ArtifactError(f"{resume_from}: checkpoint was trained on another mixture than {cfg.data.mixture}; "
                                "exact resume needs the same mixture")
    outside = [r for r in cfg.profiling.ranks or [] if r >= layout.world_size]
    if cfg.profiling.start_step is not None and outside:
        raise UserError(f"profiling.ranks {outside} are not ranks of this run (world size {layout.world_size}); "
                        "use ranks below it, or null for every rank")
    init_from = None
    if cfg.checkpoint.init_from is not None and resume_from is None:
        init_from = check_init_from(cfg.checkpoint.init_from, model, tokenizer)
    documents = None
    loss_mask = mixture_has_loss_mask(Path(cfg.data.mixture), manifest)
    if cfg.data.document_options or loss_mask:
        d = cfg.data
        eod = end_of_document_id(cfg, manifest, tokenizer) if d.document_options else None
        documents = DocumentMasking(eod, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss, loss_mask)
    counts = None
    if layout.world_size > 1 or layout.data_shard > 1:  # one process: parallel.data_shard would go unused
        counts = validate_layout(model, layout, seq_len=t.seq_length, global_batch=t.global_batch_size,
                                 micro_batch=t.micro_batch_size, sequence_parallel=cfg.parallel.sequence_parallel,
                                 world_size=world_size)
        if t.rampup_batch_size is not None:  # the pipeline's micro-batch rules hold at every ramp size too
            for batch in range(t.rampup_batch_size[0], t.global_batch_size, t.rampup_batch_size[1]):
                try:
                    validate_layout(model, layout, seq_len=t.seq_length, global_batch=batch,
                                    micro_batch=t.micro_batch_size, sequence_parallel=cfg.parallel.sequence_parallel,
                                    world_size=world_size)
                except UserError as exc:
                    raise UserError(f"training.rampup_batch_size: at global batch {batch}: {exc}") from None
    layout = layout.resolved(model.num_layers)  # the sidecar records the layer split it runs
    return CheckedInputs(model, manifest, fingerprint, tokenizer, resume_from, layout, counts, init_from, documents)


DOCUMENT_OPTIONS = "data.reset_position_ids, reset_attention_mask and eod_mask_loss"


def mixture_has_loss_mask(mixture: Path, manifest: MixtureManifest) -> bool:
    """Whether any shard of the mixture is fine-tuning data with a loss mask (then the loss counts
    only its answer tokens, per token over the global batch: tessera.trainer.objectives.documents)."""
    return any(read_shard_manifest(resolve_prefix(mixture, e.prefix)).loss_mask for e in manifest.datasets)


def end_of_document_id(cfg: TrainConfig, manifest: MixtureManifest, tokenizer: Tokenizer) -> int:
    """The token ending documents in the mixture's shards: the `eod_id` their manifests record (the one
    `tessera-data prep` appended), else the tokenizer's eos. Refuses shards without end-of-document tokens."""
    mixture = Path(cfg.data.mixture)
    recorded = {}
    for entry in manifest.datasets:
        prefix = resolve_prefix(mixture, entry.prefix)
        shard = read_shard_manifest(prefix)
        if not shard.append_eod:
            raise ArtifactError(f"{prefix}.json: shard was prepared with --no-append-eod, so its documents carry no "
                                f"end-of-document token for {DOCUMENT_OPTIONS}; prepare it again without "
                                "--no-append-eod or switch those options off")
        if shard.eod_id is not None:
            recorded[shard.eod_id] = prefix
    if len(recorded) > 1:
        raise ArtifactError(f"{mixture / MANIFEST}: its shards end documents with different tokens "
                            f"({', '.join(f'{i} in {p}' for i, p in recorded.items())}); {DOCUMENT_OPTIONS} need one "
                            "end-of-document token: prepare the shards with one tokenizer configuration")
    if recorded:
        return next(iter(recorded))
    if tokenizer.eos_id is None:
        raise ArtifactError(f"{cfg.data.tokenizer}: tokenizer has no eos token and the shards record no eod_id, so "
                            f"{DOCUMENT_OPTIONS} have no end-of-document token; switch them off or use a tokenizer "
                            "with an eos_token")
    return tokenizer.eos_id


TRAINING_ONLY_MODEL_FIELDS = {"dropout", "attention_dropout", "init_std"}


def pad_vocabulary(model: ModelConfig, cfg: TrainConfig, tp: int, saved: ModelConfig | None) -> ModelConfig:
    """The embedding/head rows: model.padded_vocab_size when given; else a checkpoint's (resume,
    init_from) whenever this tensor-parallel size divides them, so checkpoints stay layout-free; else
    Megatron's rule for a new model (ModelConfig.padded_for). A kind without vocabulary padding (no
    padded_for: hybrid) keeps its rows."""
    if "padded_vocab_size" in cfg.model or not hasattr(model, "padded_for"):
        return model
    if saved is not None and saved.vocab_size == model.vocab_size and saved.vocab_rows % tp == 0:
        return model.model_copy(update={"padded_vocab_size": saved.padded_vocab_size})
    return model.padded_for(tp)


def check_init_from(path: Path, model: ModelConfig, tokenizer: Tokenizer) -> Path:
    """The checkpoint directory checkpoint.init_from names, if its model and tokenizer fit this run."""
    directory = resolve_checkpoint(path)  # one-line ArtifactError when missing or incomplete
    sidecar = read_sidecar(directory)
    # Dropout and the init scale are the new run's choices, not properties of the weights.
    ours = model.model_dump(exclude=TRAINING_ONLY_MODEL_FIELDS)
    theirs = sidecar.model.model_dump(exclude=TRAINING_ONLY_MODEL_FIELDS)
    if ours != theirs:
        diff = ", ".join(f"{k} {theirs[k]} vs {ours[k]}" for k in ours if ours[k] != theirs.get(k))
        raise ArtifactError(f"{directory}: checkpoint.init_from holds another model than the config "
                            f"(checkpoint vs config: {diff}); set the model section to the checkpoint's")
    if sidecar.tokenizer_fingerprint not in (None, tokenizer.fingerprint):
        raise ArtifactError(f"{directory}: checkpoint.init_from was trained with another tokenizer than "
                            f"data.tokenizer; prepare the data with the checkpoint's tokenizer "
                            f"({directory / 'tokenizer'} when it was saved with one)")
    return directory


def check_parallel_options(cfg: TrainConfig) -> None:
    """Options of the one-process step that the parallel runtime does not have (one line each)."""
    t = cfg.training
    if t.loss_chunk_tokens is not None:
        raise UserError("training.loss_chunk_tokens is for one process; under torchrun the loss is vocab-parallel "
                        "(use parallel.tensor to split the logits) — set training.loss_chunk_tokens=null")
    if t.compile and t.compile_scope == "model":
        raise UserError("training.compile_scope=model is for one process; under torchrun each transformer block is "
                        "compiled on its own (pipeline stages, FSDP units) — set training.compile_scope=blocks")
