"""Learning-rate schedules as pure functions of the step.

Because the rate depends only on the step number and the config, resuming needs no scheduler
state beyond the step (which the checkpoint holds) and a resumed run follows the same curve.
"""

from __future__ import annotations

import math

from tessera.trainer.config import OptimConfig, ScheduleConfig


class LRSchedule:
    """lr(step) for the step about to be taken (0-based): warmup, then cosine/linear/constant/wsd."""

    def __init__(self, schedule: ScheduleConfig, optim: OptimConfig, total_steps: int):
        self.cfg = schedule
        self.lr = optim.lr
        self.min_lr = optim.min_lr
        self.total_steps = total_steps
        self.warmup = schedule.warmup_steps
        self.decay_steps = schedule.decay_steps or max(1, total_steps - self.warmup)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        kind = self.cfg.kind
        if kind == "constant":
            return self.lr
        if kind == "wsd":
            decay_len = max(1, round(self.cfg.decay_fraction * self.total_steps))
            decay_start = max(self.warmup, self.total_steps - decay_len)
            if step < decay_start:
                return self.lr
            progress = min(1.0, (step - decay_start + 1) / decay_len)
            return self.lr - (self.lr - self.min_lr) * progress
        progress = min(1.0, (step - self.warmup) / self.decay_steps)
        if kind == "linear":
            return self.lr - (self.lr - self.min_lr) * progress
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))
