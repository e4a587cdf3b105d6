"""What a plan is made for: a model, a layout, the batch, precision, recompute and the sharding options.

`PlanSpec.from_train_config` reads them from a `tessera-train` config (the same fields the
trainer reads, so a plan describes the run that config starts). Precisions: `fp32`; `bf16` and
`fp8` as the trainer runs them (autocast over fp32 weights; fp8 with torchao's Float8Linear in
the block's linear layers, tessera.trainer.components.precision.torchao_float8); `bf16-master` and `fp8-master` the same compute
over bf16 parameters with fp32 master weights (FSDP's `fsdp_param_dtype: bfloat16`, Megatron's
--bf16; torchtitan's published Float8 runs are `fp8-master`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tessera.common.config import StrictModel
from tessera.common.layout import ParallelLayout
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.hybrid.config import HybridConfig
from tessera.trainer.parallel.data_parallel import BUCKET_NUMEL

Precision = Literal["fp32", "bf16", "bf16-master", "fp8", "fp8-master"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "bf16-master", "fp8", "fp8-master")


class PlanSpec(StrictModel):
    model: ModelConfig | HybridConfig  # the kinds tessera-plan counts (its memory count: memory.MEMORY_COUNTS)
    layout: ParallelLayout
    seq_len: int = Field(..., gt=0, description="Tokens per sample.")
    micro_batch: int = Field(..., gt=0, description="Samples per micro-batch on one data-parallel rank.")
    global_batch: int = Field(..., gt=0, description="Samples per optimizer step.")
    precision: Precision = Field("fp32", description="fp32; bf16 = the trainer's autocast over fp32 weights, grads "
                                 "and Adam; bf16-master = bf16 parameters, fp32 main grads and fp32 master weights "
                                 "(the runtime's bf16 parameters, FSDP's fsdp_param_dtype=bfloat16, Megatron's --bf16); "
                                 "fp8 = bf16 with torchao Float8Linear layers (the trainer's fp8); fp8-master = "
                                 "bf16-master with them (torchtitan's Float8 runs).")
    recompute: Literal["none", "selective", "full"] = Field("none", description="Activation recompute.")
    packed_documents: bool = Field(False, description="Attention restricted to each packed document "
                                   "(data.reset_attention_mask): common/layers/attention.py's MaskedAttention.")
    device_type: Literal["cuda", "cpu"] = Field("cuda", description="Where the step runs: picks the packed-"
                                                "document kernel (FlexAttention on CUDA, per-segment SDPA on CPU).")
    sequence_parallel: bool = Field(True, description="With tensor > 1.")
    distributed_optimizer: bool = Field(True, description="ZeRO-1: optimizer state and masters sharded over data ranks.")
    fsdp_reshard_after_forward: bool = Field(True, description="FSDP: free gathered block parameters after forward.")
    fp8_all_gather: bool = Field(False, description="fp8-master with FSDP: all-gather the blocks' linear weights in float8 "
                                 "(torchao's float8 all-gather, torchtitan's enable_fsdp_float8_all_gather): 1 byte "
                                 "per gathered weight instead of 2.")
    cpu_offload: bool = Field(False, description="FSDP: sharded parameters, grads and optimizer state in host memory.")
    bucket_numel: int = Field(BUCKET_NUMEL, gt=0, description="Elements per data-parallel gradient bucket.")

    @property
    def bf16_params(self) -> bool:
        """bf16 parameters with fp32 masters (2 + 4 + 12 bytes per parameter)."""
        return self.precision in ("bf16-master", "fp8-master")

    @property
    def float8(self) -> bool:
        """torchao Float8Linear in the blocks' linear layers."""
        return self.precision in ("fp8", "fp8-master")

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.layout.batch_readers)

    @property
    def fsdp(self) -> bool:
        return self.layout.data_shard > 1

    @classmethod
    def from_train_config(cls, cfg, model: ModelConfig | HybridConfig, layout: ParallelLayout,
                          precision: str | None = None, recompute: str | None = None) -> PlanSpec:
        """From a TrainConfig (tessera.trainer.config): batch, sequence, precision, recompute, options."""
        t, p = cfg.training, cfg.parallel
        if precision is None:
            precision = t.precision
            if precision == "fp16":  # the trainer's fp16 is autocast over fp32 weights, as its bf16
                precision = "bf16"
            if precision in ("bf16", "fp8") and layout.data_shard > 1 and p.fsdp_param_dtype == "bfloat16":
                precision += "-master"
        return cls(model=model, layout=layout, seq_len=t.seq_length, micro_batch=t.micro_batch_size,
                   global_batch=t.global_batch_size, precision=precision,
                   recompute=recompute or t.recompute, sequence_parallel=p.sequence_parallel,
                   packed_documents=cfg.data.reset_attention_mask,
                   distributed_optimizer=p.distributed_optimizer, cpu_offload=p.fsdp_cpu_offload,
                   bucket_numel=p.bucket_numel)
