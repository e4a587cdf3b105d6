"""The engine: requests in, tokens out, one batched model step at a time.

`LLMEngine` is synchronous and single-threaded: `add_request`, `abort`, `step`. The HTTP server
drives it from a background thread (`async_engine.AsyncEngine`); `tessera-generate` drives it
directly. Each `step` asks the scheduler for a batch, runs it through the model runner, samples
for the sequences whose prompt is fully in the cache, and reports what each request gained.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import torch

from tessera.common.errors import UserError
from tessera.inference.block_manager import BlockManager
from tessera.inference.config import EngineConfig
from tessera.inference.detokenizer import IncrementalDetokenizer
from tessera.inference.loader import LoadedModel
from tessera.inference.model_runner import ModelRunner, kv_block_bytes
from tessera.inference.sampler import Sampler, token_logprob
from tessera.inference.sampling_params import SamplingParams
from tessera.inference.scheduler import ScheduledBatch, Scheduler
from tessera.inference.sequence import Sequence, TokenLogprob

log = logging.getLogger("tessera.inference")


class RequestRejected(UserError):
    """A request the engine cannot serve as asked (too long, bad token ids); HTTP 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the final output, when asked
    error: str | None = None  # set (with finished) when computing this request failed; the others go on
    time: float = field(default_factory=time.monotonic)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int


def pool_blocks(cfg: EngineConfig, loaded: LoadedModel, dtype: torch.dtype) -> int:
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if cfg.kv_cache_tokens is not None:
        return -(-cfg.kv_cache_tokens // cfg.block_size)
    return max(1, cfg.kv_cache_memory // kv_block_bytes(loaded.config, cfg.block_size, dtype))


def validate_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                     eos_ids: frozenset[int] = frozenset()) -> None:
    """Raise RequestRejected if the request can never be served (the HTTP process checks this
    before a request reaches the engine, wherever the engine runs; the engine checks again)."""
    if not prompt_ids:
        raise RequestRejected("the prompt is empty; send at least one token", "prompt")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise RequestRejected(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if params.logit_bias and (min(params.logit_bias) < 0 or max(params.logit_bias) >= vocab_size):
        raise RequestRejected(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
    if params.stop_token_ids and (min(params.stop_token_ids) < 0 or max(params.stop_token_ids) >= vocab_size):
        raise RequestRejected(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    if params.min_tokens and params.max_tokens:
        banned = set(params.stop_token_ids) | set(eos_ids)  # the sampler masks EOS even with ignore_eos
        if len(banned) >= vocab_size:
            # min_tokens masks every stop id until it is reached: nothing would be left to sample.
            raise RequestRejected("min_tokens with stop_token_ids (and EOS) covering the whole vocabulary leaves "
                                  "no token to generate; drop min_tokens or some stop_token_ids", "stop_token_ids")
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise RequestRejected(
            f"this model's maximum context length is {max_model_len} tokens, but the request "
            f"has {len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens}; shorten the "
            "prompt or lower max_tokens", "max_tokens")


class LLMEngine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, device: torch.device, dtype: torch.dtype):
        self.loaded = loaded
        self.cfg = cfg
        self.device = device
        self.tokenizer = loaded.tokenizer
        model_max = loaded.config.max_seq_len
        self.max_model_len = min(cfg.max_model_len or model_max, model_max)
        if cfg.max_model_len is not None and cfg.max_model_len > model_max:
            raise UserError(f"--max-model-len {cfg.max_model_len} exceeds the model's max_seq_len ({model_max})")
        num_blocks = pool_blocks(cfg, loaded, dtype)
        need = -(-self.max_model_len // cfg.block_size)
        if num_blocks < need:
            raise UserError(
                f"KV cache of {num_blocks} blocks x {cfg.block_size} tokens cannot hold one sequence of "
                f"max_model_len={self.max_model_len} tokens ({need} blocks); raise --kv-cache-memory / "
                "--num-kv-blocks or lower --max-model-len")
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.runner = ModelRunner(loaded.model, num_blocks, cfg.block_size, device, dtype)
        self.sampler = Sampler()
        self.eos_ids = frozenset(loaded.eos_ids)
        self.requests: dict[str, Sequence] = {}
        self._seeds = random.Random(cfg.seed)  # seeds for requests that bring none

    # ---- requests --------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected if the request can never be served; safe from any thread."""
        validate_request(prompt_ids, params, self.loaded.config.vocab_size, self.max_model_len, self.eos_ids)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        self.validate(prompt_ids, params)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            generator=torch.Generator(device=self.device).manual_seed(seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens),
            eos_ids=self.eos_ids,
            max_model_len=self.max_model_len,
        )
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_used, kv_blocks_total=self.blocks.num_blocks,
            prefix_queries=self.blocks.prefix_queries, prefix_hits=self.blocks.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

    # ---- one iteration ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        try:
            outputs = self._run(batch)
        except Exception:
            if len(batch.seqs) == 1:
                log.exception("request %s failed", batch.seqs[0].request_id)
                outputs = [self._fail(batch.seqs[0])]
            else:
                # The forward is batched: find the request that fails by running each alone
                # (nothing was committed yet; a retry rewrites the same KV slots).
                outputs = []
                for seq, n in zip(batch.seqs, batch.num_new):
                    try:
                        outputs += self._run(ScheduledBatch([seq], [n]))
                    except Exception:
                        log.exception("request %s failed", seq.request_id)
                        outputs.append(self._fail(seq))
        for seq in self.scheduler.remove_finished():
            self.requests.pop(seq.request_id, None)
        return outputs

    def _fail(self, seq: Sequence, error: str = "internal error while computing this request") -> RequestOutput:
        seq.fail(error)
        return self._output(seq)

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Forward, sample and update the sequences of one batch; raises before changing any
        sequence if the forward fails."""
        rows: list[int] = []
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        prompt_lp: list[tuple[Sequence, int, int]] = []  # (seq, first position, first row)
        done_without_sampling: list[Sequence] = []
        offset = 0
        for seq, n in zip(batch.seqs, batch.num_new):
            start, end = seq.num_computed, seq.num_computed + n
            if seq.params.prompt_logprobs:
                # Position p predicts prompt token p+1; record each position once (recompute
                # after preemption must not duplicate).
                first = max(start, len(seq.prompt_logprobs))
                last = min(end, len(seq.prompt_ids) - 1)
                if first < last:
                    prompt_lp.append((seq, first, len(rows)))
                    rows.extend(range(offset + first - start, offset + last - start))
            if end == seq.num_tokens:
                if seq.params.max_tokens == 0:
                    done_without_sampling.append(seq)
                else:
                    sample_seqs.append(seq)
                    sample_rows.append(len(rows))
                    rows.append(offset + n - 1)
            offset += n
        logits = self.runner.execute(batch, rows)
        for seq, n in zip(batch.seqs, batch.num_new):
            seq.num_computed += n
            self.blocks.commit_full_blocks(seq)
        if prompt_lp:
            logprobs = torch.log_softmax(logits, dim=-1)
            for seq, first, row in prompt_lp:
                last = min(seq.num_computed, len(seq.prompt_ids) - 1)
                for p in range(first, last):
                    seq.prompt_logprobs.append(token_logprob(logprobs[row + p - first], seq.prompt_ids[p + 1],
                                                             seq.params.logprobs or 0))
        failed: dict[int, Exception] = {}
        if sample_seqs:
            tokens, failed = self.sampler(sample_seqs, logits[sample_rows])
            for i, (seq, tok) in enumerate(zip(sample_seqs, tokens)):
                if i in failed:
                    log.error("request %s: sampling failed: %s", seq.request_id, failed[i])
                    seq.fail("internal error while sampling this request")
                else:
                    seq.append_token(tok)
        for seq in done_without_sampling:
            seq._finish("length", None)
        return [self._output(seq) for seq in sample_seqs + done_without_sampling]

    def _output(self, seq: Sequence) -> RequestOutput:
        new_logprobs, seq.new_logprobs = seq.new_logprobs, []
        finished = seq.is_finished
        # As in vLLM, an EOS/stop token is part of the ids (and usage) but not of the text.
        new_ids = seq.output_ids[-1:] if seq.output_ids and seq.params.max_tokens else []
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
            prompt_logprobs=list(seq.prompt_logprobs) if finished and seq.params.prompt_logprobs else None,
            error=seq.error,
        )

    # ---- offline ---------------------------------------------------------------------------
    def run_to_completion(self, on_output=None) -> None:
        """Step until every added request has finished (offline generation, tests)."""
        while self.has_unfinished():
            for out in self.step():
                if on_output is not None:
                    on_output(out)
