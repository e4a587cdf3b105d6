"""Quantized weights for serving (`--quantization`), applied by torchao after the weights load.

- int8: weight-only, symmetric per output channel (torchao's `Int8WeightOnlyConfig`). Every
  `nn.Linear` of the model (attention and MLP projections, an untied output head) keeps its weight
  as int8 plus one scale per row; activations and the KV cache stay in the serving dtype. Runs on
  CPU and CUDA. It quarters the bytes of fp32 weights (halves bf16's); what it does to speed
  depends on the kernel the device has: on this project's CPU (torch 2.13, torchao 0.18) the
  dequantize-then-matmul path measured slower than fp32 for a 512x1536 layer (2.2 ms vs 1.5 ms at
  batch 1, one thread), and PyTorch's own `aten._weight_int8pack_mm` slower still with fp32
  activations (4.4 ms), so on CPU int8 buys memory, not speed (benchmarks/quantization.py).
- fp8: float8 (e4m3) weights and dynamically quantized float8 activations, per tensor
  (torchao's `Float8DynamicActivationFloat8WeightConfig`), matmuls on FP8 tensor cores
  (`torch._scaled_mm`): CUDA GPUs of compute capability 8.9 or newer (Ada, Hopper, Blackwell) only.

Not quantized: embeddings (a tied output head reads the embedding table, so it stays in the
serving dtype), norms, and a mixture-of-experts router (routing decisions are sensitive to small
logit changes; vLLM keeps its gate unquantized too). MoE expert weights are stacked parameters, not
`nn.Linear`, and stay unquantized.

`check_quantization` runs before any weight is read, so a quantization the device cannot run is one
line and exit 2, not a failure after minutes of loading.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from tessera.common.errors import UserError

Quantization = Literal["int8", "fp8"]
QUANTIZATIONS: tuple[str, ...] = ("int8", "fp8")
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer


def check_quantization(quantization: str | None, device: torch.device) -> None:
    """Refuse (UserError) a quantization this device or installation cannot run; no weights are touched."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise UserError(f"--quantization {quantization}: not supported; use one of {', '.join(QUANTIZATIONS)}")
    if quantization == "fp8":
        if device.type != "cuda":
            raise UserError(f"--quantization fp8 needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+: "
                            f"Ada, Hopper or newer); the device is {device.type}; use --quantization int8")
        cap = torch.cuda.get_device_capability(device)
        if cap < FP8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise UserError(f"--quantization fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper or "
                            f"newer); {name} is {cap[0]}.{cap[1]}; use --quantization int8")
    try:
        _import_torchao()
    except ImportError:
        raise UserError(f"--quantization {quantization} needs torchao: pip install 'tessera-inference[quant]'") from None


def _import_torchao() -> None:
    import logging

    # torchao warns about each GPU-only extension it ships (mxfp8, cutlass) that fails to load at
    # import on a CPU machine; those kernels are not used there.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    import torchao  # noqa: F401


def _quantizable(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and not fqn.endswith("router")


def quantize_model(model: nn.Module, quantization: str | None) -> nn.Module:
    """Quantize `model`'s Linear weights in place (after `check_quantization` and the weight load)."""
    if quantization is None:
        return model
    _import_torchao()
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8WeightOnlyConfig,
        quantize_,
    )

    config = Int8WeightOnlyConfig() if quantization == "int8" else Float8DynamicActivationFloat8WeightConfig()
    with torch.no_grad():
        quantize_(model, config, filter_fn=_quantizable)
    return model


def quantized_weight_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """The storage dtype of each Linear weight by module name (int8 / float8_e4m3fn once quantized)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            w = module.weight
            out[name] = w.qdata.dtype if hasattr(w, "qdata") else w.dtype
    return out


@torch.no_grad()
def perplexity(model: nn.Module, token_ids: list[int], window: int) -> float:
    """exp(mean next-token cross-entropy) of `token_ids`, read in consecutive windows of `window` tokens
    (each window predicts its own tokens 2..window; no context carried across windows)."""
    ids = torch.tensor(token_ids, dtype=torch.long)
    n = (len(ids) - 1) // window * window
    if n == 0:
        raise ValueError(f"need more than {window} tokens, got {len(ids)}")
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for start in range(0, n, window):
        chunk = ids[start:start + window + 1].to(device)
        logits = model(chunk[None, :-1]).float()
        total += torch.nn.functional.cross_entropy(logits[0], chunk[1:], reduction="sum").item()
        count += chunk.numel() - 1
    return float(torch.exp(torch.tensor(total / count)))
