"""The paged KV cache's storage: its dtype (--kv-cache-dtype), its size per block, and the write
and read of fp8 keys/values (stored as x / scale, read back as stored * scale)."""

from __future__ import annotations

import torch

from tessera.common.errors import UserError
from tessera.common.models.causal_lm.config import ModelConfig

# --kv-cache-dtype (vLLM's names) -> storage dtype; "auto" stores the model's dtype. fp8 keys and
# values are stored as x / scale, clamped to the format's largest finite value (a cast of a larger
# number would give NaN in e4m3fn, inf in e5m2), and read back as stored * scale in the model's
# dtype inside attention, so only the cache is fp8. The scale is per tensor (one for all keys, one
# for all values): 1.0, vLLM's default without --calculate-kv-scales, since no checkpoint this
# engine reads carries KV scales. Activations of the models served here are far inside e4m3's
# range (|x| <= 448); its 3 mantissa bits give a relative rounding error of at most 2^-4 per value.
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Storage dtype of the KV cache for --kv-cache-dtype `name` and model dtype `dtype`; refuses
    (one line) e4m3 on a GPU whose Triton has no e4m3 conversions (before compute capability 8.9)."""
    if name == "auto":
        return dtype
    kv = KV_CACHE_DTYPES[name]
    if kv == torch.float8_e4m3fn and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise UserError(f"--kv-cache-dtype {name}: float8_e4m3fn needs a GPU of compute capability 8.9 or newer "
                        f"(this one: {'.'.join(map(str, torch.cuda.get_device_capability(device)))}); use "
                        "--kv-cache-dtype fp8_e5m2 or auto")
    return kv


def local_kv_heads(cfg: ModelConfig, tp: int = 1) -> int:
    """Key/value heads one tensor rank holds: its 1/tp share, or one when tp > kv_heads (each head
    is then replicated on tp / kv_heads ranks, executor.py)."""
    return max(1, cfg.kv_heads // tp)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
    """Bytes one block takes across all layers (K and V) on one tensor rank, stored in `dtype`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * local_kv_heads(cfg, tp) * cfg.head_dim * itemsize


def store_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float = 1.0) -> None:
    """cache[slots] = x in the cache's storage dtype: a plain cast, or for fp8 x / scale clamped to
    the format (written through a uint8 view: PyTorch's CPU index_copy_ has no fp8 kernel)."""
    if cache.dtype == x.dtype:
        cache.index_copy_(0, slots, x)
        return
    if cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        cache.index_copy_(0, slots, x.to(cache.dtype))
        return
    if scale != 1.0:
        x = x.float() / scale
    fmax = torch.finfo(cache.dtype).max
    cache.view(torch.uint8).index_copy_(0, slots, x.clamp(-fmax, fmax).to(cache.dtype).view(torch.uint8))


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached keys or values (a gathered window) back in the compute dtype `dtype`."""
    if x.dtype == dtype:
        return x
    return x.to(dtype) if scale == 1.0 else (x.float() * scale).to(dtype)

