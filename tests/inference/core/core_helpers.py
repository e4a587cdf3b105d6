"""Sequences, a scheduler and hand-built runner outputs, without a model: the core's own pieces."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from tessera.common.tokenizer import Tokenizer
from tessera.inference.core.block_manager import BlockManager
from tessera.inference.core.detokenizer import IncrementalDetokenizer
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.core.scheduler import Scheduler, SchedulerOutput
from tessera.inference.core.sequence import Sequence
from tessera.inference.engine.output_processor import OutputProcessor
from tessera.inference.worker.batch import ModelRunnerOutput

VOCAB = 64
_TOKENIZER = Tokenizer(directory=Path("."), fingerprint="core-tests",
                       backend=HFTokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")))


def seq(rid: str, prompt: list[int], max_tokens: int = 8, **params) -> Sequence:
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Sequence(request_id=rid, prompt_ids=list(prompt), params=p, generator=torch.Generator(),
                    detokenizer=IncrementalDetokenizer(_TOKENIZER, p.stop), eos_ids=frozenset(), max_model_len=256)


class Core:
    """Block manager, scheduler and output processor as the engine wires them; `step` schedules
    and applies what a runner would return: `sampled[rid]` for each sequence that samples (a
    sequence that completes its prompt gets token 7 unless `sampled` says otherwise)."""

    def __init__(self, num_blocks: int, block_size: int = 4, budget: int = 64, max_seqs: int = 8,
                 prefix_caching: bool = True):
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, budget, max_seqs)
        self.processor = OutputProcessor(self.scheduler, self.blocks)

    def add(self, *seqs: Sequence) -> None:
        for s in seqs:
            self.scheduler.add(s)

    def step(self, sampled: dict[str, list[int]] | None = None) -> tuple[SchedulerOutput, list[Sequence]]:
        plan = self.scheduler.schedule()
        return plan, self.apply(plan, sampled)

    def apply(self, plan: SchedulerOutput, sampled: dict[str, list[int]] | None = None) -> list[Sequence]:
        """The output processor's update with a runner's result; the sequences that finished."""
        result = ModelRunnerOutput()
        for s in plan.scheduled:
            if s.completes_prompt:
                result.sampled[s.seq.request_id] = (sampled or {}).get(s.seq.request_id, [7])
        return self.processor.update(plan, result)[1]


def ranges(plan: SchedulerOutput) -> dict[str, tuple[int, int]]:
    """request id -> (first position, new tokens) of each scheduled sequence."""
    return {s.seq.request_id: (s.start, s.num_new) for s in plan.scheduled}
