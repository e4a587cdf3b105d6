"""The engine: requests in, tokens out, one batched model step at a time.

`LLMEngine` is synchronous and single-threaded: `add_request`, `abort`, `step`. The server drives
it with `loop.run_engine_loop` (in a thread or in its own process); `tessera-generate`
drives it directly. Each `step` is vLLM v1's three parts: the scheduler returns a plan
(`SchedulerOutput`), the model runner executes it (`ModelRunnerOutput`: sampled tokens,
logprobs), and the output processor applies the results to the sequences and reports what
each request gained (`RequestOutput`). With speculative decoding (`EngineConfig.speculative`,
spec_decode/proposers.py) a proposer then drafts tokens for the next step to verify. If executing a plan
raises, each of its sequences is executed alone, and only those that still fail end (with an
error); the engine goes on. With async scheduling (`EngineConfig.async_scheduling`) a step's plan is
launched before the step still on the device is applied, its input tokens read there
(`Scheduler.schedule_ahead`, `ModelRunner.launch`), so the host's work runs beside the forward.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field

import torch

from tessera.common.errors import UserError
from tessera.common.fileio import artifact_path
from tessera.common.tokenizer import TOKENIZER_JSON
from tessera.inference.config import EngineConfig
from tessera.inference.core.detokenizer import IncrementalDetokenizer
from tessera.inference.core.generation_defaults import resolve_defaults
from tessera.inference.core.image_inputs import check_image_spans
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.core.scheduler import Scheduler, SchedulerOutput
from tessera.inference.core.sequence import Sequence, Status
from tessera.inference.engine.output_processor import OutputProcessor, RequestOutput
from tessera.inference.sample.structured import Grammars
from tessera.inference.spec_decode.proposers import build_proposer, drafter_block_bytes
from tessera.inference.worker.batch import LaunchedStep, ModelRunnerOutput
from tessera.inference.worker.cpu_linear import pack_linears
from tessera.inference.worker.cpu_threads import Binding
from tessera.inference.worker.cuda_graphs import (
    GraphSpec,
    check_cuda_graphs,
    decode_graph_mode,
    default_capture_sizes,
    has_moe_layers,
)
from tessera.inference.worker.kinds import serving_kind
from tessera.inference.worker.kv_cache import kv_cache_dtype
from tessera.inference.worker.loader import LoadedModel, check_expert_parallel
from tessera.inference.worker.model_runner import ModelRunner
from tessera.inference.worker.multimodal.info import vision_info
from tessera.inference.worker.pooling.runner import check_pooling, embed_problem, embedding_spec
from tessera.inference.worker.prepare import ServingPrep, serving_runner
from tessera.inference.worker.tensor_parallel.executor import WorkerDied

__all__ = ["EngineStats", "LLMEngine", "RequestOutput", "RequestRejected", "validate_request"]
COMPUTE_FAILED = "internal error while computing this request"

log = logging.getLogger("tessera.inference")


class RequestRejected(UserError):
    """A request the engine cannot serve as asked (too long, bad token ids); HTTP 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    step_tokens: int = 0  # tokens computed by the last step
    # Speculative decoding, cumulative (spec_decode/stats.SpecDecodeStats; zeros without it).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


def serving_prep(cfg: EngineConfig) -> ServingPrep:
    """How the engine's models (its own, each tensor-parallel shard, the draft) are prepared (prepare.py)."""
    return ServingPrep(cpu_linear=cfg.cpu_linear, compile=cfg.compile_on_cpu, explicit=cfg.cpu_compile is True,
                       quantized=cfg.quantization is not None, batch_hint=cfg.max_num_seqs)


def pool_blocks(cfg: EngineConfig, loaded: LoadedModel, kv_dtype: torch.dtype, dtype: torch.dtype | None = None,
                drafter_bytes: int = 0, scratch_slot: bool = False) -> int:
    """Blocks of the KV pool. Sized by kv_cache_memory, a per-sequence state pool (hybrid models:
    max_num_seqs slots, one more with `scratch_slot`, the padding rows' of padded decode steps;
    states in the model's `dtype`) comes out of the same budget first, and each
    block also pays for its twin in the speculative drafter's cache (`drafter_bytes` per block:
    proposers.drafter_block_bytes), which has as many blocks."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if cfg.kv_cache_tokens is not None:
        return -(-cfg.kv_cache_tokens // cfg.block_size)
    # Under tensor parallel kv_cache_memory is per rank, which holds 1/tp of the key/value heads
    # (one, replicated, when tp > kv_heads); fp8 (--kv-cache-dtype) fits 4x fp32's blocks.
    runner = serving_kind(loaded.config).runner
    per_rank = runner.block_bytes(loaded.config, cfg.block_size, kv_dtype, cfg.tensor_parallel) + drafter_bytes
    slots = cfg.max_num_seqs + scratch_slot
    states = slots * runner.state_bytes_per_sequence(loaded.config, dtype or kv_dtype, cfg.tensor_parallel)
    budget = cfg.kv_cache_memory - states
    if states and budget < max(per_rank, 1):
        scratch = " and the padding rows' scratch slot" if scratch_slot else ""
        raise UserError(f"--kv-cache-memory {cfg.kv_cache_memory}: the state pool of this hybrid model's Mamba layers "
                        f"takes {states} bytes ({cfg.max_num_seqs} sequences, --max-num-seqs{scratch}) and leaves no "
                        "room for KV blocks; raise --kv-cache-memory or lower --max-num-seqs")
    if per_rank == 0:  # no attention layer (an all-Mamba model): blocks are bookkeeping only, and free
        return cfg.max_num_seqs * -(-loaded.config.max_seq_len // cfg.block_size)
    return max(1, budget // per_rank)


# Host bytes the block manager keeps per block (refcount, hash, the free list's entry): 139
# measured with tracemalloc at a million blocks (CPython 3.11).
BOOKKEEPING_BYTES = 140


def check_pool_fits(cfg: EngineConfig, loaded: LoadedModel, blocks: int, kv_dtype: torch.dtype, drafter_bytes: int,
                    device: torch.device) -> None:
    """Refuse a KV pool larger than the memory that would hold it, before anything is allocated: a
    pool sized by a huge --num-kv-blocks / --kv-cache-tokens / --kv-cache-memory otherwise ends in a
    MemoryError traceback (or the OOM killer). Each rank's blocks are on its device (on the host for
    CPU, all ranks together), and the block manager keeps a few host bytes per block."""
    per_rank = serving_kind(loaded.config).runner.block_bytes(loaded.config, cfg.block_size, kv_dtype,
                                                              cfg.tensor_parallel) + drafter_bytes
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    on_host = device.type == "cpu"
    need = blocks * per_rank * (cfg.tensor_parallel if on_host else 1) + blocks * BOOKKEEPING_BYTES * on_host
    have = host if on_host else torch.cuda.get_device_properties(device).total_memory
    if need > have or blocks * BOOKKEEPING_BYTES > host:
        flag = ("--num-kv-blocks", cfg.num_kv_blocks) if cfg.num_kv_blocks is not None else (
            ("--kv-cache-tokens", cfg.kv_cache_tokens) if cfg.kv_cache_tokens is not None
            else ("--kv-cache-memory", cfg.kv_cache_memory))
        ranks = f" over {cfg.tensor_parallel} ranks" if on_host and cfg.tensor_parallel > 1 else ""
        where = "this machine's memory" if on_host else f"{device}'s memory"
        raise UserError(f"{flag[0]} {flag[1]}: a KV cache of {blocks:,} blocks x {cfg.block_size} tokens takes "
                        f"{max(need, blocks * BOOKKEEPING_BYTES) / 2**30:,.1f} GiB{ranks}, more than the "
                        f"{(have if need > have else host) / 2**30:,.1f} GiB of {where}; lower it")


def _forward_reads_back(config) -> str | None:
    """What a model's own forward reads back to the host each step (None: nothing), which stalls a
    launched step (async scheduling)."""
    if has_moe_layers(config):
        return "its experts' token counts (mixture of experts)"
    scaling = getattr(config, "rope_scaling", None)
    if scaling is not None and scaling.rope_type == "dynamic":
        return "the longest position (dynamic RoPE)"
    return None


def validate_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                     eos_ids: frozenset[int] = frozenset(), scores_prompts: bool = True) -> None:
    """Raise RequestRejected if the request can never be served (the HTTP process checks this
    before a request reaches the engine, wherever the engine runs; the engine checks again).
    `scores_prompts` False: prompt logprobs are refused (an encoder-decoder's prompt is its encoder input)."""
    if not prompt_ids:
        raise RequestRejected("the prompt is empty; send at least one token", "prompt")
    if params.prompt_logprobs and not scores_prompts:
        raise RequestRejected("this model is an encoder-decoder: its prompt is the encoder's input, which it does "
                              "not score; drop echo with logprobs (PUT /api: logprobs)", "logprobs")
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
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, device: torch.device, dtype: torch.dtype,
                 worker_threads: tuple[Binding, ...] | None = None):
        """`worker_threads`: each tensor-parallel worker's torch threads and CPUs (worker/cpu_threads.py);
        default: the calling process's thread count, unbound."""
        self.loaded = loaded
        self.cfg = cfg
        self.device = device
        self.tokenizer = loaded.tokenizer
        model_max = loaded.config.max_seq_len
        # A kind without a position table (T5) takes any length; its runner says what to default to.
        default = min(model_max, getattr(serving_kind(loaded.config).runner, "default_max_model_len", model_max))
        self.max_model_len = min(cfg.max_model_len or default, model_max)
        if cfg.max_model_len is not None and cfg.max_model_len > model_max:
            raise UserError(f"--max-model-len {cfg.max_model_len} exceeds the model's max_seq_len ({model_max})")
        self.generates = serving_kind(loaded.config).generates  # False: embeddings only (an encoder)
        self.scores_prompts = serving_kind(loaded.config).scores_prompts  # False: an encoder-decoder
        check_cuda_graphs(cfg, device, loaded.config)
        graphs = decode_graph_mode(cfg, device, loaded.config) if self.generates else "off"
        self.kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, dtype, device)
        drafter = drafter_block_bytes(cfg.speculative, loaded.config, cfg.block_size, self.kv_dtype, dtype)
        pool = pool_blocks(cfg, loaded, self.kv_dtype, dtype, drafter, scratch_slot=graphs != "off")
        check_pool_fits(cfg, loaded, pool, self.kv_dtype, drafter, device)
        # With decode graphs the pool's last block is the padding rows' scratch block: never handed out.
        num_blocks = pool - (graphs != "off")
        need = -(-self.max_model_len // cfg.block_size)
        if num_blocks < need:
            raise UserError(
                f"KV cache of {num_blocks} blocks x {cfg.block_size} tokens cannot hold one sequence of "
                f"max_model_len={self.max_model_len} tokens ({need} blocks); raise --kv-cache-memory / "
                "--num-kv-blocks or lower --max-model-len")
        kind = serving_kind(loaded.config)
        if cfg.enable_expert_parallel:
            check_expert_parallel(cfg.tensor_parallel, loaded.config, str(loaded.path))
        if cfg.speculative is not None and not kind.runner.supports_speculative:
            why = getattr(kind.runner, "speculative_refusal", "a rejected draft would leave its Mamba states past the "
                          "accepted tokens")
            raise UserError(f"--speculative-config: model kind {loaded.config.kind!r} cannot verify draft tokens "
                            f"({why}); drop the flag")
        self.blocks = kind.cache(num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.prefix_cache_hash,
                                 **kind.cache.engine_kwargs(cfg))
        if cfg.async_scheduling and not kind.runner.keeps_decode_batch():
            raise UserError(f"--async-scheduling: model kind {loaded.config.kind!r} builds its decode steps "
                            "otherwise than from the persistent decode batch that async scheduling feeds; drop the flag")
        self.scheduler = Scheduler(self.blocks, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.processor = OutputProcessor(self.scheduler, self.blocks)
        self.proposer = None
        if cfg.speculative is not None:
            self.proposer = build_proposer(cfg.speculative, self.max_model_len, num_blocks, cfg.block_size, device,
                                           dtype, serving_prep(cfg), skip_checksum_verify=cfg.skip_checksum_verify)
        self.eos_ids = frozenset(loaded.eos_ids)
        # What the HTTP server fills into requests that leave sampling fields out (--generation-config).
        self.generation_defaults = resolve_defaults(loaded.generation, cfg.generation_config,
                                                    cfg.override_generation_config, loaded.generation_source)
        self.requests: dict[str, Sequence] = {}
        self._seeds = random.Random(cfg.seed)  # seeds for requests that bring none
        self._step_tokens = 0
        self._inflight: LaunchedStep | None = None  # async scheduling: the step launched, not yet applied
        # Masks as wide as the logits (the head's rows, padding included: llguidance fills a bitmask
        # only at its tokenizer's width, and a launched step's masks go into rows of the logits' width);
        # the padding ids are no token, so every grammar disallows them.
        self.grammars = Grammars(artifact_path(loaded.tokenizer.directory, TOKENIZER_JSON).read_text(),
                                 loaded.config.vocab_rows, sorted(self.eos_ids))
        check_pooling(loaded, self.generates)  # an encoder without pooling: refused before any worker starts
        self.vision = vision_info(loaded)  # None: a text-only model (image parts are refused); a bad processor file: here
        # Last: under tensor parallel this starts the workers, so nothing after it can fail and
        # leave them running.
        if hasattr(self.proposer, "check"):  # a draft reading the target's hidden states (MTP): refused before workers
            self.proposer.check(loaded.config, cfg.tensor_parallel)
        graph_spec = None
        if graphs != "off":
            graph_spec = GraphSpec(cfg.cuda_graph_sizes or default_capture_sizes(cfg.max_num_seqs), max_blocks=need,
                                   scratch_block=pool - 1, capture=graphs == "capture")
        if cfg.async_scheduling and device.type != "cuda" and cfg.tensor_parallel == 1:
            log.warning("--async-scheduling on %s: the forward runs when a step is launched, so nothing overlaps "
                        "it and each output waits one step more; the flag is meant for CUDA", device.type)
        elif cfg.async_scheduling and cfg.tensor_parallel == 1 and (reads := _forward_reads_back(loaded.config)):
            log.warning("--async-scheduling: this model's forward reads %s back to the host, which waits there "
                        "for the step before, so little overlaps and each output waits one step more", reads)
        self.runner = self._runner(loaded, cfg, pool, device, dtype, self.kv_dtype, graph_spec, worker_threads)
        try:
            if hasattr(self.proposer, "attach"):  # a draft reading the target's hidden states (MTP)
                self.proposer.attach(self.runner)
            self.pooling = embedding_spec(loaded, cfg, self.max_model_len, self.runner)  # None: no /v1/embeddings
        except BaseException:
            self.close()  # the workers just started: none may outlive a failed start
            raise

    @staticmethod
    def _runner(loaded: LoadedModel, cfg: EngineConfig, num_blocks: int, device: torch.device,
                dtype: torch.dtype, kv_dtype: torch.dtype, graphs: GraphSpec | None,
                worker_threads: tuple[Binding, ...] | None = None) -> ModelRunner:
        """The model runner; with `graphs`, its decode graphs (captured here, or by each
        tensor-parallel worker over its shard)."""
        kind = serving_kind(loaded.config)
        if not kind.generates:  # an encoder: no KV pool, no compiled stack (worker/pooling/encoder.py)
            if cfg.tensor_parallel > 1:  # the workers hold the shards and pool
                from tessera.inference.worker.pooling.encoder import TensorParallelEncoderRunner
                from tessera.inference.worker.tensor_parallel.executor import TensorParallelExecutor

                assert loaded.path is not None
                return TensorParallelEncoderRunner(TensorParallelExecutor(
                    loaded.path, loaded.hf, loaded.config, cfg.tensor_parallel, 0, cfg.block_size, device, dtype,
                    prep=serving_prep(cfg), bindings=worker_threads, pooling=True), device)
            assert loaded.model is not None
            if device.type == "cpu" and cfg.quantization is None:  # oneDNN-prepacked weights, as prepare.py does
                pack_linears(loaded.model, cfg.cpu_linear, batch_hint=cfg.max_num_seqs)
            return kind.runner(loaded.model, 0, cfg.block_size, device, dtype)
        if cfg.tensor_parallel == 1:
            assert loaded.model is not None
            runner = serving_runner(loaded.model, serving_prep(cfg), num_blocks, cfg.block_size, device, dtype,
                                    kv_dtype=kv_dtype)
            if graphs is not None:
                runner.use_decode_graphs(graphs)
            return runner
        from tessera.inference.worker.tensor_parallel.executor import TensorParallelExecutor
        from tessera.inference.worker.tensor_parallel.runner import TensorParallelRunner

        assert loaded.path is not None
        # a decode or verify step's rows come back through the shared buffer (worker/tensor_parallel/logits_mailbox.py)
        verify = 1 + (cfg.speculative.num_speculative_tokens if cfg.speculative is not None else 0)
        executor = TensorParallelExecutor(loaded.path, loaded.hf, loaded.config, cfg.tensor_parallel, num_blocks,
                                          cfg.block_size, device, dtype, cfg.kv_cache_dtype, graphs,
                                          serving_prep(cfg), worker_threads,
                                          expert_parallel=cfg.enable_expert_parallel,
                                          logits_rows=cfg.max_num_seqs * verify)
        return TensorParallelRunner(executor, device)

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling the CPU layer stacks at start (the model's and the draft's; 0: eager)."""
        runners = [self.runner, getattr(self.proposer, "runner", None)]
        return sum(r.compiled.seconds for r in runners if getattr(r, "compiled", None) is not None)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine is unusable afterwards)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    # ---- requests --------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected if the request can never be served; safe from any thread."""
        validate_request(prompt_ids, params, self.loaded.config.vocab_size, self.max_model_len, self.eos_ids,
                         self.scores_prompts)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        self.validate(prompt_ids, params)
        if params.embed and (problem := embed_problem(self.pooling, len(prompt_ids))):
            raise RequestRejected(problem, "input")
        if problem := check_image_spans(params.images, prompt_ids, getattr(self.loaded.config, "image_token_id", None)):
            raise RequestRejected(problem, "messages")
        if not params.embed and not self.generates:
            raise RequestRejected("this model is an encoder: it serves /v1/embeddings only", "model")
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
        if params.structured is not None:
            try:
                seq.matcher = self.grammars.matcher(params.structured)
            except ValueError as exc:
                raise RequestRejected(f"the structured output grammar is invalid: {exc}", "response_format") from None
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def stats(self) -> EngineStats:
        spec = self.processor.spec_stats
        return EngineStats(
            spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens, spec_accepted_per_pos=list(spec.accepted_per_pos),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_used, kv_blocks_total=self.blocks.num_blocks,
            prefix_queries=self.blocks.prefix_queries, prefix_hits=self.blocks.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, step_tokens=self._step_tokens,
        )

    # ---- one iteration ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._inflight is not None:
            return self._step_overlapped()
        plan = self.scheduler.schedule()
        self._step_tokens = plan.num_tokens
        if not plan.scheduled:
            return []
        # The grammar masks of the sequences about to be sampled are computed while the model
        # forward runs; the matchers advance (processor.update) only after the mask thread is idle.
        self.grammars.compute_ahead([s.seq for s in plan.scheduled
                                     if s.seq.matcher is not None and s.completes_prompt and s.seq.params.max_tokens > 0])
        if self.cfg.async_scheduling and self._overlappable(plan):
            self._inflight = self._launch(plan)
            if self._inflight is not None:
                return self._step_overlapped()  # its grammar rows are sampled first, from the masks just started
        try:
            result = self._execute(plan)
        finally:
            self.grammars.wait()
        outputs, finished = self.processor.update(plan, result)
        for seq in finished:
            self.requests.pop(seq.request_id, None)
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)  # drafts for the next step to verify
        return outputs

    # ---- async scheduling: one step in flight while the next is planned and launched ----------
    @staticmethod
    def _launchable(seq: Sequence) -> bool:
        """Whether a step with this sequence can be launched ahead (`ModelRunner.launch`): it samples,
        and nothing but tokens comes back (no prompt logprobs, embedding, image tokens still to compute
        or drafts). A grammar's row is launched too: its sampling waits for its mask (`_finish_sampling`)."""
        p = seq.params
        # A request with images once its image tokens are all computed: what is left is text.
        return (p.max_tokens > 0 and not p.prompt_logprobs and not p.embed and not seq.spec_token_ids
                and (not p.images or seq.num_computed >= max(im.end for im in p.images)))

    def _overlappable(self, plan: SchedulerOutput) -> bool:
        return all([self._launchable(s.seq) for s in plan.scheduled])

    def _launch(self, plan: SchedulerOutput, previous: LaunchedStep | None = None,
                rows: list[int | None] | None = None) -> LaunchedStep | None:
        """Launch a step ahead (None if that raised: a plan from `schedule` is then executed as without
        async scheduling, which finds the request to blame; one from `schedule_ahead` is dropped and
        the next step planned afresh)."""
        try:
            return self.runner.launch(plan, previous, rows)
        except WorkerDied:
            raise
        except Exception:
            log.exception("launching a decode step ahead failed; it is executed again")
            return None

    def _finish_sampling(self, step: LaunchedStep) -> None:
        """Sample a launched step's grammar rows, their matchers advanced by every token before
        (`LaunchedStep.finish_sampling`). A row whose mask or sampling raises fails its own request,
        as `Sampler.__call__`'s failures do; if finishing raises as a whole, those rows' requests fail."""
        try:
            failed = step.finish_sampling()
        except WorkerDied:
            raise
        except Exception:
            log.exception("sampling the structured-output rows of a launched step failed")
            step.fail_deferred()
            return
        for rid, exc in failed.items():
            log.error("request %s: sampling failed: %s: %s", rid, type(exc).__name__, exc)

    def _step_overlapped(self) -> list[RequestOutput]:
        """With a step in flight: plan and launch the one after it (`Scheduler.schedule_ahead`), then
        wait for the tokens of the one in flight and apply them. The device runs the next step
        meanwhile, so the host's work (the update below, emitting outputs, the next plan) happens
        beside the forward. Grammar rows of the next step are sampled after the update has advanced
        their matchers (at the start of the next call, their masks computed meanwhile), while the
        device may still run its forward (vLLM's order); only then is the step after it launched.
        When the next step cannot be planned ahead, nothing is launched and the next call plans it
        as without async scheduling."""
        current = self._inflight
        assert current is not None
        if current.deferred is not None:  # its grammar rows, their masks started when the step before was applied
            try:
                self._finish_sampling(current)
            finally:
                self.grammars.wait()
        # Its rows are `current`'s, whose sequences were launchable, and admissions `_launchable` accepted.
        ahead = self.scheduler.schedule_ahead(current.plan, current.sampled, self._launchable)
        self._inflight = None if ahead is None else self._launch(ahead[0], current, ahead[1])
        plan = current.plan
        self._step_tokens = plan.num_tokens
        result = current.output()
        # A sequence that finished (a stop in the step before) or was aborted since this step was
        # planned: its row's token is dropped.
        done = Status.FINISHED
        live = [s for s in plan.scheduled if s.seq.status is not done]
        outputs: list[RequestOutput] = []
        if live:
            if len(live) != len(plan.scheduled):
                plan = SchedulerOutput(live, plan.single_token, plan.epoch)
            outputs, finished = self.processor.update(plan, result)
            for seq in finished:
                self.requests.pop(seq.request_id, None)
        if self._inflight is not None and self._inflight.deferred is not None:
            # The matchers have advanced: the launched step's grammar masks are computed on the mask
            # thread while these outputs go out, and its grammar rows sampled when the next call
            # starts, before the step after it is planned. A row whose sequence has finished gets no mask.
            self.grammars.compute_ahead([seq for seq in self._inflight.deferred.waiting() if not seq.is_finished])
        return outputs

    def _execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return self.runner.execute(plan)
        except WorkerDied:
            raise  # no request is to blame, and no retry can succeed: the engine ends
        except Exception:
            if len(plan.scheduled) == 1:
                log.exception("request %s failed", plan.scheduled[0].seq.request_id)
                return ModelRunnerOutput(failed={plan.scheduled[0].seq.request_id: COMPUTE_FAILED})
        # The forward is batched: find the request that fails by executing each alone (the
        # runner changed no sequence; a retry rewrites the same KV slots).
        result = ModelRunnerOutput()
        for i, s in enumerate(plan.scheduled):
            try:
                result.update(self.runner.execute(plan.only(i)))
            except WorkerDied:
                raise
            except Exception:
                log.exception("request %s failed", s.seq.request_id)
                result.failed[s.seq.request_id] = COMPUTE_FAILED
        return result

    # ---- offline ---------------------------------------------------------------------------
    def run_to_completion(self, on_output=None) -> None:
        """Step until every added request has finished (offline generation, tests)."""
        while self.has_unfinished():
            for out in self.step():
                if on_output is not None:
                    on_output(out)
