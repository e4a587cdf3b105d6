"""The parallel layout: how many ways each dimension is split.

Rank order (fastest-varying first): tensor, context, expert, data, pipeline. The process-group
module (tessera.common.parallel) builds groups from this; checkpoints record the layout they were
saved from (for information only: what is stored does not depend on it).
"""

from __future__ import annotations

from pydantic import Field

from tessera.common.config import StrictModel


class ParallelLayout(StrictModel):
    tensor: int = Field(1, ge=1, description="Tensor-parallel size (with sequence parallel when enabled).")
    context: int = Field(1, ge=1, description="Context-parallel size (sequence split across ranks in attention).")
    expert: int = Field(1, ge=1, description="Expert-parallel size (MoE experts split across ranks).")
    data: int = Field(1, ge=1, description="Data-parallel size (replicas; sharded optimizer with the distributed optimizer).")
    pipeline: int = Field(1, ge=1, description="Pipeline-parallel size (stages).")
    virtual_stages: int = Field(1, ge=1, description="Model chunks per pipeline rank (interleaved 1F1B).")

    @property
    def world_size(self) -> int:
        return self.tensor * self.context * self.expert * self.data * self.pipeline

    def short(self) -> str:
        return (f"tp{self.tensor}-cp{self.context}-ep{self.expert}-dp{self.data}-pp{self.pipeline}"
                + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
