"""`tessera-ckpt export --format trtllm`: a checkpoint -> a TensorRT-LLM checkpoint directory.

The "TensorRT-LLM checkpoint" (unified format, TensorRT-LLM 0.8 and later; consumed by
`trtllm-build --checkpoint_dir`) is config.json plus one rank{R}.safetensors per rank of
mapping = (tp_size, pp_size), R = pp_rank * tp_size + tp_rank. The names and splits below follow
TensorRT-LLM's own converters (tensorrt_llm/models/llama/convert.py, models/gpt/convert.py):

    transformer.vocab_embedding.weight      full table, first pipeline rank (no parallel embedding)
    transformer.position_embedding.weight   GPT: learned positions, first pipeline rank
    transformer.layers.{j}.input_layernorm.weight (.bias for GPT)
    transformer.layers.{j}.attention.qkv.weight   per tp rank [Q_r; K_r; V_r] rows (+ .bias likewise)
    transformer.layers.{j}.attention.dense.weight o_proj split along its input dim (bias replicated)
    transformer.layers.{j}.post_layernorm.weight (.bias for GPT)
    transformer.layers.{j}.mlp.fc.weight          Llama: gate_proj (the SiLU input); GPT: c_fc (up)
    transformer.layers.{j}.mlp.gate.weight        Llama: up_proj (the multiplier)
    transformer.layers.{j}.mlp.proj.weight        down projection split along its input dim
    transformer.ln_f.weight (.bias)         last pipeline rank
    lm_head.weight                          last pipeline rank; vocab rows zero-padded to a
                                            multiple of tp_size, then split by rows (a tied
                                            model writes the embedding here)

j is the layer number local to the pipeline rank (layers are split contiguously). When KV heads
are fewer than tp_size, each KV head is repeated tp_size / num_kv_heads times (consecutively)
before the split, so every rank holds one.

The families, as TensorRT-LLM's converters write them (models/llama/convert.py for Mistral and
Mixtral, models/qwen/convert.py for Qwen2/Qwen3/Qwen3-MoE; names as above unless listed):

    Mistral     LLaMAConfig, architecture MistralForCausalLM; the sliding window goes in
                runtime_defaults.max_attention_window (one entry per layer when the layers differ)
    Qwen2       QWenConfig (qwen_type qwen2): attention.qkv.bias [Q_r; K_r; V_r] (q/k/v biases,
                no dense bias), attn_bias true
    Qwen3       qwen_type qwen3: attention.q_layernorm.weight / attention.k_layernorm.weight
                [head_dim], on every rank; qk_layernorm true, head_size = head_dim; no attention
                bias (TensorRT-LLM's Qwen3 config has none)
    Mixtral     LLaMAConfig with `moe` {num_experts, top_k, normalization_mode 1 (renormalise),
    Qwen3-MoE   sparse_mixer_epsilon, tp_mode 0}, hidden_act swiglu; each MoE layer holds
                  mlp.router.weight  [E, d], float32 whatever the dtype (never quantised)
                  mlp.fc.weight      [E, 2 f / tp, d]: per rank [up_r; gate_r] (w3 then w1) of
                                     every expert (expert tensor parallel, moe_tp_size = tp)
                  mlp.proj.weight    [E, d, f / tp]: down_proj split along its input dim
                Qwen3-MoE: moe_intermediate_size = f, intermediate_size the dense MLP's

Refused with one line (export --format hf instead, which current TensorRT-LLM also reads):
dynamic-NTK and YaRN RoPE (TensorRT-LLM parametrises them differently from transformers),
Qwen3 with attention biases, Qwen3-MoE with dense layers (the converter makes every layer MoE).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.ckpt_convert.kinds import check_convertible
from tessera.ckpt_convert.mapped import Staging, aligned
from tessera.ckpt_convert.progress import Progress
from tessera.ckpt_convert.safetensors_stream import PlannedTensor, SafetensorsStreamWriter, fsync
from tessera.ckpt_convert.source import CheckpointSource
from tessera.common.errors import UserError
from tessera.common.fileio import (
    atomic_directory,
    atomic_write_json,
    check_output_directory,
    holds_only,
)
from tessera.common.hf.architecture import HF_DTYPE_NAMES
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.hf.adapter import architecture_for, check_exportable

# (inputs, tp_rank) -> this rank's tensor, or its parts along dim 0 (written one after the other,
# never concatenated in memory). Makers return views where they can: the safetensors writer
# materialises non-contiguous ones in its reused staging buffer.
Make = Callable[[list[torch.Tensor], int], "torch.Tensor | list[torch.Tensor]"]


@dataclass(frozen=True)
class TrtllmOptions:
    tp: int = 1
    pp: int = 1
    dtype: torch.dtype | None = None
    overwrite: bool = False
    quiet: bool = False
    sync: bool = True  # False: no fsync of the output (options.NO_SYNC_HELP); still renamed when whole


@dataclass(frozen=True)
class Item:
    """One TensorRT-LLM tensor name on one pipeline rank, produced for each tensor-parallel rank."""

    name: str
    pp_rank: int
    sources: tuple[str, ...]
    shape: tuple[int, ...]  # per tensor-parallel rank
    make: Make
    dtype: torch.dtype | None = None  # None: the export dtype


def rank_of(tp_rank: int, pp_rank: int, tp: int) -> int:
    return pp_rank * tp + tp_rank


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


QWEN = ("qwen2", "qwen3", "qwen3_moe")  # written by TensorRT-LLM's Qwen converter (the rest as its Llama one)
HF_INSTEAD = "; export --format hf, which current TensorRT-LLM reads"


def check_supported(cfg: ModelConfig) -> None:
    """What TensorRT-LLM's checkpoint cannot hold exactly: one line, before any work."""
    if getattr(cfg, "mla", None) is not None:
        raise UserError("model config: multi-head latent attention (model.mla, DeepSeek-V3) is not exported to "
                        "TensorRT-LLM by Tessera" + HF_INSTEAD)
    if cfg.arch in ("llama", "gpt2"):
        plain = dict(qk_norm=False, sliding_window=None, moe=None, attention_bias=None,
                     head_dim=cfg.hidden_size // cfg.num_heads)
        wrong = {k: getattr(cfg, k) for k, v in plain.items() if getattr(cfg, k) != v}
        if wrong:
            raise UserError(f"model config: arch={cfg.arch} {wrong} is not exported to TensorRT-LLM by Tessera" + HF_INSTEAD)
    s = cfg.rope_scaling
    if s is not None and s.rope_type not in ("llama3", "linear"):
        raise UserError(f"model config: rope_scaling {s.rope_type} is not exported to TensorRT-LLM (its {s.rope_type} "
                        "scaling is parametrised differently from transformers')" + HF_INSTEAD)
    if cfg.arch in ("qwen3", "qwen3_moe") and any(cfg.attn_bias(x) for x in "qkvo"):
        raise UserError(f"model config: arch={cfg.arch} with attention_bias is not exported to TensorRT-LLM (its "
                        "Qwen3 config has no attention bias)" + HF_INSTEAD)
    if cfg.moe is not None and not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        raise UserError(f"model config: moe.first_k_dense / moe.layer_freq leave dense layers, which TensorRT-LLM's "
                        f"{cfg.arch} converter does not have (every layer is MoE)" + HF_INSTEAD)


def validate(cfg: ModelConfig, tp: int, pp: int) -> None:
    check_exportable(cfg)
    check_supported(cfg)
    kv = cfg.kv_heads
    problems = [
        (cfg.num_heads % tp, f"--tensor-parallel {tp} does not divide num_heads {cfg.num_heads}"),
        ((kv % tp) if kv >= tp else (tp % kv),
         f"--tensor-parallel {tp} and num_kv_heads {kv}: one must be a multiple of the other"),
        (cfg.ffn_hidden_size % tp, f"--tensor-parallel {tp} does not divide ffn_hidden_size {cfg.ffn_hidden_size}"),
        (cfg.moe is not None and cfg.moe.ffn_hidden_size % tp,
         f"--tensor-parallel {tp} does not divide moe.ffn_hidden_size {cfg.moe.ffn_hidden_size if cfg.moe else 0}"),
        (cfg.num_layers % pp, f"--pipeline-parallel {pp} does not divide num_layers {cfg.num_layers}"),
    ]
    for bad, message in problems:
        if bad:
            raise UserError(message)


# ---- per-rank tensor makers --------------------------------------------------------------------


def _split(t: torch.Tensor, tp: int, r: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(tp, dim=dim)[r]


def _dup_kv(t: torch.Tensor, kv_heads: int, tp: int) -> torch.Tensor:
    """Repeat each KV head (rows, or bias entries) tp/kv_heads times in place, when kv_heads < tp."""
    if kv_heads >= tp:
        return t
    reps = tp // kv_heads
    heads = aligned(t).reshape(kv_heads, -1, *t.shape[1:])
    return heads.repeat_interleave(reps, dim=0).reshape(-1, *t.shape[1:])


def _qkv(cfg: ModelConfig, tp: int) -> Make:
    def make(ts: list[torch.Tensor], r: int) -> list[torch.Tensor]:
        q, k, v = ts
        k, v = _dup_kv(k, cfg.kv_heads, tp), _dup_kv(v, cfg.kv_heads, tp)
        return [_split(q, tp, r), _split(k, tp, r), _split(v, tp, r)]  # rows [Q_r; K_r; V_r]
    return make


def _col(tp: int) -> Make:
    return lambda ts, r: _split(ts[0], tp, r, 0)


def _row(tp: int) -> Make:
    return lambda ts, r: _split(ts[0], tp, r, 1)


def _rep(ts: list[torch.Tensor], r: int) -> torch.Tensor:
    return ts[0]


def _expert_fc(tp: int) -> Make:
    """[E, 2 f / tp, d]: this rank's rows of every expert's up_proj (w3), then of its gate_proj (w1)."""
    def make(ts: list[torch.Tensor], r: int) -> torch.Tensor:
        up, gate = (aligned(t) for t in ts)
        return torch.cat([_split(up, tp, r, 1), _split(gate, tp, r, 1)], dim=1)
    return make


def _lm_head(cfg: ModelConfig, tp: int) -> Make:
    def make(ts: list[torch.Tensor], r: int) -> torch.Tensor:
        w = ts[0][:cfg.vocab_size]  # Tessera's own vocabulary padding off; TensorRT-LLM pads to tp
        pad = padded_vocab(cfg.vocab_size, tp) - cfg.vocab_size
        if pad:
            w = torch.nn.functional.pad(aligned(w), (0, 0, 0, pad))
        return _split(w, tp, r, 0)
    return make


def items(cfg: ModelConfig, tp: int, pp: int) -> list[Item]:
    """Every TensorRT-LLM tensor, in writing order, with its pipeline rank and per-rank maker."""
    d, f, v, hd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.head_dim
    llama = cfg.arch != "gpt2"  # every family but GPT-2 is gated, RMS-normed, without position table
    q_rows = cfg.num_heads // tp * hd
    kv_rows = max(cfg.kv_heads // tp, 1) * hd
    qkv_rows = q_rows + 2 * kv_rows
    per_stage = cfg.num_layers // pp
    norm_suffixes = ("weight",) if llama else ("weight", "bias")
    has_bias = cfg.bias  # MLP biases (and GPT-2's everywhere)
    qkv_bias, dense_bias = cfg.attn_bias("q"), cfg.attn_bias("o")
    out = [Item("transformer.vocab_embedding.weight", 0, ("embed_tokens.weight",), (v, d),
                lambda ts, r: ts[0][:v])]  # without Tessera's vocabulary padding
    if not llama:
        out.append(Item("transformer.position_embedding.weight", 0, ("pos_embed.weight",), (cfg.max_seq_len, d), _rep))
    for i in range(cfg.num_layers):
        stage, j = divmod(i, per_stage)
        t, n = f"layers.{i}.", f"transformer.layers.{j}."
        for s in norm_suffixes:
            out.append(Item(n + f"input_layernorm.{s}", stage, (t + f"attn_norm.{s}",), (d,), _rep))
        qkv = tuple(t + f"attn.{p}_proj" for p in "qkv")
        out.append(Item(n + "attention.qkv.weight", stage, tuple(x + ".weight" for x in qkv), (qkv_rows, d), _qkv(cfg, tp)))
        if qkv_bias:
            out.append(Item(n + "attention.qkv.bias", stage, tuple(x + ".bias" for x in qkv), (qkv_rows,), _qkv(cfg, tp)))
        out.append(Item(n + "attention.dense.weight", stage, (t + "attn.o_proj.weight",), (d, cfg.q_size // tp), _row(tp)))
        if dense_bias:
            out.append(Item(n + "attention.dense.bias", stage, (t + "attn.o_proj.bias",), (d,), _rep))
        if cfg.qk_norm:
            for x in "qk":
                out.append(Item(n + f"attention.{x}_layernorm.weight", stage, (t + f"attn.{x}_norm.weight",), (hd,), _rep))
        for s in norm_suffixes:
            out.append(Item(n + f"post_layernorm.{s}", stage, (t + f"mlp_norm.{s}",), (d,), _rep))
        if cfg.is_moe_layer(i):
            assert cfg.moe is not None
            e, fe = cfg.moe.num_experts, cfg.moe.ffn_hidden_size
            x = t + "mlp.experts."
            out.append(Item(n + "mlp.router.weight", stage, (t + "mlp.router.weight",), (e, d), _rep, torch.float32))
            out.append(Item(n + "mlp.fc.weight", stage, (x + "up_proj", x + "gate_proj"), (e, 2 * fe // tp, d),
                            _expert_fc(tp)))
            out.append(Item(n + "mlp.proj.weight", stage, (x + "down_proj",), (e, d, fe // tp), lambda ts, r: _split(ts[0], tp, r, 2)))
            continue
        mlp = [("fc", "gate_proj"), ("gate", "up_proj")] if llama else [("fc", "up_proj")]
        for theirs, ours in mlp:
            out.append(Item(n + f"mlp.{theirs}.weight", stage, (t + f"mlp.{ours}.weight",), (f // tp, d), _col(tp)))
            if has_bias:
                out.append(Item(n + f"mlp.{theirs}.bias", stage, (t + f"mlp.{ours}.bias",), (f // tp,), _col(tp)))
        out.append(Item(n + "mlp.proj.weight", stage, (t + "mlp.down_proj.weight",), (d, f // tp), _row(tp)))
        if has_bias:
            out.append(Item(n + "mlp.proj.bias", stage, (t + "mlp.down_proj.bias",), (d,), _rep))
    last = pp - 1
    for s in norm_suffixes:
        out.append(Item(f"transformer.ln_f.{s}", last, (f"final_norm.{s}",), (d,), _rep))
    head = "embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    out.append(Item("lm_head.weight", last, (head,), (padded_vocab(v, tp) // tp, d), _lm_head(cfg, tp)))
    return out


def _moe_config(cfg: ModelConfig) -> dict[str, Any]:
    """TensorRT-LLM's MoeConfig: normalization_mode 1 renormalises the top-k weights, 0 keeps the
    softmax probabilities as they are; tp_mode 0 splits every expert over the tensor ranks."""
    m = cfg.moe
    if m is None:
        return {"num_experts": 0, "top_k": 0, "normalization_mode": 0, "sparse_mixer_epsilon": 0.01, "tp_mode": 0}
    return {"num_experts": m.num_experts, "top_k": m.top_k, "normalization_mode": 1 if m.norm_topk_prob else 0,
            "sparse_mixer_epsilon": 0.01, "tp_mode": 0}


def _rotary_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    s = cfg.rope_scaling
    if s is None:
        return None
    if s.rope_type == "linear":
        return {"type": "linear", "factor": s.factor}
    return {"type": "llama3", "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,  # type: ignore[union-attr]
            "high_freq_factor": s.high_freq_factor,  # type: ignore[union-attr]
            "original_max_position_embeddings": s.original_max_position_embeddings}


def trtllm_config(cfg: ModelConfig, dtype: torch.dtype, tp: int, pp: int) -> dict[str, Any]:
    """config.json of a checkpoint `validate` accepted. TensorRT-LLM names the families by their
    transformers class, except GPT-2 (its own `GPTForCausalLM`)."""
    llama = cfg.arch != "gpt2"
    c: dict[str, Any] = {
        "architecture": architecture_for(cfg).hf_class if llama else "GPTForCausalLM",
        "dtype": HF_DTYPE_NAMES[dtype],
        "logits_dtype": "float32",
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_size": cfg.head_dim,
        "intermediate_size": cfg.ffn_hidden_size,
        "hidden_act": ("swiglu" if cfg.moe is not None else "silu") if llama else "gelu_new",
        "norm_epsilon": cfg.norm_eps,
        "position_embedding_type": "rope_gpt_neox" if llama else "learned_absolute",
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    if cfg.moe is not None:
        c["mapping"].update(moe_tp_size=tp, moe_ep_size=1)
    if cfg.qk_norm:
        c["qk_layernorm"] = True
    windows = [cfg.window(i) or cfg.max_seq_len for i in range(cfg.num_layers)]
    if cfg.sliding_window is not None:  # TensorRT-LLM cycles the list over the layers
        c["runtime_defaults"] = {"max_attention_window": windows if len(set(windows)) > 1 else windows[:1],
                                 "sink_token_length": None}
    if cfg.arch in QWEN:
        c.update(qwen_type=cfg.arch, rotary_base=cfg.rope_theta, rotary_scaling=_rotary_scaling(cfg),
                 attn_bias=cfg.attn_bias("q"), mlp_bias=False, use_logn_attn=False, seq_length=cfg.max_seq_len,
                 moe=_moe_config(cfg), moe_intermediate_size=cfg.moe.ffn_hidden_size if cfg.moe else 0,
                 moe_shared_expert_intermediate_size=0, disable_weight_only_quant_plugin=False)
    elif llama:
        c["rotary_base"] = cfg.rope_theta
        c["rotary_scaling"] = _rotary_scaling(cfg)
        c["attn_bias"] = cfg.bias
        c["mlp_bias"] = cfg.bias
        if cfg.moe is not None:
            c["moe"] = _moe_config(cfg)
    else:
        c["bias"] = True
        if not cfg.bias:
            raise UserError("model config: a bias-free GPT-2 cannot be exported to TensorRT-LLM's GPT "
                            "(its converter expects biases); export --format hf instead")
    return c


def is_trtllm_checkpoint(path: Path) -> bool:
    """config.json beside rank{R}.safetensors and nothing else: what this exporter writes, so what
    its --overwrite may replace (written in a hidden sibling and renamed whole)."""
    return ((path / "config.json").is_file() and any(re.fullmatch(r"rank\d+\.safetensors", p.name)
                                                     for p in path.iterdir())
            and holds_only(path, lambda name: bool(re.fullmatch(r"config\.json|rank\d+\.safetensors", name))))


def export_trtllm(checkpoint: str | Path, output: str | Path, opts: TrtllmOptions) -> Path:
    src = CheckpointSource(checkpoint)
    output = Path(output)
    check_output_directory(output, opts.overwrite, [src.directory],
                           "TensorRT-LLM checkpoint (config.json + rank*.safetensors)", is_trtllm_checkpoint)
    cfg = src.sidecar.model
    check_convertible(cfg, "export --format trtllm")
    tp, pp = opts.tp, opts.pp
    validate(cfg, tp, pp)
    all_items = items(cfg, tp, pp)
    dtype = opts.dtype or src.model_specs["embed_tokens.weight"].dtype
    config = trtllm_config(cfg, dtype, tp, pp)

    plans: list[list[PlannedTensor]] = [[] for _ in range(tp * pp)]
    for it in all_items:
        for r in range(tp):
            plans[rank_of(r, it.pp_rank, tp)].append(PlannedTensor(it.name, it.shape, it.dtype or dtype))
    total = sum(t.nbytes for plan in plans for t in plan)

    with src.checksum_check() as checksums, atomic_directory(output, overwrite=opts.overwrite, sync=opts.sync) as tmp, \
            Progress(total, len(all_items), f"export trtllm tp{tp} pp{pp}", opts.quiet) as bar:
        files = [open(tmp / f"rank{r}.safetensors", "wb") for r in range(tp * pp)]
        try:
            staging = Staging()  # one reused buffer for every rank's non-contiguous pieces
            writers = [SafetensorsStreamWriter(f, plan, staging=staging, sync=opts.sync) for f, plan in zip(files, plans)]
            # Tensor-major: each source tensor is read once (memory-mapped) and cut into its tp pieces.
            for it in all_items:
                # Raw (mapped) inputs: makers take views (the writer realigns what it copies) or
                # call aligned() before computing (KV-head duplication, vocab padding).
                loaded = src.load_model(list(it.sources), raw=True)
                inputs = [loaded[s] for s in it.sources]
                nbytes = math.prod(it.shape) * (it.dtype or dtype).itemsize
                for r in range(tp):
                    writers[rank_of(r, it.pp_rank, tp)].write(it.name, it.make(inputs, r))  # -> dtype
                    bar.update(nbytes, tensors=0)
                bar.update(0)
                del loaded, inputs
            for w, f in zip(writers, files):
                w.close()
                if opts.sync:
                    fsync(f)
        finally:
            for f in files:
                f.close()
        atomic_write_json(tmp / "config.json", config, sync=opts.sync)
        checksums.wait()  # the input's checksums must match before the output is committed
    return output
