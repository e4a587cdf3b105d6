"""Engine configuration: KV-cache capacity, batching limits, dtype and device.

One typed config drives the engine whether it runs behind the HTTP server or offline
(`tessera-generate`); the CLIs map their flags onto it and it is validated before the model loads.
"""

from __future__ import annotations

import os
from typing import Any, Literal, get_args

from pydantic import Field, model_validator

from tessera.common.config import StrictModel

# --kv-cache-dtype values, vLLM's names (fp8 = fp8_e4m3).
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_CACHE_DTYPE_NAMES: tuple[str, ...] = get_args(KVCacheDtype)
CpuLinear = Literal["onednn", "aten"]  # inference/cpu_linear.py
CPU_LINEAR_BACKENDS: tuple[str, ...] = get_args(CpuLinear)
# The CPU compile default (cpu_compile None) can be switched off for a whole process tree by this
# environment variable, as vLLM's CPU build reads VLLM_CPU_CI_ENV: the test suite sets it (tests/conftest.py),
# since each engine start would compile for tens of seconds. "0": eager, "1": compiled.
CPU_COMPILE_ENV = "TESSERA_CPU_COMPILE"
CPU_COMPILE_DEFAULT = True  # see compiled.py for the measurements behind it


class SpeculativeConfig(StrictModel):
    """Speculative decoding, in the shape of vLLM's `--speculative-config` JSON:
    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}
    or {"model": "<checkpoint or HF dir>", "num_speculative_tokens": k} (method draft_model)."""

    method: Literal["ngram", "draft_model", "mtp"] | None = Field(
        None, description="ngram (prompt lookup, no draft model), draft_model, or mtp (the target's own "
                          "multi-token-prediction modules, DeepSeek-V3); default: draft_model when model is given, "
                          "else ngram.")
    model: str | None = Field(None, description="Draft model: a Tessera checkpoint or HF directory with the "
                                                "target's tokenizer (draft_model only).")
    num_speculative_tokens: int = Field(..., gt=0, le=32, description="Tokens proposed per step (k).")
    prompt_lookup_max: int | None = Field(None, gt=0, description="Longest n-gram matched (ngram; default: "
                                                                  "prompt_lookup_min, else 5).")
    prompt_lookup_min: int | None = Field(None, gt=0, description="Shortest n-gram matched (ngram; default: "
                                                                  "prompt_lookup_max, else 5).")

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        method = self.method or ("draft_model" if self.model is not None else "ngram")
        if method == "mtp":
            if self.model is not None or self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("method mtp drafts with the target's own MTP modules: drop \"model\" and the "
                                 "prompt_lookup fields")
        elif method == "draft_model":
            if self.model is None:
                raise ValueError("method draft_model needs \"model\": the draft checkpoint or HF directory")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("prompt_lookup_max/prompt_lookup_min apply to method ngram only")
        else:
            if self.model is not None:
                raise ValueError("method ngram takes no \"model\"; drop it or use method draft_model")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (lo or hi or 5), (hi or lo or 5)  # vLLM's defaults: the other bound, else 5
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        object.__setattr__(self, "method", method)
        return self


class EngineConfig(StrictModel):
    """How the engine sizes its KV cache and forms batches."""

    block_size: int = Field(16, gt=0, le=1024, description="Tokens per KV-cache block.")
    num_kv_blocks: int | None = Field(None, gt=0, description="Blocks in the KV pool. Overrides kv_cache_memory and kv_cache_tokens.")
    kv_cache_tokens: int | None = Field(None, gt=0, description="KV pool capacity in tokens (rounded up to whole blocks). Overrides kv_cache_memory.")
    kv_cache_memory: int = Field(
        512 * 2**20, gt=0,
        description="Bytes for the KV pool (K and V of every layer) when neither num_kv_blocks nor kv_cache_tokens is set.",
    )
    max_num_batched_tokens: int = Field(512, gt=0, description="Token budget of one engine step (prefill chunks + decodes).")
    max_num_seqs: int = Field(64, gt=0, description="Most sequences running at once.")
    max_model_len: int | None = Field(None, gt=0, description="Longest prompt + completion; defaults to the model's max_seq_len.")
    max_waiting: int = Field(1024, gt=0, description="Requests allowed to wait for a slot; more are refused (HTTP 429).")
    enable_prefix_caching: bool = Field(True, description="Share full KV blocks of identical prompt prefixes between requests.")
    prefix_cache_hash: Literal["builtin", "sha256"] = Field(
        "builtin", description="Key of a cached block: Python's 64-bit hash (fast; two prefixes can collide) or "
                               "SHA-256 (for servers shared by tenants who must not read each other's KV).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights/activations/KV dtype; auto = float32 on CPU, bfloat16 on CUDA."
    )
    quantization: Literal["int8", "fp8"] | None = Field(
        None, description="Quantized Linear weights: int8 weight-only (CPU, CUDA) or fp8 (CUDA, compute capability 8.9+)."
    )
    cpu_linear: CpuLinear = Field(
        "onednn", description="CPU Linear layers: onednn = weights prepacked once for oneDNN's blocked GEMM "
                              "(tessera.inference.worker.cpu_linear; equal to aten's to rounding), aten = F.linear.")
    tensor_parallel: int = Field(
        1, ge=1, le=64, description="Tensor-parallel size: worker processes (one per rank, gloo on CPU, NCCL on GPU) "
                                    "each holding its shard of the weights and of the KV heads; 1 = in the engine.")
    enable_expert_parallel: bool = Field(
        False, description="Under tensor parallel, split each MoE layer's experts over the ranks (E / N whole experts "
                           "each, one all-reduce of the routed output) instead of replicating them on every rank.")
    async_scheduling: bool = Field(
        False, description="Plan and launch each step while the one before it still runs, its input tokens read "
                           "on the device (vLLM's --async-scheduling): the host's scheduling, input building and "
                           "output processing overlap the device's forward instead of following it.")
    device: str = Field("auto", description="Torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:N.")
    seed: int | None = Field(None, description="Seed for requests that bring none (None: fresh OS entropy per request).")
    speculative: SpeculativeConfig | None = Field(
        None, description="Speculative decoding (n-gram prompt lookup or a draft model); None: off.")
    # KV-cache storage and checkpoint trust (issue 18).
    kv_cache_dtype: KVCacheDtype = Field(
        "auto", description="KV-cache storage dtype (vLLM's names): auto = the model dtype; fp8 = fp8_e4m3 "
                            "(float8_e4m3fn) or fp8_e5m2 (float8_e5m2), stored with a per-tensor scale of 1.0 and "
                            "dequantized in attention; a quarter of fp32's bytes per block, half of bf16's.")
    skip_checksum_verify: bool = Field(
        False, description="Skip hashing every checkpoint payload file against the sidecar's checksums at start "
                           "(for trusted large checkpoints); metadata is still read by the restricted unpickler.")
    # The model's generation settings as request defaults (core/generation_defaults.py), as vLLM's flags.
    generation_config: str = Field(
        "auto", description="auto: the model's generation_config.json (an HF dir's, or the one a checkpoint recorded) "
                            "gives the sampling defaults and end ids; vllm: no model sampling defaults (end ids "
                            "still apply); a folder: its generation_config.json instead of the model's.")
    override_generation_config: dict[str, Any] = Field(
        default_factory=dict, description="Sampling defaults over those of generation_config (temperature, top_p, "
                                          "top_k, min_p, repetition_penalty, max_new_tokens).")
    # CUDA graphs for decode steps (cuda_graphs.py).
    enforce_eager: bool = Field(False, description="Run every step eagerly (vLLM's flag): no CUDA graphs on CUDA, "
                                                   "no compiled layer stack on CPU.")
    cpu_compile: bool | None = Field(
        None, description="CPU: run the layer stack compiled by inductor (tessera.inference.worker.compiled; compiled at "
                          "engine start, tens of seconds). None: on, unless enforce_eager, cpu_linear aten, or the environment "
                          f"variable {CPU_COMPILE_ENV}=0 (the test suite's) says off.")
    cuda_graph_sizes: list[int] | None = Field(
        None, description="Decode batch sizes captured as CUDA graphs (a decode batch is padded to the next one; "
                          "larger ones run eagerly); None: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs.")
    padded_decode: bool = Field(
        False, description="Run decode steps through the bucket-padded forward that the graphs replay, without "
                           "capturing (any device; for tests and for telling a capture problem from a padding one).")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode one token per step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if self.cuda_graph_sizes is not None:
            if not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1:
                raise ValueError("cuda_graph_sizes must be positive integers")
            if max(self.cuda_graph_sizes) > self.max_num_seqs:
                raise ValueError(f"cuda_graph_sizes: {max(self.cuda_graph_sizes)} is above max_num_seqs "
                                 f"({self.max_num_seqs}), which no decode batch exceeds; drop it or raise max_num_seqs")
            if self.enforce_eager:
                raise ValueError("cuda_graph_sizes contradicts enforce_eager (no graphs); give one of them")
        if self.padded_decode and self.enforce_eager:
            raise ValueError("padded_decode contradicts enforce_eager; give one of them")
        if self.cpu_compile and self.enforce_eager:
            raise ValueError("cpu_compile contradicts enforce_eager (no compile); give one of them")
        if self.cpu_compile and self.cpu_linear == "aten":
            raise ValueError("cpu_compile packs the Linear weights for oneDNN (inductor's freezing); cpu_linear aten "
                             "is served eagerly: give one of them")
        if self.cpu_compile and (self.quantization is not None or self.tensor_parallel > 1):
            raise ValueError("cpu_compile: quantized weights and tensor-parallel workers are served eagerly; "
                             "drop cpu_compile or --quantization / --tensor-parallel")
        if self.enable_expert_parallel and self.tensor_parallel == 1:
            raise ValueError("enable_expert_parallel splits the experts over the tensor-parallel ranks: set "
                             "tensor_parallel > 1 or drop it")
        if self.async_scheduling and self.speculative is not None:
            raise ValueError("async_scheduling launches a step before the drafts of the one before are known: it "
                             "does not combine with speculative decoding yet; drop one of them")
        env = os.environ.get(CPU_COMPILE_ENV)
        if env not in (None, "0", "1"):
            raise ValueError(f"environment variable {CPU_COMPILE_ENV}={env!r}: use 0 (eager) or 1 (compiled)")
        return self

    @property
    def compile_on_cpu(self) -> bool:
        """Whether a CPU engine compiles its layer stack (cpu_compile resolved)."""
        if self.cpu_compile is not None:
            return self.cpu_compile
        if self.enforce_eager or self.cpu_linear == "aten":  # aten: plain F.linear, which compiling would pack
            return False
        env = os.environ.get(CPU_COMPILE_ENV)
        return CPU_COMPILE_DEFAULT if env is None else env == "1"
