"""Command-line flags shared by tessera-serve and tessera-generate, mapped onto EngineConfig."""

from __future__ import annotations

import argparse
import json
import os
import re

from pydantic import ValidationError

from tessera.common.config import format_validation_error
from tessera.common.errors import UserError
from tessera.inference.config import (
    CPU_LINEAR_BACKENDS,
    KV_CACHE_DTYPE_NAMES,
    EngineConfig,
    SpeculativeConfig,
)
from tessera.inference.core.generation_defaults import MODES, parse_override
from tessera.inference.core.json_depth import JsonTooDeep, loads

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_bytes(text: str) -> int:
    """'536870912', '512MiB', '2GB', '1.5GiB' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 512MiB, 2GB, 1073741824)")
    unit = (m.group(2) or "").upper().removesuffix("B")
    return int(float(m.group(1)) * _UNITS[unit])


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--checkpoint", required=True,
                   help="Tessera checkpoint (run dir, checkpoints dir with pointer, or iter_NNNNNNN dir) "
                        "or Hugging Face export dir (config.json + safetensors + tokenizer.json).")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="Model and KV-cache dtype (auto: float32 on CPU, bfloat16 on CUDA).")
    g.add_argument("--quantization", default=d.quantization, choices=["int8", "fp8"],
                   help="Quantize the Linear weights after loading: int8 weight-only (per-channel scales; CPU and CUDA) "
                        "or fp8 (float8 weights and activations; CUDA GPUs of compute capability 8.9+). "
                        "Default: none, weights in --dtype.")
    g.add_argument("--cpu-linear", default=d.cpu_linear, choices=CPU_LINEAR_BACKENDS,
                   help="On CPU, unquantized Linear layers run on weights prepacked for oneDNN (onednn, the default: "
                        "about 0.7x F.linear's time at decode batch sizes) or through F.linear (aten; served eagerly: "
                        "the compiled CPU layer stack packs its weights for oneDNN).")
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N (default: auto).")
    g.add_argument("--tensor-parallel", "--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel,
                   dest="tensor_parallel", metavar="N",
                   help="Split the model over N worker processes (one per rank: gloo on CPU, NCCL on GPU, worker r "
                        "on cuda:r), each loading only its shard of the weights and holding its share of the "
                        "key/value heads; N must divide the attention heads and vocabulary, and divide the key/value "
                        "heads or be a multiple of them (each then replicated on N / kv_heads workers) "
                        "(default: 1, no workers).")
    g.add_argument("--enable-expert-parallel", "-ep", action="store_true", dest="enable_expert_parallel",
                   help="With --tensor-parallel N: split each mixture-of-experts layer's experts over the N workers "
                        "(E / N whole experts each, their outputs summed by one all-reduce) instead of replicating "
                        "them on every worker; N must divide the number of experts.")
    g.add_argument("--async-scheduling", action="store_true",
                   help="Plan and launch each step while the previous one still runs on the device, its input "
                        "tokens read on the device (vLLM's flag): the host's per-step work (scheduling, inputs, "
                        "detokenizing, outputs) overlaps the forward. A request with a grammar is launched ahead too, "
                        "its rows sampled once the step before has advanced their matchers; a step with a "
                        "request using prompt logprobs is planned as without it. Under --tensor-parallel a step is "
                        "sent with the tokens of the one before, and the driver applies that one while the workers "
                        "run it. Not with --speculative-config, nor for hybrid, "
                        "encoder-decoder or latent-attention models. Outputs are identical (greedy and seeded). "
                        "For CUDA or tensor parallel: on one CPU process nothing overlaps. Default: off.")
    g.add_argument("--block-size", type=int, default=d.block_size, help="Tokens per KV-cache block (default: %(default)s).")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=d.kv_cache_memory,
                   help="Bytes for the KV-cache pool, e.g. 512MiB or 4GB (default: 512MiB).")
    g.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="Size the KV pool in tokens instead of bytes.")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="Size the KV pool in blocks (overrides both above).")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="Token budget per engine step, prefill chunks and decodes together (default: %(default)s).")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="Most sequences in the running batch (default: %(default)s).")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="Longest prompt + completion in tokens (default: the model's max_seq_len).")
    g.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="Requests allowed to queue; more get HTTP 429 (default: %(default)s).")
    g.add_argument("--no-prefix-caching", action="store_true", help="Disable sharing of prompt-prefix KV blocks.")
    g.add_argument("--prefix-cache-hash", default=d.prefix_cache_hash, choices=["builtin", "sha256"],
                   help="Prefix-cache block keys: Python's 64-bit hash (default) or SHA-256 (collision-safe; "
                        "for a server shared by tenants).")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="CPU threads for torch ops in every process, unbound (torch.set_num_threads). Default: "
                        "tessera-serve on CPU leaves a core to the HTTP process and binds one thread to each other "
                        "physical core (vLLM's CPU default; the startup line says what it chose); tessera-generate: "
                        "torch's choice.")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="Speculative decoding, as vLLM's flag: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' (prompt lookup, no draft model) or "
                        "'{\"model\": \"DRAFT_DIR\", \"num_speculative_tokens\": 4}' (a small checkpoint or HF dir with "
                        "the same tokenizer). Outputs are distributed exactly as without it (greedy: identical). "
                        "Default: off.")
    g.add_argument("--seed", type=int, default=None,
                   help="Seed for requests without their own (default: OS entropy, i.e. not reproducible).")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, metavar="{" + ",".join(KV_CACHE_DTYPE_NAMES) + "}",
                   help="KV-cache storage dtype, as vLLM's flag: auto (the model's --dtype), fp8 (= fp8_e4m3: "
                        "float8_e4m3fn) or fp8_e5m2. fp8 stores keys/values with a per-tensor scale of 1.0 and "
                        "dequantizes them in attention; the same --kv-cache-memory then holds 2x the blocks of "
                        "bfloat16 and 4x those of float32. CPU and CUDA (default: %(default)s).")
    g.add_argument("--skip-checksum-verify", action="store_true",
                   help="Do not hash every checkpoint payload file against the sidecar's checksums at start "
                        "(a trusted large checkpoint on fast storage; the log says it was skipped). Metadata is "
                        "still read by the restricted unpickler. Default: verify.")
    g.add_argument("--generation-config", default=d.generation_config, metavar="{auto,vllm,FOLDER}",
                   help="Request defaults from the model's generation_config.json, as vLLM's flag: auto (default) "
                        "takes temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (the default "
                        "max_tokens) from the model's file (an HF dir's own; the one a checkpoint recorded at import) "
                        "for requests that leave them out; vllm ignores them (the model's end ids still apply); a "
                        "FOLDER reads its generation_config.json instead of the model's (end ids included).")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="Sampling defaults over generation_config's, as vLLM's flag, e.g. '{\"temperature\": 0.5, "
                        "\"max_new_tokens\": 128}' (its max_new_tokens also caps every request's max_tokens). "
                        "Fields: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens; any other "
                        "is refused.")
    # CUDA graphs for decode steps (cuda_graphs.py).
    g.add_argument("--enforce-eager", action="store_true",
                   help="Run every step eagerly: no CUDA graphs (default on CUDA: decode steps replay graphs "
                        "captured per batch-size bucket) and no compiled layer stack on CPU (default on CPU: the "
                        "layers run compiled by torch.compile/inductor, compiled at startup, tens of seconds; "
                        "tensor-parallel workers, quantized, mixture-of-experts and dynamic-RoPE models always run "
                        "eagerly).")
    g.add_argument("--cuda-graph-sizes", nargs="+", default=None, metavar="N",
                   help="Decode batch sizes to capture, e.g. '1 2 4 8 16' (each decode batch is padded to the next "
                        "size; larger ones run eagerly). Default: 1 2 4 8 16 24 ... up to --max-num-seqs.")


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """--speculative-config JSON -> SpeculativeConfig, strictly typed: "4" or true is no count (one
    line naming the field when it is wrong)."""
    if text is None:
        return None
    try:
        obj = loads(text)
    except JsonTooDeep as exc:
        raise UserError(f"--speculative-config: {exc}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"--speculative-config: not valid JSON ({exc.msg}); e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'") from None
    if not isinstance(obj, dict):
        raise UserError("--speculative-config: expected a JSON object such as "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
    try:
        return SpeculativeConfig.model_validate(obj, strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        where = f"--speculative-config {loc}" if loc else "--speculative-config"
        raise UserError(f"{where}: {err['msg'].removeprefix('Value error, ')}") from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Validate the engine flags (and apply --torch-threads, a process-wide setting)."""
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            raise UserError(f"--torch-threads {args.torch_threads}: must be >= 1")
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if cpus and args.torch_threads > cpus:  # 10^5 made torch start 10^5 threads: a segfault (exit 139)
            raise UserError(f"--torch-threads {args.torch_threads}: more than the {cpus} CPUs this process may use; "
                            "pass at most that")
        import torch

        torch.set_num_threads(args.torch_threads)
    speculative = parse_speculative_config(args.speculative_config)
    if args.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:  # checked here, not by argparse: one line, no usage
        raise UserError(f"--kv-cache-dtype {args.kv_cache_dtype!r}: not a KV-cache dtype; use one of "
                        f"{', '.join(KV_CACHE_DTYPE_NAMES)}")
    override = parse_override(args.override_generation_config)
    generation_config = args.generation_config
    if generation_config not in MODES:  # a folder: its file read and checked before any model loads
        from tessera.inference.worker.loader import read_generation

        generation_config = os.path.abspath(generation_config)  # the engine process reads it too
        read_generation(args.checkpoint, generation_config)
    sizes = None
    if args.cuda_graph_sizes is not None:
        from tessera.inference.worker.cuda_graphs import parse_capture_sizes

        sizes = parse_capture_sizes(args.cuda_graph_sizes)
    try:
        return EngineConfig(
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_cache_tokens=args.kv_cache_tokens,
            kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, max_waiting=args.max_waiting,
            enable_prefix_caching=not args.no_prefix_caching, prefix_cache_hash=args.prefix_cache_hash, dtype=args.dtype, device=args.device, seed=args.seed,
            quantization=args.quantization, cpu_linear=args.cpu_linear, speculative=speculative, tensor_parallel=args.tensor_parallel,
            enable_expert_parallel=args.enable_expert_parallel, async_scheduling=args.async_scheduling,
            kv_cache_dtype=args.kv_cache_dtype, skip_checksum_verify=args.skip_checksum_verify,
            enforce_eager=args.enforce_eager, cuda_graph_sizes=sizes,
            generation_config=generation_config, override_generation_config=override,
        )
    except ValidationError as exc:
        msg = format_validation_error(exc, "engine flags")
        raise UserError(msg.replace("_", "-")) from None
