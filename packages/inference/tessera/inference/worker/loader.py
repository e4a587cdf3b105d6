"""Load what the server serves: a Tessera checkpoint or a Hugging Face export, plus its tokenizer."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.common.checkpoint import (
    SIDECAR,
    check_checkpoint,
    checkpoint_tokenizer_dir,
    load_model_tensors,
    read_sidecar,
    resolve_checkpoint,
    verify_checksums,
)
from tessera.common.errors import ArtifactError, UserError
from tessera.common.hf.directory import (
    CONFIG,
    checked_hf_weights,
    eos_token_ids,
    imported_tensors,
    is_hf_directory,
    read_hf_config,
)
from tessera.common.hf.generation import (
    GENERATION_CONFIG,
    GenerationSettings,
    for_serving,
    read_generation_config,
)
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.model import Transformer
from tessera.common.models.registry import kind_of
from tessera.common.tokenizer import Tokenizer, check_tokenizer_fits, load_tokenizer
from tessera.inference.worker.kinds import serving_kind
from tessera.inference.worker.kv_cache import kv_cache_dtype as kv_cache_dtype_of
from tessera.inference.worker.pooling.spec import PoolingSpec, read_pooling_spec
from tessera.inference.worker.quantization import check_quantization, quantize_model

log = logging.getLogger("tessera.inference")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Transformer | None  # None under tensor parallel: the workers load their shards
    config: ModelConfig
    tokenizer: Tokenizer
    name: str  # served model id (/v1/models)
    eos_ids: list[int]  # every id that ends generation unless ignore_eos
    path: Path | None = None  # the resolved checkpoint iteration dir or HF dir the weights come from
    hf: bool = False  # path is an HF directory
    pooling: PoolingSpec | None = None  # the pooling its sentence-transformers files declare (embeddings)
    generation: GenerationSettings | None = None  # its generation settings (--generation-config's choice)
    generation_source: str = ""  # the file they came from (the startup log names it)


def read_generation(path: str | os.PathLike, mode: str = "auto") -> tuple[GenerationSettings | None, str]:
    """(the generation settings serving `path` uses, the file they come from): an HF directory's
    generation_config.json, a checkpoint's sidecar record, or under --generation-config FOLDER that
    folder's generation_config.json (refused in one line when it has none). No weight is read."""
    if mode not in ("auto", "vllm"):
        folder = Path(mode)
        if not (folder / GENERATION_CONFIG).is_file():
            raise UserError(f"--generation-config {mode}: no {GENERATION_CONFIG} in that folder; pass a folder "
                            "holding one, auto (the model's) or vllm (none)")
        return _served(folder, mode), str(folder / GENERATION_CONFIG)
    path = Path(path)
    if path.is_dir() and is_hf_directory(path) and not (path / SIDECAR).is_file():
        return _served(path, mode), str(path / GENERATION_CONFIG)
    ckpt = resolve_checkpoint(path)
    return read_sidecar(ckpt).generation, f"{ckpt / SIDECAR} (generation)"


def _served(directory: Path, mode: str) -> GenerationSettings | None:
    """`directory`'s generation_config.json as served under `mode` (odd values: for_serving)."""
    return for_serving(read_generation_config(directory, log.warning), mode, str(directory / GENERATION_CONFIG),
                       log.warning)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device!r}: not a torch device (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def check_tensor_parallel(tp: int, cfg: ModelConfig | None, where: str, quantization: str | None = None,
                          device: torch.device | None = None) -> None:
    """Refuse a tensor-parallel size the model or the machine cannot be split by (one line, before
    any weight loads or worker starts). On CUDA worker r runs on cuda:r."""
    if tp == 1:
        return
    if device is not None and device.type == "cuda":
        if device.index not in (None, 0):
            raise UserError(f"--device {device} with --tensor-parallel {tp}: the workers take cuda:0..cuda:{tp - 1}; "
                            "pass --device cuda (select GPUs with CUDA_VISIBLE_DEVICES)")
        if tp > torch.cuda.device_count():
            raise UserError(f"--tensor-parallel {tp}: this machine has {torch.cuda.device_count()} CUDA devices; "
                            "use at most that many ranks")
    if quantization is not None:
        raise UserError(f"--quantization {quantization} with --tensor-parallel {tp}: not supported; "
                        "serve quantized weights with --tensor-parallel 1 or drop --quantization")
    if cfg is None:  # the machine and flags only (check_kind_tensor_parallel)
        return
    kv = cfg.kv_heads
    if kv < tp and tp % kv:
        raise UserError(f"--tensor-parallel {tp}: {where} has {kv} key/value heads; a tensor-parallel size above "
                        f"them must be a multiple of them (each head is then replicated on tp / {kv} ranks); use "
                        f"a divisor or a multiple of {kv}")
    if kv >= tp and kv % tp:
        raise UserError(f"--tensor-parallel {tp}: must divide the {kv} key/value heads of {where} (or be a multiple "
                        f"of them); use a tensor-parallel size that divides them")
    for what, n in (("attention heads", cfg.num_heads), ("vocabulary rows", cfg.vocab_rows)):
        if n % tp:
            raise UserError(f"--tensor-parallel {tp}: must divide the {n} {what} of {where}; use a "
                            f"tensor-parallel size that divides it")
    dense = cfg.moe is None or any(not cfg.moe.is_moe_layer(i) for i in range(cfg.num_layers))
    if dense and cfg.ffn_hidden_size % tp:  # MoE MLPs are not split over tensor ranks (replicated)
        raise UserError(f"--tensor-parallel {tp}: must divide the MLP width ({cfg.ffn_hidden_size}) of {where}")


def check_expert_parallel(tp: int, cfg, where: str) -> None:
    """Refuse --enable-expert-parallel (one line, before any worker starts) where there are no experts
    to split or the ranks cannot split them evenly."""
    moe = getattr(cfg, "moe", None) or getattr(getattr(cfg, "text", None), "moe", None)  # a VLM's: its LM's
    if moe is None:
        raise UserError(f"--enable-expert-parallel: {where} has no mixture-of-experts layers; drop the flag")
    if moe.num_experts % tp:
        raise UserError(f"--enable-expert-parallel with --tensor-parallel {tp}: must divide the {moe.num_experts} "
                        f"experts of {where}; use a tensor-parallel size that divides them or drop the flag")


def check_kind_tensor_parallel(tp: int, cfg, where: str, quantization: str | None = None,
                               device: torch.device | None = None) -> None:
    """check_tensor_parallel for a kind other than the causal LM: the machine and flags as there,
    then the kind's parallel plan (refused in one line where it has none) and what its serving
    runner's plan splits (`ServingKind.tensor_parallel_problem`)."""
    check_tensor_parallel(tp, None, where, quantization, device)
    kind_of(cfg).parallel()
    check = serving_kind(cfg).tensor_parallel_problem
    if check is None:
        raise UserError(f"--tensor-parallel {tp}: model kind {kind_of(cfg).name!r} is served on one process only "
                        f"({where}); drop --tensor-parallel")
    problem = check(tp, cfg)
    if problem is not None:
        raise UserError(f"--tensor-parallel {tp}: {problem} of {where}; use a tensor-parallel size that divides it")


def load_for_serving(path: str | os.PathLike, device: torch.device, dtype: torch.dtype,
                     quantization: str | None = None, tensor_parallel: int = 1, *, kv_cache_dtype: str = "auto",
                     skip_checksum_verify: bool = False, generation_config: str = "auto") -> LoadedModel:
    """Accepts a checkpoint (iteration dir, checkpoints dir with pointer, or run dir) or an HF export dir.

    With `quantization` ("int8", "fp8") the Linear weights are quantized after they load
    (tessera.inference.worker.quantization); one the device cannot run is refused before any weight is read.
    With `tensor_parallel` > 1 no weight is read here: the config, tokenizer and source are
    checked and returned (model None), and the tensor-parallel workers load their shards
    (executor.py); a size the model cannot be split by is refused first. A `kv_cache_dtype` the
    device cannot run is refused first too. `skip_checksum_verify` skips hashing a Tessera
    checkpoint's payload files (logged); its metadata is read by the restricted unpickler either way.
    `generation_config` (auto, vllm or a folder): whose generation settings are served (`read_generation`);
    their end ids join config.json's and the tokenizer's.
    """
    check_quantization(quantization, device)
    kv_cache_dtype_of(kv_cache_dtype, torch.float32, device)
    path = Path(path)
    given_name = path.resolve().name
    if not path.exists():
        raise ArtifactError(f"{path}: checkpoint not found")
    hf = path.is_dir() and is_hf_directory(path) and not (path / SIDECAR).is_file()
    if hf:
        cfg, hf_config = read_hf_config(path)  # the one HF adapter, shared with tessera-ckpt import
        serving_kind(cfg)  # a kind this server cannot run: refused before any weight is read
        # Headers only, parsed and checked once (the tensors below come from this): bad weights are
        # refused before anything else, and under tensor parallel before any worker starts.
        hf_weights = checked_hf_weights(path, cfg)
        generation, generation_source = read_generation(path, generation_config)
        eos = eos_token_ids(path, hf_config, generation or GenerationSettings())
        tokenizer = load_tokenizer(path)
        pooling = read_pooling_spec(path, serving_kind(cfg).hidden_size(cfg), hf_config)
    else:
        ckpt = resolve_checkpoint(path)
        sidecar = read_sidecar(ckpt)
        cfg = sidecar.model
        serving_kind(cfg)
        # Every payload file against the sidecar's checksums first (XXH3 on threads, several GB/s
        # per core): a flipped or truncated byte is one line naming the file, never served weights.
        if skip_checksum_verify:
            log.warning("%s: checksum verification skipped (--skip-checksum-verify): the payload files are "
                        "trusted as they are", ckpt)
        else:
            verify_checksums(ckpt, sidecar)
        check_checkpoint(ckpt, sidecar)  # index sizes and model tensors against the config, before any allocation
        tokenizer = load_tokenizer(checkpoint_tokenizer_dir(ckpt))
        generation, generation_source = ((sidecar.generation, f"{ckpt / SIDECAR} (generation)")
                                         if generation_config in ("auto", "vllm") else read_generation(ckpt, generation_config))
        eos = list(generation.eos_token_ids) if generation is not None else []
        pooling = None
        path = ckpt
        if given_name in ("checkpoints",):
            given_name = ckpt.parent.parent.name
    check_tokenizer_fits(tokenizer, cfg.vocab_size, str(path / CONFIG if hf else ckpt / SIDECAR))
    eos_ids = sorted(set(eos) | ({tokenizer.eos_id} if tokenizer.eos_id is not None else set()))
    if eos_ids and eos_ids[-1] >= cfg.vocab_size:
        # No such token is ever generated (vLLM never matches one either); kept, the min_tokens mask
        # would index the logits with it and fail the request.
        log.warning("%s: end ids %s are past the vocabulary (%d tokens); ignored", generation_source or path,
                    [i for i in eos_ids if i >= cfg.vocab_size], cfg.vocab_size)
        eos_ids = [i for i in eos_ids if i < cfg.vocab_size]
    if tensor_parallel > 1:
        if not isinstance(cfg, ModelConfig):  # another kind (hybrid): its plan, then what it splits
            if hf and hasattr(cfg, "refit_for"):  # (an encoder's vocabulary is padded as a decoder's)
                cfg = cfg.refit_for(tensor_parallel)
            check_kind_tensor_parallel(tensor_parallel, cfg, str(path), quantization, device)
            return LoadedModel(model=None, config=cfg, tokenizer=tokenizer, name=given_name, eos_ids=eos_ids,
                               path=path, hf=hf, pooling=pooling, generation=generation,
                               generation_source=generation_source)
        if hf:  # zero rows up to a multiple of the size (as a new model is padded); their logits are -inf
            cfg = cfg.refit_for(tensor_parallel)
        check_tensor_parallel(tensor_parallel, cfg, str(path), quantization, device)
        return LoadedModel(model=None, config=cfg, tokenizer=tokenizer, name=given_name, eos_ids=eos_ids,
                           path=path, hf=hf, pooling=pooling, generation=generation,
                           generation_source=generation_source)
    tensors = imported_tensors(*hf_weights) if hf else load_model_tensors(path)
    model = kind_of(cfg).build(cfg, device=device, dtype=torch.float32, seed=None)
    expected = dict(model.state_dict())
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
        raise ArtifactError(f"{path}: weights do not match the model config ({what})")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ArtifactError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, "
                                f"expected {tuple(expected[name].shape)}")
    model.load_state_dict(tensors, strict=True)
    model = quantize_model(model.to(dtype=dtype).eval(), quantization)
    return LoadedModel(model=model, config=cfg, tokenizer=tokenizer, name=given_name, eos_ids=eos_ids,
                       path=path, hf=hf, pooling=pooling, generation=generation, generation_source=generation_source)
