"""The update step: applies what the model runner produced for one plan to the sequences.

For each scheduled sequence: its computed-token count advances and its newly full blocks are
offered to the prefix cache; new prompt logprobs are appended; sampled tokens are appended, one
at a time (stop strings, stop ids, EOS and length checked there, `Sequence.append_token`; with
speculation the accepted drafts and one more token, up to the first that stops the sequence, and
the computed count rolled back past the rejected drafts); a request whose computation failed ends
with its error. Then finished sequences leave the scheduler (freeing their blocks) and each
sequence that produced something gets a `RequestOutput` (deltas since the last).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from tessera.inference.core.block_manager import BlockManager
from tessera.inference.core.scheduler import Scheduler, SchedulerOutput
from tessera.inference.core.sequence import Sequence, Status, TokenLogprob
from tessera.inference.spec_decode.stats import SpecDecodeStats
from tessera.inference.worker.batch import ModelRunnerOutput


@dataclass
class RequestOutput:
    """What one request gained in one step (deltas), plus totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    # When asked: the logprob of every prompt token after the first, on the request's first output
    # (the step that completed its prompt), so a stream can send them before the generated tokens.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # set (with finished) when computing this request failed; the others go on
    client_error: bool = False  # that failure was the request's own doing (HTTP 400, not 500)
    # On the final output: the engine's intervals in seconds (queue, prefill, decode, inference),
    # vLLM's definitions (metrics.py).
    timings: dict[str, float] | None = None
    embedding: list[float] | None = None  # an embed request's pooled vector (on its final output)
    time: float = field(default_factory=time.monotonic)

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This output and the next one of the same request as one (as if one step had made both):
        deltas joined, totals and the end from `later`. The HTTP process merges the outputs a stream
        has not sent yet, so a server behind the engine sends one chunk for several steps."""
        return RequestOutput(
            request_id=self.request_id, new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text, new_logprobs=self.new_logprobs + later.new_logprobs,
            finished=later.finished, finish_reason=later.finish_reason, num_prompt_tokens=later.num_prompt_tokens,
            num_output_tokens=later.num_output_tokens, num_cached_tokens=later.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            error=later.error, client_error=later.client_error, timings=later.timings,
            embedding=later.embedding, time=later.time,
        )


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, blocks: BlockManager):
        self.scheduler = scheduler
        self.blocks = blocks
        self.spec_stats = SpecDecodeStats()

    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> tuple[list[RequestOutput], list[Sequence]]:
        """Apply one executed plan; returns the step's outputs and the sequences that finished."""
        if plan.single_token and not (result.failed or result.logprobs or result.prompt_logprobs or result.pooled):
            return self._update_single_token(plan, result.sampled)
        reporting: list[tuple[Sequence, int]] = []  # (sequence, tokens it gained)
        for s in plan.scheduled:
            seq = s.seq
            rid = seq.request_id
            drafts = len(s.spec_token_ids)
            seq.spec_token_ids, seq.spec_probs = [], None  # verified (or dropped) now; new ones come after
            if rid in result.failed:
                seq.fail(result.failed[rid])
                reporting.append((seq, 0))
                continue
            seq.prompt_logprobs.extend(result.prompt_logprobs.get(rid, []))
            tokens = result.sampled.get(rid)
            if tokens is None:
                seq.num_computed = s.end
                self.blocks.commit_full_blocks(seq)
                seq.embedding = result.pooled.get(rid)
                if s.completes_prompt and seq.params.max_tokens == 0:  # prompt scoring only, or pooled
                    seq._finish("length", None)
                    reporting.append((seq, 0))
                continue
            if drafts:
                # The newest token and the accepted drafts are in the cache; rejected drafts'
                # K/V lie past it, unread, and blocks that held only them go back to the pool.
                accepted = len(tokens) - 1
                self.spec_stats.observe(drafts, accepted)
                seq.num_computed = s.start + 1 + accepted
                self.blocks.trim(seq, seq.num_computed + 1)
            else:
                seq.num_computed = s.end
            if len(tokens) == 1 and seq.matcher is None and not drafts:  # a plain decode step
                lp = result.logprobs.get(rid) if result.logprobs else None
                if lp:
                    seq.new_logprobs.append(lp[0])
                seq.append_token(tokens[0])
                gained = 1
            else:
                gained = self._append(seq, tokens, result.logprobs.get(rid, []))
                # A stop inside the accepted drafts: the K/V past it belong to no token of the sequence
                # (commit_full_blocks must not hash a block from them).
                seq.num_computed = min(seq.num_computed, seq.num_tokens)
            self.blocks.commit_full_blocks(seq)
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            reporting.append((seq, gained))
        outputs = [self.output(seq, n) for seq, n in reporting]
        # Only a sequence of this plan can have finished since the last step (an abort leaves at once).
        return outputs, self.scheduler.remove_finished() if any(o.finished for o in outputs) else []

    def _update_single_token(self, plan: SchedulerOutput, sampled: dict[str, list[int]]
                             ) -> tuple[list[RequestOutput], list[Sequence]]:
        """`update` for a steady decode step in which every sequence sampled (no failure, logprobs,
        drafts or prompt scoring): what `update` and `output` do for such rows, without their other
        branches. Each row computed one token, so a block fills (and is offered to the prefix
        cache) only where that token was a block's last."""
        now = time.monotonic()
        commit, bs = self.blocks.commit_full_blocks, self.blocks.block_size
        outputs: list[RequestOutput] = []
        put, done = outputs.append, Status.FINISHED
        finished_any = False
        for s in plan.scheduled:
            seq = s.seq
            if seq.spec_token_ids or seq.spec_probs is not None:  # drafts proposed, not scheduled: dropped
                seq.spec_token_ids, seq.spec_probs = [], None
            tokens = sampled[seq.request_id]
            seq.num_computed = computed = s.start + 1
            if seq.matcher is None:
                seq.append_token(tokens[0])
            elif not self._append(seq, tokens, []):  # the grammar refused it: the request failed
                outputs.append(self.output(seq, 0, now))
                finished_any = True
                continue
            if computed % bs == 0:
                commit(seq)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.new_logprobs or seq.params.prompt_logprobs and not seq.prompt_logprobs_sent:
                outputs.append(self.output(seq, 1, now))
                finished_any = finished_any or seq.is_finished
                continue
            finished = seq.status is done
            finished_any = finished_any or finished
            # Positional (half the cost of keywords, once per sequence per step): RequestOutput's field order.
            put(RequestOutput(seq.request_id, [tokens[0]], seq.detokenizer.take_new_text(), [], finished,
                              seq.finish_reason, len(seq.prompt_ids), len(seq.output_ids), seq.num_cached_tokens,
                              None, None, False, _timings(seq) if finished else None, None, now))
        return outputs, self.scheduler.remove_finished() if finished_any else []

    @staticmethod
    def _append(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob]) -> int:
        """Append sampled tokens up to the first that stops the sequence; returns how many."""
        gained = 0
        for j, token in enumerate(tokens):
            if seq.matcher is not None and not seq.matcher.consume_token(token):
                _grammar_failed(seq)
                break
            if j < len(logprobs):
                seq.new_logprobs.append(logprobs[j])
            seq.append_token(token)
            gained += 1
            if seq.matcher is not None and not seq.is_finished and seq.matcher.is_stopped():
                seq._finish("stop", None)  # the grammar is complete: nothing may follow
            if seq.is_finished:
                break  # tokens after a stop are never generated
        return gained

    @staticmethod
    def output(seq: Sequence, num_new: int, now: float | None = None) -> RequestOutput:
        new_logprobs, seq.new_logprobs = seq.new_logprobs, []
        finished = seq.is_finished
        # As in vLLM, an EOS/stop token is part of the ids (and usage) but not of the text.
        new_ids = seq.output_ids[len(seq.output_ids) - num_new:] if num_new and seq.error is None else []
        prompt_logprobs = None
        if seq.params.prompt_logprobs and not seq.prompt_logprobs_sent:
            seq.prompt_logprobs_sent = True
            prompt_logprobs = list(seq.prompt_logprobs)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            new_text=seq.detokenizer.take_new_text(),
            new_logprobs=new_logprobs,
            finished=finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids),
            num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            error=seq.error,
            client_error=seq.client_error,
            timings=_timings(seq) if finished else None,
            embedding=seq.embedding,
            time=time.monotonic() if now is None else now,
        )


def _timings(seq: Sequence) -> dict[str, float]:
    now = time.monotonic()
    scheduled = seq.scheduled_time if seq.scheduled_time is not None else now
    first = seq.first_token_time if seq.first_token_time is not None else now
    return {"queue": scheduled - seq.arrival_time, "prefill": first - scheduled, "decode": now - first,
            "inference": now - scheduled}


# llguidance's messages when a grammar outgrows one of its limits mid-generation (ParserLimits,
# structured_limits.py), as opposed to a token the mask should have excluded (our bug).
_LIMIT_HIT = re.compile(r"too many|too complex|max is|limit|fuel", re.IGNORECASE)


def _grammar_failed(seq: Sequence) -> None:
    """The matcher refused the sampled token. A grammar that hit one of llguidance's limits is the
    request's doing: it ends with a 400 naming the limit (vLLM instead ends such an output quietly
    at EOS, not matching the grammar). Any other refusal means the mask was not applied: a 500."""
    error = " ".join(seq.matcher.get_error().replace("<non-verbose/>", "").split())
    if _LIMIT_HIT.search(error):
        seq.fail(f"the structured output grammar hit a limit of the grammar engine after {len(seq.output_ids)} "
                 f"generated tokens: {error[:500]}", client=True)
    else:
        seq.fail("internal error: the structured output grammar rejected the sampled token")
