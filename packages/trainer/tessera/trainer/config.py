"""TrainConfig: everything a training run needs, typed, documented and validated before any work.

Loaded from YAML with dotted command-line overrides (tessera.common.config.load_config). Shape
checks that need only the config happen here (pydantic validators, so the error names the field);
checks that need the mixture or the world size happen in `tessera.trainer.inputs.check_inputs` before the model
is built.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from tessera.common.config import StrictModel
from tessera.common.errors import UserError
from tessera.common.layout import ParallelLayout, check_expert_parallel
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.registry import kind_of, model_config
from tessera.trainer.kinds import check_options, check_trainable

# Stand-in vocabulary used only to validate the model section before the mixture (which supplies
# the real vocab_size) has been read; no shape check depends on it.
PLACEHOLDER_VOCAB = 1

# Sequences per optimizer step, at most: ~16M, past every published run (the largest batches
# are ~10^5 sequences). The step's sample numbers are one int64 array of that size, so an absurd
# value (10^12 asked for 7 TiB at the first step, a traceback) is refused with the config.
MAX_GLOBAL_BATCH = 2**24


class DataConfig(StrictModel):
    """Where the tokens come from."""

    mixture: Path = Field(..., description="Mixture directory built by `tessera-data blend` (manifest.json + .npy indices).")
    tokenizer: Path = Field(..., description="Tokenizer directory (tokenizer.json); must match the mixture's tokenizer fingerprint. Copied into every checkpoint.")
    train_split: str = Field("train", description="Mixture split to train on.")
    valid_split: str | None = Field("valid", description="Mixture split for evaluation; null disables evaluation.")
    test_split: str | None = Field("test", description="Mixture split evaluated once when training completes (eval_iters global batches, logged as kind test), when evaluation is on (training.eval_interval > 0) and the split has samples; null disables.")
    check_fingerprints: bool = Field(True, description="Verify at start that the shards are the ones the mixture was built from (hashes their small manifests).")
    # Document boundaries inside packed samples (Megatron's flags of the same names); the
    # end-of-document token is the shards' recorded eod_id, else the tokenizer's eos token
    # (inputs.end_of_document_id). See tessera.trainer.objectives.documents.
    reset_position_ids: bool = Field(False, description="Positions restart at 0 on the token after each end-of-document token.")
    reset_attention_mask: bool = Field(False, description="Tokens attend only to earlier tokens of their own document, not across end-of-document tokens.")
    eod_mask_loss: bool = Field(False, description="No loss where the input token is end-of-document; the loss is the mean over the remaining tokens of the global batch.")
    pack_samples: bool = Field(False, description="Vision-language runs: fill each row of training.seq_length with several whole samples (consecutive in the mixture's order, never cut, so never an image), each with positions from 0 and attention within itself, instead of one sample per row and padding. A row is then what global_batch_size counts. Text mixtures are packed already (their windows; see reset_position_ids / reset_attention_mask).")

    @property
    def document_options(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss


class OptimConfig(StrictModel):
    """AdamW with Megatron-style weight-decay groups (no decay on biases and norm weights)."""

    lr: float = Field(3e-4, gt=0, description="Peak learning rate (reached at the end of warmup).")
    min_lr: float = Field(3e-5, ge=0, description="Floor the decay phase ends at (cosine, linear, wsd).")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay on matrices and embeddings; biases and norms get none.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient L2 norm to this; 0 disables clipping (the norm is still logged).")
    impl: Literal["auto", "fused", "foreach", "for-loop"] = Field(
        "auto", description="AdamW implementation: fused kernel, multi-tensor foreach, or per-parameter loop; auto picks fused when supported.")

    @field_validator("lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class ScheduleConfig(StrictModel):
    """Learning rate: linear warmup (lr / warmup_steps, 2 lr / warmup_steps, ... lr), then the chosen decay to min_lr."""

    kind: Literal["cosine", "linear", "constant", "wsd"] = Field("cosine", description="Decay after warmup: cosine or linear to min_lr over the remaining steps; constant at lr; wsd = warmup-stable-decay (constant, then linear decay over the last decay_fraction of steps).")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warmup to lr: step i (0-based) uses lr * (i + 1) / warmup_steps.")
    decay_steps: int | None = Field(None, gt=0, description="Steps (from the end of warmup) over which cosine/linear decay to min_lr; default: the rest of training.")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd only: fraction of all steps spent in the final linear decay.")


class TrainingConfig(StrictModel):
    """Batch shape, length of the run, precision and speed options, intervals."""

    global_batch_size: int = Field(8, gt=0, le=MAX_GLOBAL_BATCH, description="Sequences per optimizer step, over all data-parallel ranks (at most 2^24).")
    micro_batch_size: int = Field(4, gt=0, description="Sequences per forward/backward; global / (micro x data-parallel) micro-batches are accumulated.")
    seq_length: int = Field(128, gt=0, description="Tokens per training sequence; at most the mixture's seq_length and the model's max_seq_len.")
    rampup_batch_size: tuple[int, int, int] | None = Field(None, description="Megatron's --rampup-batch-size [start, increment, samples]: the global batch starts at `start` sequences and grows by `increment` at even intervals over the first `samples` consumed samples, up to global_batch_size (tessera.trainer.objectives.batches.global_batch_size_at). Every size must be a multiple of micro_batch_size x data-parallel size.")
    steps: int = Field(100, gt=0, description="Optimizer steps to train (the run ends when the step counter reaches this).")
    seed: int = Field(1234, description="Seed for weight init and every RNG (python, numpy, torch).")
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = Field("fp32", description="fp32; bf16 = autocast on fp32 master weights and fp32 grads; fp16 = autocast with dynamic loss scaling (overflowing steps are skipped and logged); fp8 = bf16 with the linear layers' matmuls in float8 through torchao or Transformer Engine (fp8_backend; GPUs of compute capability 8.9+; under parallel.tensor > 1 the tensor-parallel layers keep their collectives and cast with global scales; tessera.trainer.components.precision.torchao_float8).")
    fp8_recipe: Literal["tensorwise", "rowwise", "blockwise", "mxfp8"] = Field("tensorwise", description="fp8 only: the scaling. tensorwise = one scale per tensor from its current amax (fastest; both backends: torchao's tensorwise, TE's Float8CurrentScaling); rowwise = one per row (robust to outliers; torchao only); blockwise = 1x128 activation/gradient and 128x128 weight blocks (TE's Float8BlockScaling, compute capability 9.0+); mxfp8 = one scale per 32 values (TE's MXFP8BlockScaling, Blackwell). A recipe the backend lacks is refused.")
    fp8_backend: Literal["torchao", "te"] = Field("torchao", description="fp8 only: torchao = torchao Float8Linear (the default; composes with compile, recompute and every parallel layout; tessera.trainer.components.precision.torchao_float8); te = NVIDIA Transformer Engine's Linear under its FP8 autocast (optional: pip install 'tessera-trainer[te]' on a CUDA machine; one process, training.compile=false, recompute none or selective; tessera.trainer.components.precision.te_float8). Checkpoints are the same under both.")
    fp16_initial_scale: float = Field(2.0**16, gt=0, description="fp16 only: starting loss scale.")
    fp16_growth_interval: int = Field(1000, gt=0, description="fp16 only: steps without overflow before the loss scale doubles.")
    recompute: Literal["none", "selective", "full"] = Field("none", description="Activation recompute: none; selective = attention core; full = every transformer block.")
    freeze: list[Literal["vision", "projector", "language_model"]] = Field(default_factory=list, description="Vision-language models only: parts whose weights do not train (requires_grad off before the optimizer is built, so they get no gradients, no optimizer state and never change). LLaVA's stage 1 = [vision, language_model] (the projector alone trains); stage 2 = [vision] (projector and language model).")
    loss_chunk_tokens: int | None = Field(None, gt=0, description="Compute the output head and cross-entropy this many tokens at a time, their gradients in the same pass, so full-vocabulary logits never exist at once (nothing is recomputed); null = in one piece. For large vocabularies.")
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = Field("auto", description="The kernel PyTorch's scaled_dot_product_attention runs in training and evaluation (Megatron's --attention-backend): auto = PyTorch's own priority; flash = FlashAttention-2 (CUDA sm80+, or SDPA's CPU flash kernel); cudnn = cuDNN's fused attention (CUDA); efficient = the memory-efficient kernel (CUDA); math = the unfused reference. Only the named kernel is enabled, so a call it cannot take stops the first step with a one-line error rather than falling back to a slower one. FlexAttention (packed documents, sliding windows on CUDA) is not affected (tessera.common.layers.sdpa_backend).")
    compile: bool = Field(False, description="torch.compile the step (compile_scope says what is one graph; compile time is logged separately from step time).")
    compile_scope: Literal["blocks", "model"] = Field("blocks", description="With compile: blocks = regional compilation (torchtitan's): each transformer block compiled in place, blocks of one kind sharing one compiled graph so compile time does not grow with depth, and the output head with the loss as one graph; model = the model forward and the loss as one graph (inductor sees across blocks; compile time grows with depth). Parallel layouts compile per block (model is refused there). The masked-LM and span objectives take both scopes (blocks: their blocks per kind, and the head with its loss as one graph).")
    retain_host_memory: bool = Field(True, description="CPU only: keep freed memory in the process (glibc malloc without mmap or trimming) so each step reuses mapped pages instead of page-faulting new ones; resident memory stays at its peak.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu.")
    threads: int | None = Field(None, gt=0, description="torch intra-op threads on CPU (default: torch's choice); at most the CPUs this process may use.")
    log_interval: int = Field(1, gt=0, description="Log a metrics line every N steps.")
    eval_interval: int = Field(0, ge=0, description="Evaluate on the valid split every N steps (and at the end); 0 disables.")
    eval_iters: int = Field(4, gt=0, description="Global batches per evaluation (Megatron's --eval-iters): always the first eval_iters x global_batch_size samples of the valid split, whatever the parallel layout, so evaluations compare.")
    eval_only: bool = Field(False, description="Evaluate and exit (= --eval-only; Megatron's --skip-train): load the model (the checkpoint --resume finds, else checkpoint.init_from, else a fresh init), log the loss on eval_iters global batches of the valid split and of the test split (those with samples), train and save nothing. E.g. the validation perplexity of an imported Hugging Face model on your data.")
    exit_after_steps: int | None = Field(None, gt=0, description="Stop after this many steps in this invocation (saving first, exit 0), e.g. to fit a fixed-length job slot; `--resume` continues. The schedule still spans training.steps.")
    step_timeout_minutes: float | None = Field(None, gt=0, description="Watchdog: a rank that makes no progress for this long (a step, an evaluation or a save; armed after the first step) prints the Python stack of every thread and exits 1, so a hung rank shows where it hangs within the timeout instead of the process group's (10 minutes by default, silent); under torchrun --max-restarts the job then restarts from its last checkpoint. Null: off.")
    exit_after_minutes: float | None = Field(None, gt=0, description="Stop at the first step that ends this many minutes after the trainer started (saving first, exit 0; every rank stops at the same step), e.g. to fit a job's time limit with room for the save; `--resume` continues (Megatron's --exit-duration-in-mins).")
    save_interval: int = Field(0, ge=0, description="Save a checkpoint every N steps; one is always saved at the end. 0 = only at the end.")
    check_nonfinite: bool = Field(True, description="Stop with a one-line error (exit 1) at the first step whose loss or gradient norm is inf/nan, saving nothing, so the newest checkpoint stays the last good one (Megatron's --check-for-nan-in-loss-and-grad). fp32/bf16; fp16 skips such steps by its loss scaling instead.")
    peak_tflops: float | None = Field(None, gt=0, description="Peak TFLOP/s for MFU; default: table of known GPUs, or a matmul measured at start on CPU.")


    @model_validator(mode="after")
    def _check_fp8_backend(self) -> TrainingConfig:
        """The rest of what a float8 backend needs is its own check (tessera.trainer.components.precision.float8),
        run by check_inputs before any work."""
        if self.fp8_backend == "te" and self.precision != "fp8":
            raise ValueError(f"training.fp8_backend=te is for training.precision=fp8 (this run is "
                             f"{self.precision}); set precision fp8 or drop fp8_backend")
        return self


class ParallelConfig(StrictModel):
    """The parallel layout and the options of the runtime that runs it. Data parallel is implied:
    world size / (tensor x context x expert x pipeline).

    Any layout other than one plain process runs the step through
    tessera.trainer.parallel.runtime.ParallelRuntime, which takes this section as it is (see
    docs/parallelism.md).
    """

    tensor: int = Field(1, ge=1, description="Tensor-parallel size (= --tensor-parallel); must divide heads, kv heads, ffn size and vocab.")
    pipeline: int = Field(1, ge=1, description="Pipeline-parallel stages across ranks (= --pipeline-parallel); 1F1B schedule.")
    context: int = Field(1, ge=1, description="Context-parallel size (= --context-parallel): the sequence split into 2 x context chunks, rank i holding chunks i and 2C-1-i; attention all-gathers keys/values. 2 x context must divide data.seq_len.")
    expert: int = Field(1, ge=1, description="Expert-parallel size (= --expert-parallel): each MoE layer's experts split over this many ranks (num_experts / expert each, tokens sent to their expert's rank and back by all-to-all); must divide model.moe.num_experts. Expert ranks read their own rows of the batch, as data ranks do (global batch: a multiple of micro batch x data x expert). Experts are not split over tensor ranks.")
    virtual_stages: int = Field(1, ge=1, description="Model chunks per pipeline rank (= --virtual-stages); above 1 selects interleaved 1F1B.")
    pipeline_layers: list[int] | None = Field(None, description="Layers per pipeline stage in stage order, pipeline x virtual_stages values (= --pipeline-layers 5,4,4,3); null = automatic (extra layers to the middle stages).")
    sequence_parallel: bool = Field(True, description="With tensor > 1: split norms/dropout along the sequence across tensor ranks (all-gather/reduce-scatter instead of all-reduce).")
    distributed_optimizer: bool = Field(True, description="With data parallel: shard AdamW state (ZeRO-1) across data-parallel ranks with reduce-scatter/all-gather; false = all-reduce, full state per rank.")
    bucket_numel: int = Field(40_000_000, gt=0, description="Elements per gradient bucket (one data-parallel collective each, overlapped with backward).")
    data_shard: int = Field(1, ge=1, description="Fully sharded data parallel (= --data-shard): data-parallel ranks sharding parameters, gradients and optimizer state (FSDP2 fully_shard); must divide the data-parallel size, whose quotient is the number of HSDP replicas. 1 = off.")
    fsdp_param_dtype: Literal["float32", "bfloat16"] = Field("float32", description="With data_shard > 1: dtype of the all-gathered compute parameters; bfloat16 = bf16 parameters over fp32 sharded master weights.")
    fsdp_reduce_dtype: Literal["float32", "bfloat16"] = Field("float32", description="With data_shard > 1: dtype of the gradient reduction.")
    fsdp_cpu_offload: bool = Field(False, description="With data_shard > 1, GPU runs: sharded parameters, gradients and optimizer state in host memory (AdamW steps on the CPU).")
    fsdp_float8_all_gather: bool = Field(False, description="training.precision=fp8 with data_shard > 1 (GPUs, NCCL): FSDP all-gathers the Float8Linear weights in float8 (half bf16's bytes) with one scale per weight, all scales computed in one all-reduce after each optimizer step (torchao's enable_fsdp_float8_all_gather); fp8_recipe tensorwise only; not with tensor > 1.")
    overlap_grad_reduce: bool = Field(True, description="Launch each gradient bucket's data-parallel reduction from the backward hooks as soon as its gradients are complete, in bucket (reverse layer) order, overlapping backward (Megatron's --overlap-grad-reduce); false = every bucket after backward. Exact either way. Not with data_shard > 1 (FSDP overlaps on its own).")
    overlap_param_gather: bool = Field(False, description="Distributed optimizer: leave the parameter all-gathers in flight after the step and wait per bucket in a forward pre-hook of the modules using it, overlapping the next forward (Megatron's --overlap-param-gather). Exact. Needs distributed_optimizer and data_shard = 1.")
    async_tp: bool = Field(False, description="CUDA/NCCL only: inductor's micro-pipelined tensor parallel (async-TP, symmetric memory), overlapping the sequence-parallel all-gather/reduce-scatter with the block's matmuls. Needs tensor > 1, sequence_parallel and training.compile; refused on CPU/gloo (nothing to overlap there).")

    @model_validator(mode="after")
    def _check_overlap(self) -> ParallelConfig:
        if self.overlap_param_gather and (not self.distributed_optimizer or self.data_shard > 1):
            raise ValueError("parallel.overlap_param_gather needs parallel.distributed_optimizer=true and "
                             "parallel.data_shard=1 (it overlaps the distributed optimizer's all-gather)")
        if not self.overlap_grad_reduce and self.data_shard > 1:
            raise ValueError("parallel.overlap_grad_reduce=false is not supported with parallel.data_shard > 1 "
                             "(FSDP schedules its own reductions); drop it")
        if self.async_tp and (self.tensor == 1 or not self.sequence_parallel):
            raise ValueError("parallel.async_tp needs parallel.tensor > 1 and parallel.sequence_parallel=true")
        return self

    @property
    def model_parallel_size(self) -> int:
        return self.tensor * self.context * self.expert * self.pipeline

    def layout(self, world_size: int) -> ParallelLayout:
        """The full layout on `world_size` processes; UserError when it does not divide."""
        if world_size % self.model_parallel_size:
            raise UserError(f"parallel.tensor ({self.tensor}) x parallel.context ({self.context}) x parallel.expert "
                            f"({self.expert}) x parallel.pipeline ({self.pipeline}) = "
                            f"{self.model_parallel_size} does not divide the {world_size} launched process(es); "
                            f"launch a multiple of {self.model_parallel_size} (torchrun --nproc-per-node)")
        return ParallelLayout(tensor=self.tensor, context=self.context, expert=self.expert, pipeline=self.pipeline,
                              virtual_stages=self.virtual_stages,
                              data=world_size // self.model_parallel_size, data_shard=self.data_shard,
                              pipeline_layers=self.pipeline_layers)


class CheckpointConfig(StrictModel):
    dir: Path | None = Field(None, description="Checkpoints root (iter_NNNNNNN/ + pointer); default <run_dir>/checkpoints.")
    keep_last: int = Field(2, ge=1, description="Keep this many newest checkpoints; older ones are deleted after a save completes.")
    async_save: bool = Field(False, description="Write the periodic checkpoints (save_interval) in the background: training waits only while DCP copies the state into CPU memory, a thread writes and finalizes it (same files and crash safety; at most one in flight). The final save and a save on SIGTERM/SIGINT or exit_after_* stay synchronous. Costs CPU memory for one copy of model + optimizer state (Megatron's --async-save).")
    verify_on_load: bool = Field(True, description="Before --resume or init_from reads a checkpoint, check every payload file against the sidecar's checksums (the ranks split the files; XXH3 on threads; the time is printed). A corrupt checkpoint is refused with one line, exit 2, instead of training on flipped bytes.")
    init_from: Path | None = Field(None, description="Start a new run from the model weights of this checkpoint (an iter_N directory, a checkpoints directory with a pointer, or a run directory; any parallel layout; e.g. from `tessera-ckpt import`): step 0, fresh optimizer, this config's schedule and data. The model section must match the checkpoint's. Once this run has a checkpoint of its own, --resume continues from that instead (Megatron's --finetune with --load; torchtitan's initial_load_path).")


class WandbConfig(StrictModel):
    """Weights & Biases (the trainer's `trackers` extra)."""

    project: str = Field(description="W&B project name.")
    name: str | None = Field(None, description="Run name; default W&B's.")
    mode: Literal["offline", "online"] = Field("offline", description="offline (default): write under <run_dir>/wandb, upload later with `wandb sync`; online needs the network and a login.")


class MlflowConfig(StrictModel):
    """MLflow (the trainer's `trackers` extra)."""

    tracking_uri: str | None = Field(None, description="Tracking store; default a local file store at <run_dir>/mlruns.")
    experiment: str = Field("tessera", description="Experiment name (created when missing).")
    run_name: str | None = Field(None, description="Run name; default MLflow's.")


class LoggingConfig(StrictModel):
    jsonl: bool = Field(True, description="Write metrics.jsonl (one JSON object per logged step / evaluation) in the run directory.")
    tensorboard: bool = Field(True, description="Write TensorBoard scalars under <run_dir>/tensorboard (when tensorboard is not installed: one notice, then skipped).")
    wandb: WandbConfig | None = Field(None, description="Also log to Weights & Biases (e.g. logging.wandb.project=NAME); offline by default.")
    mlflow: MlflowConfig | None = Field(None, description="Also log to MLflow (e.g. logging.mlflow.experiment=NAME); a local file store under the run directory by default.")
    params_norm: bool = Field(False, description="Also log the global L2 norm of the parameters at each log step (Megatron's --log-params-norm): one extra pass over the weights, collective under torchrun.")


class ProfilingConfig(StrictModel):
    """torch.profiler traces of a window of steps (Megatron's --profile-step-start/end, torchtitan's [profiling])."""

    start_step: int | None = Field(None, ge=1, description="First step to profile (numbered as logged: 1 = the first step); null = no profiling. Skip the first step under compile (it compiles).")
    num_steps: int = Field(2, ge=1, description="Steps in the profiled window.")
    ranks: list[int] | None = Field([0], description="Global ranks that profile and write traces; null = every rank.")
    record_shapes: bool = Field(True, description="Record operator input shapes (op table grouped by shape as well).")
    profile_memory: bool = Field(False, description="Record tensor allocations and frees (memory timeline in the trace).")
    with_stack: bool = Field(False, description="Record Python stacks per operator (larger traces, slower profiled steps).")
    memory_snapshot: bool = Field(False, description="CUDA only: also record the caching allocator's history over the window and write rank<r>.memory_snapshot.pickle (drag into pytorch.org/memory_viz); ignored, with a note, on CPU.")
    dir: Path | None = Field(None, description="Trace folder; default <run_dir>/profile. Each window writes steps_<first>-<last>/rank<r>.trace.json.gz (Chrome trace: Perfetto or chrome://tracing) and rank<r>.ops.txt (operators by self time).")


def vocab_section(model: dict[str, Any]) -> dict[str, Any]:
    """The model section's part that holds vocab_size: a vision-language model's language model
    (`text`), else the section itself."""
    text = model.get("text")
    return text if model.get("kind") == "vision_language" and isinstance(text, dict) else model


def with_vocab(model: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """A copy of the model section with vocab_size set where its kind keeps it, unless given."""
    out = dict(model)
    if vocab_section(model) is not model:
        out["text"] = {"vocab_size": vocab_size, **model["text"]}
    else:
        out.setdefault("vocab_size", vocab_size)
    return out


class MLMConfig(StrictModel):
    """The `mlm` section (encoder models): how BERT samples are cut and masked (Megatron's
    --mask-prob, --short-seq-prob and its BERT dataset's masking settings). The binary head is the
    model's (model.binary_head): with it, samples carry the sentence-order target."""

    mask_prob: float = Field(0.15, gt=0, lt=1, description="Share of each sample's tokens that are predicted (Megatron's --mask-prob): 80% of them replaced by [MASK], 10% by a random token, 10% kept.")
    whole_word: bool = Field(True, description="Mask whole words: a WordPiece continuation (##…) is masked with the word it belongs to.")
    max_ngram: int = Field(3, ge=1, le=10, description="Masks are n-grams of up to this many words, n drawn with probability proportional to 1/n (Megatron's BERT: 3; 1 = single words, as Google's BERT).")
    binary_target: Literal["sentence_order", "next_sentence"] = Field("sentence_order", description="What the model's binary head predicts: sentence_order = whether A and B were swapped (Megatron's BERT, ALBERT); next_sentence = whether B comes from another document (Google's BERT, transformers' BertForPreTraining).")
    short_seq_prob: float = Field(0.1, ge=0, le=1, description="Probability that a sample is cut to a random shorter target length (Megatron's --short-seq-prob).")


class SpanConfig(StrictModel):
    """The `span` section (encoder-decoder models): how T5 samples are corrupted (T5's span
    corruption) and the decoder's length. The encoder's input length is training.seq_length
    (Megatron's --encoder-seq-length is its --seq-length; its --decoder-seq-length is
    `decoder_seq_length`)."""

    noise_density: float = Field(0.15, gt=0, lt=1, description="Share of each sample's tokens that are corrupted (masked into spans and predicted by the decoder).")
    mean_span_length: float = Field(3.0, ge=1, description="Mean length of a corrupted span, in tokens; the sample's noise tokens are cut into round(noise / mean) spans.")
    decoder_seq_length: int = Field(128, gt=0, le=2**20, description="Decoder length: the target (sentinels, corrupted spans, EOS) padded to it (Megatron's --decoder-seq-length; T5: 114 for an encoder of 512).")


class TrainConfig(StrictModel):
    """A complete `tessera-train` run."""

    run_dir: Path = Field(Path("runs/default"), description="Run directory: metrics.jsonl, tensorboard/, config.yaml, checkpoints/.")
    model: dict[str, Any] = Field(
        default_factory=lambda: {"preset": "tiny"},
        description="Model: `preset: NAME` and/or any ModelConfig field (see docs); vocab_size defaults to the mixture's.")
    data: DataConfig = Field(..., description="Mixture and tokenizer.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="Learning-rate schedule.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Loop settings.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Parallel layout.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metric sinks.")
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig, description="Profiler traces of chosen steps.")
    mlm: MLMConfig = Field(default_factory=MLMConfig, description="Masked-LM samples (encoder models): masking and sample lengths.")
    span: SpanConfig = Field(default_factory=SpanConfig, description="Span corruption (encoder-decoder models): noise density and mean span length.")

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: dict[str, Any]) -> dict[str, Any]:
        probe = with_vocab(value, PLACEHOLDER_VOCAB)
        try:
            model_config(probe)  # as its kind's config; an unregistered kind is refused by name
            check_trainable(probe)  # and one this trainer has no batches or loss for
        except UserError as exc:
            raise ValueError(str(exc)) from None
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"{loc + ': ' if loc else ''}{err['msg'].removeprefix('Value error, ')}") from None
        return value

    @model_validator(mode="after")
    def _check_shapes(self) -> TrainConfig:
        t = self.training
        if t.global_batch_size % t.micro_batch_size:
            raise ValueError(f"training.micro_batch_size ({t.micro_batch_size}) must divide "
                             f"training.global_batch_size ({t.global_batch_size})")
        if t.rampup_batch_size is not None:
            start, increment, samples = t.rampup_batch_size
            if min(start, increment, samples) <= 0 or start >= t.global_batch_size:
                raise ValueError(f"training.rampup_batch_size {list(t.rampup_batch_size)}: start, increment and "
                                 f"samples must be positive and start below global_batch_size ({t.global_batch_size})")
            if (t.global_batch_size - start) % increment:
                raise ValueError(f"training.rampup_batch_size {list(t.rampup_batch_size)}: global_batch_size "
                                 f"({t.global_batch_size}) minus start must be a multiple of the increment")
        if self.parallel.async_tp and not t.compile:  # inductor does the overlap: refused before any launch
            raise ValueError("parallel.async_tp needs training.compile=true (inductor's micro-pipeline TP pass)")
        p = self.parallel
        # fsdp_float8_all_gather: torchao gathers float8 weights of Float8Linear only (not of ZeRO-1's flat
        # buffers nor of the tensor-parallel layers), and a rowwise scale needs whole rows.
        if p.fsdp_float8_all_gather and (t.precision != "fp8" or p.data_shard == 1 or t.fp8_recipe != "tensorwise"):
            raise ValueError("parallel.fsdp_float8_all_gather needs training.precision=fp8, training.fp8_recipe="
                             "tensorwise and parallel.data_shard > 1 (under torchrun); unset it")
        if p.fsdp_float8_all_gather and p.tensor > 1:
            raise ValueError("parallel.fsdp_float8_all_gather does not compose with parallel.tensor > 1 (torchao's "
                             "float8 weights are for Float8Linear, not Tessera's tensor-parallel layers); unset it")
        model = self.resolve_model(PLACEHOLDER_VOCAB)
        if t.freeze and kind_of(model).name != "vision_language":
            raise ValueError(f"training.freeze ({t.freeze}) names parts of a vision-language model; model kind "
                             f"{kind_of(model).name!r} has none: remove it")
        if self.data.pack_samples and kind_of(model).name != "vision_language":
            raise ValueError(f"data.pack_samples packs vision-language samples; model kind {kind_of(model).name!r} has "
                             "none (a text mixture's windows are packed already): remove it")
        if set(t.freeze) == {"vision", "projector", "language_model"}:
            raise ValueError("training.freeze names every part of the model: nothing would train")
        max_seq = model.max_seq_len
        if t.seq_length > max_seq:
            raise ValueError(f"training.seq_length ({t.seq_length}) exceeds model.max_seq_len ({max_seq})")
        try:  # the layer split needs only the model's depth: checked now, by the one rule in tessera.common.layout
            check_options(model, self)
            layout = self.parallel.layout(self.parallel.model_parallel_size)
            layout.stage_layers(model.num_layers)
            check_expert_parallel(model, layout)  # needs only model.moe: refused before any launch
        except UserError as exc:
            raise ValueError(str(exc)) from None
        prof = self.profiling
        if prof.start_step is not None and prof.start_step > t.steps:
            raise ValueError(f"profiling.start_step ({prof.start_step}) is after the last step (training.steps = "
                             f"{t.steps}); lower it or set it to null")
        if prof.ranks is not None and any(r < 0 for r in prof.ranks):
            raise ValueError(f"profiling.ranks ({prof.ranks}) must be global ranks (0 or more) or null for every rank")
        if self.optim.min_lr > self.optim.lr:
            raise ValueError(f"optim.min_lr ({self.optim.min_lr}) exceeds optim.lr ({self.optim.lr})")
        return self

    def resolve_model(self, vocab_size: int | None = None) -> ModelConfig:
        """The ModelConfig, with vocab_size from the config or else `vocab_size` (the mixture's)."""
        if vocab_size is None and "vocab_size" not in vocab_section(self.model):
            raise ValueError("model.vocab_size unknown: give it or read it from the mixture")
        return model_config(with_vocab(self.model, vocab_size) if vocab_size is not None else dict(self.model))

    @property
    def checkpoint_dir(self) -> Path:
        return self.checkpoint.dir if self.checkpoint.dir is not None else self.run_dir / "checkpoints"

    @property
    def profile_dir(self) -> Path:
        return self.profiling.dir if self.profiling.dir is not None else self.run_dir / "profile"
