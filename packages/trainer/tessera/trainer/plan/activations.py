"""Activation memory: what one transformer block keeps from its forward for its backward, and the
loss's buffers.

Method for the block: *measured*, not written down. One `Block` of the model at this rank's local
shapes (query/kv heads and ffn width divided by tensor parallel, experts by expert parallel, the
sequence by context parallel) runs forward under `FakeTensorMode` (shapes and dtypes, no memory,
milliseconds even at 405B widths) with activation recompute applied as the trainer applies it,
autocast unless fp32, bf16 parameters and input for the -master precisions and the trainer's
torchao Float8Linear swap for fp8; a dispatch mode records the storage of every tensor the
forward creates, and what is still alive after the forward (held by autograd or by recompute;
not autocast's copies of the weights, which its cache holds once per step: memory.py counts
them) is the block's activation memory. So the figure follows Tessera's real kernels (the CPU
flash-attention path saves output and log-sum-exp, not the T x T probabilities; SwiGLU keeps its
inputs; torchao 0.10+'s Float8Linear keeps its high-precision input and weight, not float8
copies), which a hand-written per-tensor formula would have to track by hand.

Corrections the single-device block cannot show, analytic:
* sequence parallel: the block input and the MLP norm's input (and their rms statistics) hold
  T/tp tokens, not T (the normed outputs are all-gathered to T and saved at T by the column layers);
* context parallel: keys and values are all-gathered to the full sequence and kept
  (ContextParallelAttention). One document per sample adds, on CPU, one additive [T/C, T] mask
  per micro-batch, shared by the layers (`attention_mask_bytes`); on CUDA it takes FlexAttention
  with one [1, T/C/128, T/128] block mask instead. Packed documents
  (`packed_documents`, common/layers/attention.py's MaskedAttention) build no such mask: on CPU the
  per-segment SDPA attends the local queries at their places in a zero [T] sequence, so the
  gathered query segments and their outputs (and log-sum-exp) are kept at up to T tokens, not
  T/C (T when every document holds local queries, as with load-balanced chunks and documents
  longer than a chunk: planned so, an upper bound), and the outputs put back in token order are
  one more [T/C] tensor (also in one process); on CUDA FlexAttention saves what SDPA saves, plus
  one block mask per micro-batch of O((T/C/128) x (T/128)) int32 entries;
* full recompute: during backward one block's activations are rebuilt (a transient counted with
  the buffers);
* mixture-of-experts layers: routing has data-dependent shapes, which fake tensors cannot run, so
  an MoE block is measured as a dense block whose SwiGLU width is what one token passes through
  (top_k x expert width + shared experts), plus each token's top_k dispatched copies of its
  hidden state and the router's [tokens, experts] logits and probabilities (an estimate; checked
  against one measured run: 4 experts, top 2, one process, peak -5.6%).

A hybrid model's layers (Mamba-2, attention, MLP or MoE, each behind one norm) are measured the
same way, one `HybridBlock` per layer at its local shapes (`measure_hybrid_block`, plan/hybrid.py).
"""

from __future__ import annotations

import functools
import gc
from types import SimpleNamespace

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.hybrid.config import HybridConfig
from tessera.trainer.plan.hybrid import is_hybrid, local_layer
from tessera.trainer.plan.spec import PlanSpec


class _LiveStorages(TorchDispatchMode):
    """Records (weak) every storage an op outputs, and which of them are casts of `params`
    (autocast's weight copies: counted once per step by the caller, not per block and micro-batch)."""

    def __init__(self, params: set[int]):
        super().__init__()
        self.params = params
        self.weight_copies: set[int] = set()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cast = func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor) \
            and StorageWeakRef(args[0].untyped_storage()).cdata in self.params
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                ref = StorageWeakRef(st)
                self.storages.setdefault(ref.cdata, (ref, st.nbytes()))
                if cast:
                    self.weight_copies.add(ref.cdata)
        return out

    def live_bytes(self, exclude: set[int]) -> int:
        return sum(n for cdata, (ref, n) in self.storages.items() if not ref.expired() and cdata not in exclude)


def _local_config(cfg: ModelConfig, tp: int, ep: int) -> ModelConfig:
    update: dict = dict(num_heads=cfg.num_heads // tp, num_kv_heads=cfg.kv_heads // tp,
                        ffn_hidden_size=max(1, cfg.ffn_hidden_size // tp), head_dim=cfg.head_dim, num_layers=1,
                        sliding_window_layers=None)
    if cfg.moe is not None and ep > 1:
        update["moe"] = cfg.moe.model_copy(update=dict(num_experts=cfg.moe.num_experts // ep,
                                                       top_k=min(cfg.moe.top_k, cfg.moe.num_experts // ep)))
    return cfg.model_copy(update=update)


@functools.lru_cache(maxsize=128)
def measure_block(cfg_json: str, layer: int, batch: int, seq: int, precision: str, recompute: str) -> int:
    """Bytes one block (global layer `layer` of the config, already at local shapes) keeps alive
    after its forward on [batch, seq, hidden] input, its input included, its output not, nor
    autocast's copies of its weights. `precision` as PlanSpec's: autocast to bf16 unless fp32;
    bf16 parameters and input for the -master ones; torchao Float8Linear layers for fp8."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tessera.common.layers.rope import RotaryEmbedding
    from tessera.common.models.causal_lm.model import Block
    from tessera.trainer.components.model_setup import apply_recompute

    cfg = ModelConfig.model_validate_json(cfg_json)
    moe_extra = 0
    if cfg.moe is not None:
        moe = cfg.moe
        tokens = batch * seq
        moe_extra = tokens * (moe.top_k * cfg.hidden_size + 2 * moe.num_experts) * (2 if precision != "fp32" else 4)
        cfg = cfg.model_copy(update=dict(moe=None, ffn_hidden_size=moe.top_k * moe.ffn_hidden_size + moe.shared_size))
    dtype = torch.bfloat16 if precision.endswith("-master") else torch.float32
    with FakeTensorMode():
        block = Block(cfg, 0)
        block.train()
        for p in block.parameters():
            p.data = p.data.to(dtype)
        if precision.startswith("fp8"):
            float8_as_on_cuda(block)
        apply_recompute(SimpleNamespace(layers={"0": block}), recompute)  # type: ignore[arg-type]
        rope = RotaryEmbedding(cfg)(torch.arange(seq).unsqueeze(0)) if cfg.position == "rope" else None
        x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True, dtype=dtype)
        keep = {StorageWeakRef(p.untyped_storage()).cdata for p in block.parameters()}
        tracker = _LiveStorages(set(keep))
        keep |= {StorageWeakRef(t.untyped_storage()).cdata for t in (rope or ())}
        ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32")
        with tracker, ctx:
            y = block(x, rope)
        gc.collect()
        keep.add(StorageWeakRef(y.untyped_storage()).cdata)
        live = tracker.live_bytes(keep | tracker.weight_copies) + x.untyped_storage().nbytes()
        del y
    return live + moe_extra


@functools.lru_cache(maxsize=128)
def measure_hybrid_block(cfg_json: str, batch: int, seq: int, precision: str, recompute: str,
                         documents: bool) -> int:
    """Bytes the single layer of `cfg_json` (local shapes, `local_layer`) keeps alive after its
    forward on [batch, seq, hidden] input, its input included, its output and autocast's weight
    copies not (measure_block's method). `documents`: with document ids."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tessera.common.models.hybrid.model import HybridBlock
    from tessera.trainer.components.model_setup import apply_recompute

    cfg = HybridConfig.model_validate_json(cfg_json)
    moe_extra = 0
    if cfg.pattern == "E":  # routing has data-dependent shapes: an MLP of the width a token passes through
        moe = cfg.moe
        assert moe is not None
        moe_extra = batch * seq * (moe.top_k * cfg.hidden_size + 2 * moe.num_experts) * (2 if precision != "fp32" else 4)
        cfg = cfg.model_copy(update=dict(pattern="-", moe=None,
                                         ffn_hidden_size=moe.top_k * moe.ffn_hidden_size + moe.shared_size))
    dtype = torch.bfloat16 if precision.endswith("-master") else torch.float32
    with FakeTensorMode():
        block = HybridBlock(cfg, cfg.layer_config(), 0)
        block.train()
        for p in block.parameters():
            p.data = p.data.to(dtype)
        if precision.startswith("fp8"):
            float8_as_on_cuda(block)
        apply_recompute(SimpleNamespace(layers={"0": block}), recompute)  # type: ignore[arg-type]
        x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True, dtype=dtype)
        ids = torch.zeros(batch, seq, dtype=torch.long) if documents and cfg.pattern == "M" else None
        keep = {StorageWeakRef(p.untyped_storage()).cdata for p in block.parameters()}
        tracker = _LiveStorages(set(keep))
        if ids is not None:
            keep.add(StorageWeakRef(ids.untyped_storage()).cdata)  # the batch's, shared by the layers
        ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32")
        with tracker, ctx:
            y = block(x, ids, None)
        gc.collect()
        keep.add(StorageWeakRef(y.untyped_storage()).cdata)
        live = tracker.live_bytes(keep | tracker.weight_copies) + x.untyped_storage().nbytes()
        del y
    return live + moe_extra


def float8_as_on_cuda(module: torch.nn.Module) -> None:
    """The trainer's Float8Linear swap (tessera.trainer.components.precision.torchao_float8), as it behaves on CUDA, on a CPU (or
    fake) module. What it saves for
    backward is torchao's (>= 0.10: the high-precision input and the weight, casting both to
    float8 again in backward; torchao before 2025-01, which torchtitan's published runs used,
    saved the float8 input). On CUDA, Float8Linear casts its input to the autocast dtype first;
    CPU autocast does not trigger that cast, so a pre-hook does it here."""
    from tessera.common.errors import UserError
    from tessera.trainer.components.precision.torchao_float8 import convert_to_float8

    try:
        convert_to_float8(module, "tensorwise")
    except UserError as exc:
        raise UserError(f"planning precision fp8: {exc}") from None
    from torchao.float8.float8_linear import Float8Linear

    for m in module.modules():
        if isinstance(m, Float8Linear):
            m.register_forward_pre_hook(lambda _m, args: (args[0].to(torch.bfloat16), *args[1:]))


def resid_bytes(spec: PlanSpec) -> float:
    """The residual stream (and pipeline stages' inputs and outputs) stays in the parameter dtype."""
    return 2.0 if spec.bf16_params else 4.0


def layer_activation_bytes(spec: PlanSpec, layer: int = 0) -> float:
    """Activation bytes of one block (a hybrid model: one layer) for one micro-batch on one rank."""
    cfg, lay = spec.model, spec.layout
    tp, cp = lay.tensor, lay.context
    b, s = spec.micro_batch, spec.seq_len // cp
    bf16 = spec.precision != "fp32"
    if is_hybrid(cfg):
        hybrid = local_layer(cfg, layer, tp, lay.expert)
        total = float(measure_hybrid_block(hybrid.model_dump_json(), b, s, spec.precision, spec.recompute,
                                           spec.packed_documents))
        if hybrid.pattern != "*":  # the corrections below are the attention's
            local = None
        else:
            local = hybrid.layer_config()
    else:
        local = _local_config(cfg, tp, lay.expert)
        if local.moe is not None and not local.is_moe_layer(layer):
            local = local.model_copy(update={"moe": None})
        total = float(measure_block(local.model_dump_json(), 0, b, s, spec.precision, spec.recompute))
    rb = resid_bytes(spec)
    if tp > 1 and spec.sequence_parallel:
        total -= (1 - 1 / tp) * b * s * cfg.hidden_size * rb * (2 if spec.recompute != "full" else 1)
    ab, t = (2.0 if bf16 else 4.0), spec.seq_len
    if local is None:
        return total
    if cp > 1 and spec.recompute != "full":
        total += 2 * b * (t - s) * local.kv_size * ab  # K and V all-gathered to T
    if spec.packed_documents and spec.device_type == "cpu" and spec.recompute == "none":
        # Per-segment SDPA (measured on a real block, 2 documents of 24 and 40 tokens): it saves
        # its gathered query segments, outputs and lse -- under CP at up to T tokens (the local
        # queries padded with zeros), not T/C -- and the outputs put back in token order (the
        # output projection's input) are a second tensor, where plain SDPA's output is a view.
        total += b * local.q_size * ab * (2 * t - s) + b * local.num_heads * 4.0 * (t - s)
    return total


def attention_mask_bytes(spec: PlanSpec) -> float:
    """Per micro-batch, shared by every layer of one sliding window: on CUDA FlexAttention's block
    mask (kv and q block counts and indices, full and partial: four [rows, Tq/128, T/128] int32
    tensors; rows = the micro-batch with packed documents, 1 for one document per sample under
    context parallel); on CPU context parallel's additive [T/C, T] mask for one document per
    sample. The CPU per-segment path of packed documents holds no mask (only a [w, 2w] band per
    window)."""
    cfg, lay = spec.model, spec.layout
    windows = (int("*" in cfg.pattern) if is_hybrid(cfg)  # one window: a hybrid model's attention is global
               else len({cfg.window(i) for i in range(cfg.num_layers)}))
    if not spec.packed_documents and lay.context == 1:  # one process: plain causal SDPA, no mask
        return 0.0
    if spec.device_type != "cpu":
        rows = spec.micro_batch if spec.packed_documents else 1
        blocks = -(-spec.seq_len // lay.context // 128) * -(-spec.seq_len // 128)
        return windows * 4 * rows * blocks * 4.0
    if spec.packed_documents:
        return 0.0
    # (cached by the attention function: alive under full recompute too)
    return windows * spec.seq_len // lay.context * spec.seq_len * (2.0 if spec.precision != "fp32" else 4.0)


def recompute_buffer_bytes(spec: PlanSpec) -> float:
    """Full recompute: one block's activations rebuilt in backward, alive while it runs."""
    if spec.recompute != "full":
        return 0.0
    plain = spec.model_copy(update={"recompute": "none"})
    if is_hybrid(spec.model):  # the largest of its layer types
        return max(layer_activation_bytes(plain, spec.model.pattern.index(sym)) for sym in set(spec.model.pattern))
    return layer_activation_bytes(plain)


def saved_head_bytes(spec: PlanSpec) -> float:
    """Saved by the last stage after the blocks: final norm input and normed output, and the
    loss's softmax [tokens, V/tp] (fp32: the vocab-parallel loss works in fp32)."""
    cfg, lay = spec.model, spec.layout
    tokens = spec.micro_batch * spec.seq_len // lay.context
    sp = lay.tensor if spec.sequence_parallel and lay.tensor > 1 else 1
    d = cfg.hidden_size
    norm = tokens / sp * d * 4.0 + tokens * d * (2.0 if spec.precision != "fp32" else 4.0)
    return norm + tokens * (cfg.vocab_rows // lay.tensor) * 4.0


def head_loss_bytes(spec: PlanSpec) -> float:
    """Transient at the loss: the loss's backward holds the saved softmax (counted as saved), its
    clone (the gradient) and the one-hot of the targets, [tokens, V/tp] fp32 each, and the logits'
    gradient in the compute dtype."""
    cfg, lay = spec.model, spec.layout
    tokens = spec.micro_batch * spec.seq_len // lay.context
    logits = tokens * (cfg.vocab_rows // lay.tensor)
    return logits * (2 * 4.0 + (2.0 if spec.precision != "fp32" else 0.0))
