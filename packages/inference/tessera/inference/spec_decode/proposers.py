"""Speculative decoding: proposing draft tokens (how many the target accepts: stats.py).

After each step the engine asks a proposer for up to k draft tokens per decoding sequence
(`Sequence.spec_token_ids`); the scheduler gives such a sequence a row of 1 + k tokens; the model
runner scores them in one forward and `sampler.verify` accepts a prefix by exact rejection
sampling; the output processor appends the accepted tokens and one more and rolls the KV cache
back past the rejected ones. So speculation changes how many forwards a sequence takes, never
what it outputs (greedy: the same tokens; sampled: the same distribution).

Three proposers, chosen by `SpeculativeConfig.method` (vLLM's `--speculative-config`):
  - `NgramProposer` (prompt lookup): the tokens that followed the most recent earlier occurrence
    of the sequence's last n tokens (the longest n in [prompt_lookup_min, prompt_lookup_max]).
    No model, CPU only bookkeeping; an index of n-gram positions per sequence grows with the
    tokens, so a proposal costs the same at any length.
  - `DraftModelProposer`: a small model with the same tokenizer proposes k tokens by k forwards,
    drawing each from its own processed distribution (kept for verification). It has its own
    paged KV pool and block manager (a second `ModelRunner` over the draft model, the same code
    as the target's, so chunked catch-up, batching and decode grouping come for free; a
    contiguous per-sequence cache would have been a second attention path to test). Its cache
    of a sequence is valid up to the target's newest token minus one (positions before it hold
    the sequence's tokens or accepted drafts), so after verification only the count is rolled back.
  - `MTPProposer` (method mtp, vLLM's deepseek_mtp; spec_decode/mtp.py): the target's own
    multi-token-prediction modules (DeepSeek-V3) over the target's hidden states, on one device or
    on the tensor-parallel workers.

Requests that speculate: any without structured output (the grammar matcher would have to be
advanced through drafts and rolled back; such requests decode one token per step, exactly as
without speculation, in the same batches as speculating ones).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from tessera.common.errors import UserError
from tessera.inference.config import SpeculativeConfig
from tessera.inference.core.block_manager import BlockManager
from tessera.inference.core.scheduler import ScheduledSequence, SchedulerOutput
from tessera.inference.core.sequence import Sequence
from tessera.inference.sample.sampler import Hypothetical, pick, sampling_row
from tessera.inference.spec_decode.mtp import MTPProposer, num_drafts_for
from tessera.inference.worker.prepare import ServingPrep, serving_runner

log = logging.getLogger("tessera.inference")


class NgramProposer:
    """Prompt lookup (vLLM's "ngram"): propose the tokens that followed the most recent earlier
    occurrence of the longest suffix of n tokens, prompt_lookup_min <= n <= prompt_lookup_max."""

    # Earlier occurrences of the shortest n-gram examined per proposal (the most recent ones):
    # bounds the cost on very repetitive sequences.
    MAX_CANDIDATES = 16

    def __init__(self, cfg: SpeculativeConfig):
        assert cfg.prompt_lookup_min is not None and cfg.prompt_lookup_max is not None
        self.k = cfg.num_speculative_tokens
        self.lo = cfg.prompt_lookup_min
        self.hi = cfg.prompt_lookup_max
        # request id -> (token list, positions where each lo-gram ends, tokens indexed)
        self._index: dict[str, tuple[list[int], dict[tuple[int, ...], list[int]], list[int]]] = {}

    def propose(self, running: list[Sequence]) -> None:
        live = {s.request_id for s in running}
        for rid in [r for r in self._index if r not in live]:
            del self._index[rid]
        for seq in running:
            n = num_drafts_for(seq, self.k)
            seq.spec_token_ids = self.lookup(seq, n) if n else []
            seq.spec_probs = None

    def lookup(self, seq: Sequence, n: int) -> list[int]:
        tokens, ends, done = self._index.setdefault(seq.request_id, ([], {}, [0]))
        tokens.extend(seq.tokens(len(tokens), seq.num_tokens))
        size = len(tokens)
        lo = self.lo
        # Index every lo-gram ending before the last token (one ending at the last token is the
        # suffix itself and has nothing after it).
        for end in range(max(done[0], lo - 1), size - 1):
            ends.setdefault(tuple(tokens[end - lo + 1:end + 1]), []).append(end)
        done[0] = max(done[0], size - 1)
        if size <= lo:
            return []
        candidates = ends.get(tuple(tokens[size - lo:]))
        if not candidates:
            return []
        best_end, best_len = -1, 0
        for end in reversed(candidates[-self.MAX_CANDIDATES:]):
            length = lo
            while length < self.hi and end - length >= 0 and tokens[end - length] == tokens[size - 1 - length]:
                length += 1
            if length > best_len:
                best_end, best_len = end, length
                if length == self.hi:
                    break
        return tokens[best_end + 1:best_end + 1 + n]


class DraftModelProposer:
    """A small model with the target's tokenizer proposes k tokens per sequence (k forwards of
    the decoding sequences together), each drawn as the request's sampler would draw from the
    draft's logits; the draft distributions are kept for verification."""

    def __init__(self, cfg: SpeculativeConfig, model, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, prep: ServingPrep | None = None):
        self.k = cfg.num_speculative_tokens
        # Prepared as the target is (prepare.py); the draft loads unquantized.
        self.runner = serving_runner(model, replace(prep or ServingPrep(), quantized=False), num_blocks, block_size,
                                     device, dtype, what="draft model")
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.computed: dict[str, int] = {}  # request id -> positions whose draft K/V are valid
        self.seqs: dict[str, Sequence] = {}

    def release(self, rid: str) -> None:
        self.blocks.free_seq(self.seqs.pop(rid))
        self.computed.pop(rid, None)

    @torch.inference_mode()
    def propose(self, running: list[Sequence]) -> None:
        live = {s.request_id for s in running}
        for rid in [r for r in self.seqs if r not in live]:
            self.release(rid)
        want: dict[str, int] = {}
        for seq in running:
            seq.spec_token_ids, seq.spec_probs = [], None
            n = num_drafts_for(seq, self.k)
            # Positions fed to the draft: the sequence's tokens, then all drafts but the last.
            if n and self.blocks.allocate(seq, seq.num_tokens + n - 1):
                self.seqs[seq.request_id] = seq
                want[seq.request_id] = n
        seqs = [s for s in running if s.request_id in want]
        if not seqs:
            return
        views = {s.request_id: Hypothetical.of(s) for s in seqs}
        probs: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in seqs}
        for j in range(max(want.values())):
            active = [s for s in seqs if want[s.request_id] > j]
            plan = []
            for s in active:
                rid = s.request_id
                if j == 0:  # catch up on every token the draft has not seen (a prompt, accepted drafts)
                    start = min(self.computed.get(rid, 0), s.num_tokens - 1)
                    n = s.num_tokens - start
                else:
                    start, n = s.num_tokens + j - 1, 1
                plan.append(ScheduledSequence(s, start, n, list(self.blocks.table(s)),
                                              spec_token_ids=list(s.spec_token_ids)))
            rows, offset = [], 0
            for p in plan:
                offset += p.num_new
                rows.append(offset - 1)
            logits = self.runner.forward(SchedulerOutput(plan), rows)
            for s, p, row in zip(active, plan, logits):
                view = views[s.request_id]
                token, q = pick(sampling_row(row, view), s.params, s.generator)
                s.spec_token_ids.append(token)
                view.output_ids.append(token)
                if q is not None:
                    probs[s.request_id].append(q)
                self.computed[s.request_id] = p.end
        for s in seqs:
            if probs[s.request_id]:
                s.spec_probs = torch.stack(probs[s.request_id])


def read_model_facts(path: str | Path):
    """(ModelConfig, tokenizer directory) of a checkpoint or HF directory, reading no weights."""
    from tessera.common.checkpoint import SIDECAR, checkpoint_tokenizer_dir, read_sidecar, resolve_checkpoint
    from tessera.common.errors import ArtifactError
    from tessera.common.hf.directory import is_hf_directory, read_hf_config

    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path}: checkpoint not found")
    if path.is_dir() and is_hf_directory(path) and not (path / SIDECAR).is_file():
        return read_hf_config(path)[0], path
    ckpt = resolve_checkpoint(path)
    return read_sidecar(ckpt).model, checkpoint_tokenizer_dir(ckpt)


def check_draft_model(cfg: SpeculativeConfig | None, target: str | Path) -> None:
    """Refuse a draft model that cannot propose for the target, before any weight is read: its
    tokenizer must map the same tokens to the same ids and its vocabulary be the same size."""
    if cfg is None or cfg.method != "draft_model":
        return
    from tessera.common.tokenizer import load_tokenizer

    assert cfg.model is not None
    draft_cfg, draft_tok_dir = read_model_facts(cfg.model)
    target_cfg, target_tok_dir = read_model_facts(target)
    where = f"--speculative-config model {cfg.model}"
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise UserError(f"{where}: the draft model's vocabulary has {draft_cfg.vocab_size} entries, the target's "
                        f"{target_cfg.vocab_size}; use a draft model trained with the target's tokenizer")
    draft_vocab = load_tokenizer(draft_tok_dir).backend.get_vocab()
    if draft_vocab != load_tokenizer(target_tok_dir).backend.get_vocab():
        raise UserError(f"{where}: the draft model's tokenizer differs from the target's; use a draft model "
                        "trained with the target's tokenizer")


def drafter_block_bytes(cfg: SpeculativeConfig | None, target_cfg, block_size: int, kv_dtype: torch.dtype,
                        dtype: torch.dtype) -> int:
    """Bytes per block of the drafter's own cache, which holds as many blocks as the target's pool and
    comes out of the same --kv-cache-memory: a draft model's K/V (in `dtype`, beside rank 0 under
    tensor parallel, so counted whole on every rank), the MTP's latents (one layer per depth, in the
    KV cache dtype, on every rank as the target's); n-gram lookup keeps none."""
    if cfg is None or cfg.method == "ngram":
        return 0
    if cfg.method == "mtp":
        from tessera.inference.worker.latent.mtp import MTPRunner

        return MTPRunner.block_bytes(target_cfg, block_size, kv_dtype) if getattr(target_cfg, "mtp", None) else 0
    from tessera.inference.worker.kinds import serving_kind

    assert cfg.model is not None
    draft_cfg, _ = read_model_facts(cfg.model)
    return serving_kind(draft_cfg).runner.block_bytes(draft_cfg, block_size, dtype)


def build_proposer(cfg: SpeculativeConfig, max_model_len: int, num_blocks: int, block_size: int,
                   device: torch.device, dtype: torch.dtype, prep: ServingPrep | None = None,
                   skip_checksum_verify: bool = False):
    if cfg.method == "ngram":
        return NgramProposer(cfg)
    if cfg.method == "mtp":  # the target's own MTP modules (attached to the target runner by the engine)
        return MTPProposer(cfg.num_speculative_tokens, num_blocks, block_size)
    from tessera.inference.worker.loader import load_for_serving

    assert cfg.model is not None
    # Only the target's generation settings give request defaults (as in vLLM): the draft's are not read.
    draft = load_for_serving(cfg.model, device, dtype, skip_checksum_verify=skip_checksum_verify,
                             generation_config="vllm")
    if draft.config.max_seq_len < max_model_len:
        raise UserError(f"--speculative-config model {cfg.model}: the draft model's max_seq_len "
                        f"({draft.config.max_seq_len}) is below max_model_len ({max_model_len}); lower "
                        "--max-model-len or use another draft model")
    return DraftModelProposer(cfg, draft.model, num_blocks, block_size, device, dtype, prep)
