"""Predicted step time, tokens/s and MFU of a layout on a device: compute from FLOPs, plus the
pipeline bubble, plus the communication that is not hidden behind compute.

* Compute: the model's training FLOPs per token (the kind's `flops_per_token`, the trainer's MFU
  numerator) x tokens per step / ranks, plus what recompute repeats (full: the forward again, a
  third of 6N; selective: the attention core's forward), at `peak x efficiency`. The efficiency
  is the fraction of peak a well-tuned dense matmul-bound step reaches; it is an input
  (`--efficiency`), not a measurement: Megatron-LM's and torchtitan's published Llama 3 runs on
  H100 report 38-55% MFU, so 0.5 is the default.
* Pipeline bubble: (pp - 1) / (v x micro-batches) of the compute (1F1B / interleaved 1F1B).
* Communication, bus bytes over the bandwidth of the group's span (a group whose ranks fit one
  node uses the intra-node figure; rank order tensor, context, expert, data, pipeline):
  tensor parallel (4 all-reduce equivalents of the hidden states per layer per micro-batch, not
  overlapped in Tessera), context parallel (keys and values all-gathered in forward,
  reduce-scattered in backward), pipeline sends (activation forward, gradient back, per
  micro-batch and boundary), data parallel (ZeRO-1: reduce-scatter of fp32 grads overlapped with
  backward, all-gather of parameters after the step, exposed; all-reduce without it), FSDP
  (per micro-batch: parameters gathered in forward and again in backward, gradients
  reduce-scattered, HSDP replicas all-reduced; prefetched, so exposed only beyond compute).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.common.models.registry import kind_of
from tessera.trainer.plan.devices import DeviceSpec
from tessera.trainer.plan.hybrid import attention_layers, attention_sizes, is_hybrid
from tessera.trainer.plan.memory import rank_params
from tessera.trainer.plan.spec import PlanSpec

DEFAULT_EFFICIENCY = 0.5


@dataclass
class TimePlan:
    compute_s: float
    bubble_s: float
    exposed_comm_s: float
    comm: dict[str, float]  # seconds of each kind of communication (exposed or not)
    tokens_per_step: int
    model_flops: float  # per step, all ranks

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_comm_s

    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    def mfu(self, world: int, peak_tflops: float) -> float:
        return self.model_flops / (self.step_s * world * peak_tflops * 1e12)


def _bandwidth(span: int, device: DeviceSpec) -> float:
    return (device.intra_node_gbps if span <= device.devices_per_node else device.inter_node_gbps) * 1e9


def plan_time(spec: PlanSpec, device: DeviceSpec, efficiency: float = DEFAULT_EFFICIENCY) -> TimePlan:
    cfg, lay = spec.model, spec.layout
    tp, cp, ep, dp, pp, v = lay.tensor, lay.context, lay.expert, lay.data, lay.pipeline, lay.virtual_stages
    world, n = lay.world_size, spec.num_microbatches
    tokens = spec.global_batch * spec.seq_len
    model_flops = kind_of(cfg).flops_per_token(cfg, spec.seq_len) * tokens
    extra = 0.0
    if spec.recompute == "full":
        extra = model_flops / 3
    elif spec.recompute == "selective":
        extra = 4.0 * attention_layers(cfg) * attention_sizes(cfg)[0] * spec.seq_len * tokens
    peak = device.peak_tflops * 1e12 * efficiency * (2.0 if spec.float8 else 1.0)
    compute = (model_flops + extra) / world / peak
    bubble = compute * (pp - 1) / (v * n) if pp > 1 else 0.0
    ab = 4.0 if spec.precision == "fp32" else 2.0  # activation bytes on the wire
    layers = cfg.num_layers / pp
    mb_tokens = spec.micro_batch * spec.seq_len // cp
    comm: dict[str, float] = {}
    exposed = 0.0
    if tp > 1:
        # Two all-reduces (or all-gather + reduce-scatter) forward and two backward per sublayer:
        # a decoder block has two (attention, MLP), a hybrid model's layer one.
        sublayers = 1 if is_hybrid(cfg) else 2
        vol = 4 * sublayers * (tp - 1) / tp * mb_tokens * cfg.hidden_size * ab * layers * n
        comm["tensor"] = vol / _bandwidth(tp, device)
        exposed += comm["tensor"]
    if cp > 1:
        vol = 2 * 2 * (cp - 1) / cp * spec.micro_batch * spec.seq_len * attention_sizes(cfg)[1] / tp * ab * layers * n
        comm["context"] = vol / _bandwidth(tp * cp, device)
        exposed += comm["context"]
    if pp > 1:
        vol = 2 * mb_tokens // (tp if spec.sequence_parallel and tp > 1 else 1) * cfg.hidden_size * ab * n * v
        comm["pipeline"] = vol / _bandwidth(world, device)
        exposed += comm["pipeline"]
    params = max(rank_params(spec, r).total for r in range(pp))
    wb = 2.0 if spec.bf16_params else 4.0
    if spec.fsdp:
        # Dense parameters are gathered over data x expert x context ranks, the routed experts
        # (already split over expert ranks) over data x context ranks only.
        shard, eshard = lay.fsdp_shards, lay.fsdp_expert_shards
        experts = max(rank_params(spec, r).experts for r in range(pp))
        moved = (params - experts) * (shard - 1) / shard + experts * (eshard - 1) / eshard  # per gather
        held = (params - experts) / shard + experts / eshard
        bw = _bandwidth(tp * cp * ep * lay.data_shard, device)
        gathered_b = 1.0 if spec.fp8_all_gather and spec.float8 else 2.0 if spec.bf16_params else 4.0
        if pp > 1:  # blocks stay gathered over the step; one reduce-scatter after the last micro-batch
            vol = (gathered_b + 4.0) * moved
        else:
            gathers = 2 if spec.fsdp_reshard_after_forward else 1
            vol = (gathers * gathered_b + 4.0) * moved * n
        comm["fsdp"] = vol / bw
        replicas = lay.data_replicate
        if replicas > 1:
            comm["hsdp replicas"] = 2 * (replicas - 1) / replicas * held * 4.0 * n / _bandwidth(world, device)
        exposed += max(0.0, comm["fsdp"] + comm.get("hsdp replicas", 0.0) - compute)
    elif dp * ep > 1:
        bw = _bandwidth(tp * cp * ep * dp, device)
        # Dense gradients are reduced over data x expert ranks, the routed experts' over data ranks.
        experts = max(rank_params(spec, r).experts for r in range(pp))
        share = (params - experts) * (dp * ep - 1) / (dp * ep) + experts * (dp - 1) / dp
        if spec.distributed_optimizer:
            rs = share * 4.0 / bw
            ag = share * wb / bw
            comm["data (reduce-scatter)"], comm["data (all-gather)"] = rs, ag
            exposed += max(0.0, rs - 2 / 3 * compute) + ag
        else:
            ar = 2 * share * 4.0 / bw
            comm["data (all-reduce)"] = ar
            exposed += max(0.0, ar - 2 / 3 * compute)
    return TimePlan(compute_s=compute, bubble_s=bubble, exposed_comm_s=exposed, comm=comm,
                    tokens_per_step=tokens, model_flops=model_flops)
