"""Choosing each sequence's next token from its logits, with its own settings and generator.

Order (as in vLLM/transformers): penalties and logit_bias on the raw logits, min_tokens masking,
the structured-output grammar masks (all constrained rows in one masked fill), then greedy
argmax, or temperature -> top-k -> top-p -> min-p -> a draw from the request's own
torch.Generator. The draw depends only on that request's logits and generator, never on its
batch mates, so a seeded request reproduces. Logprobs are reported from the model's raw
distribution (log_softmax of the unprocessed logits), as vLLM does by default.

Speculative decoding's verification is here too (`verify`): exact rejection sampling (Leviathan et
al. 2023, as vLLM's rejection sampler) of the draft tokens against the same processed
distribution the sampler would draw from at each position, so the output is distributed exactly
as without speculation, and greedy output is identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.core.sequence import Sequence, TokenLogprob
from tessera.inference.sample.structured import allow_all, apply_bitmask, bitmask_isolating


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax [N, V] -> N ints: the first of equal maxima, NaN counting as the largest (as
    torch's). A CPU float tensor goes through numpy, whose vectorized argmax is an order of magnitude
    faster than torch's CPU kernel (benchmarks/RESULTS.md, host time per decode step); the values
    are the same (tests/inference/test_sampling.py)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.numpy().argmax(axis=1).tolist()
    return logits.argmax(dim=-1).tolist()


def apply_penalties(logits: torch.Tensor, seq: Sequence | Hypothetical, pending: torch.Tensor | None = None,
                    to_device: ToDevice | None = None) -> None:
    """In place on one row [V]. `pending`: a one-token tensor on the row's device, the newest output
    token, which the sequence does not hold yet (async scheduling). Dense over the vocabulary (a mask,
    counts), so that nothing is read back to the host; the values are those of indexing the seen ids."""
    p = seq.params
    to_device = to_device or _to(logits.device)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        seen.index_fill_(0, to_device(torch.tensor(seq.prompt_ids + seq.output_ids, dtype=torch.long)), True)
        if pending is not None:
            seen.index_fill_(0, pending, True)
        penalized = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    if (p.presence_penalty or p.frequency_penalty) and (seq.output_ids or pending is not None):
        counts = torch.zeros_like(logits)
        counts.index_add_(0, to_device(torch.tensor(seq.output_ids, dtype=torch.long)),
                          torch.ones(len(seq.output_ids), dtype=logits.dtype, device=logits.device))
        if pending is not None:
            counts.index_add_(0, pending, torch.ones(1, dtype=logits.dtype, device=logits.device))
        logits -= torch.where(counts > 0, p.frequency_penalty * counts + p.presence_penalty, 0.0)


ToDevice = Callable[[torch.Tensor], torch.Tensor]


def _to(device: torch.device) -> ToDevice:
    return lambda t: t.to(device)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens top-k, top-p and min-p exclude; one row [V], already tempered."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def distribution(row: torch.Tensor) -> torch.Tensor:
    """The probabilities `draw` samples from, for a row of (tempered, filtered) logits: NaN counts
    as excluded and +inf as the largest finite logit; a row with nothing left (which request
    validation rules out) is a point mass on its argmax."""
    row = row.nan_to_num(nan=float("-inf"), posinf=torch.finfo(row.dtype).max)
    probs = row.softmax(-1)
    # Chosen on the device (no read back: async scheduling samples before the step's tokens reach the host).
    usable = torch.isfinite(probs).all() & (probs.sum() > 0.0)
    return torch.where(usable, probs, torch.zeros_like(row).scatter_(0, row.argmax().view(1), 1.0))


def draw_on_device(row: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`draw`'s token as a one-element tensor on the row's device, without reading anything back:
    torch.multinomial's own one-sample path (argmax of p / Exp(1) noise, the same draws from the
    same generator) without its input checks, two reads back on CUDA that `distribution` makes moot."""
    probs = distribution(row)
    return (probs / torch.empty_like(probs).exponential_(1, generator=generator)).argmax().view(1)


def draw(row: torch.Tensor, generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """One token from a row of (tempered, filtered) logits, never raising on a degenerate row,
    and the distribution it was drawn from."""
    probs = distribution(row)
    return int(torch.multinomial(probs, 1, generator=generator).item()), probs


@dataclass
class Hypothetical:
    """A sequence as it would be after some draft tokens: what the processing of one position's
    logits reads (penalties count the drafts before it; min_tokens counts them too)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    eos_ids: frozenset[int]
    matcher: None = None  # speculation never runs under structured output (spec_decode/proposers.py)

    @staticmethod
    def of(seq: Sequence) -> Hypothetical:
        return Hypothetical(seq.params, seq.prompt_ids, list(seq.output_ids), seq.eos_ids)


# ---- the row a request samples from: one home for the batched Sampler, `verify` and the draft --
# Every token (the Sampler's, speculative verification's, a draft model's) comes from
# process -> finish -> pick. Speculative decoding is exact only while verification's target
# distribution is the one the Sampler would draw from, so neither path has steps of its own.

def samples_ahead(seq: Sequence) -> bool:
    """Whether this sequence's next token can be chosen before its newest one is known (async
    scheduling, `Sampler.sample_on_device`, which is given that token on the device): all but a
    grammar, whose mask needs the matcher advanced by it on the host. A launched step samples such
    a row later (`DeferredRows`), once the step before is applied."""
    return seq.matcher is None


def needs_processing(seq: Sequence | Hypothetical, pending: int = 0) -> bool:
    """Whether `process_row` changes anything for this sequence (most rows: no, and no copy);
    `pending`: output tokens it does not hold yet."""
    p = seq.params
    return (p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)
            or bool(p.logit_bias) or len(seq.output_ids) + pending < p.min_tokens)


def process_row(row: torch.Tensor, seq: Sequence | Hypothetical, pending: torch.Tensor | None = None,
                to_device: ToDevice | None = None) -> None:
    """Penalties, logit_bias and the min_tokens mask, in place on one row [V]. `pending` (the newest
    output token, on the device, not yet in the sequence) and `to_device` (host ids to the row's
    device without waiting) are async scheduling's: see `apply_penalties`."""
    p = seq.params
    to_device = to_device or _to(row.device)
    apply_penalties(row, seq, pending, to_device)
    if p.logit_bias:
        row.index_add_(0, to_device(torch.tensor(list(p.logit_bias), dtype=torch.long)),
                       to_device(torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)))
    if len(seq.output_ids) + (pending is not None) < p.min_tokens:
        banned = list(seq.eos_ids | set(p.stop_token_ids))
        if banned:
            row.index_fill_(0, to_device(torch.tensor(banned, dtype=torch.long)), float("-inf"))


def process(logits: torch.Tensor, seqs: list[Sequence] | list[Hypothetical], failed: dict[int, Exception]
            ) -> torch.Tensor:
    """Every step before the choice, on rows [N, V] (row i for seqs[i]): `process_row` where it
    changes something, then the structured-output grammar masks of the constrained rows in one
    masked fill. `logits` is copied once when any row changes, else returned as it is. A row whose
    processing raises is recorded in `failed` (index -> error) and left as it stands."""
    out = logits
    for i, seq in enumerate(seqs):
        if needs_processing(seq):
            if out is logits:
                out = logits.clone()
            try:
                process_row(out[i], seq)
            except Exception as exc:
                failed[i] = exc
    constrained = [i for i, seq in enumerate(seqs) if seq.matcher is not None and i not in failed]
    if constrained:
        # Structured output: one bitmask for every constrained row (mostly computed during the
        # forward: Grammars.compute_ahead), one masked fill.
        if out is logits:
            out = logits.clone()
        try:
            bitmask, bad = bitmask_isolating([seqs[i] for i in constrained], logits.shape[1])  # type: ignore[misc]
            failed.update({constrained[j]: exc for j, exc in bad.items()})
            rows = None if len(constrained) == len(seqs) else torch.tensor(constrained, device=logits.device)
            apply_bitmask(out, rows, bitmask)
        except Exception as exc:
            failed.update({i: exc for i in constrained})
    return out


def finish(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """A processed row as `pick` takes it: unchanged when greedy (its argmax is the token), else
    tempered and filtered (top-k, top-p, min-p)."""
    if params.greedy:
        return row
    return filter_logits(row / params.temperature, params.top_k, params.top_p, params.min_p)


def pick(row: torch.Tensor, params: SamplingParams, generator: torch.Generator
         ) -> tuple[int, torch.Tensor | None]:
    """Choose from a `finish`ed row: the argmax when greedy, else a draw; returns the token and
    the distribution it was drawn from (None when greedy)."""
    if params.greedy:
        return int(row.argmax()), None
    return draw(row, generator)


def sampling_row(logits: torch.Tensor, seq: Sequence | Hypothetical) -> torch.Tensor:
    """The row the Sampler picks from for `seq`, from its raw logits [V] (left unchanged): the
    same `process` and `finish` the Sampler runs on its batch. Raises what processing raised."""
    failed: dict[int, Exception] = {}
    row = process(logits.unsqueeze(0), [seq], failed)[0]  # type: ignore[list-item]
    if failed:
        raise failed[0]
    return finish(row, seq.params)


class Sampler:
    def __call__(self, seqs: list[Sequence], logits: torch.Tensor
                 ) -> tuple[list[int], list[TokenLogprob | None], dict[int, Exception]]:
        """logits [N, V] fp32 (row i for seqs[i]); returns the chosen token ids, the logprobs of
        the rows that asked for them (else None), and the rows whose sampling failed (index ->
        error; their token is meaningless). A failure stays with its own request: the batch
        mates still get their tokens. Reads the sequences, never changes them."""
        failed: dict[int, Exception] = {}
        if all([s.plain and s.matcher is None for s in seqs]):
            # Every row greedy and plain (the common decode step): one argmax, one read back.
            return argmax_rows(logits), [None] * len(seqs), failed
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = process(logits, seqs, failed)
        # Greedy rows: `pick`'s argmax of a finished (= processed) row, for the batch at once.
        chosen = argmax_rows(processed)
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.greedy or i in failed:
                continue
            try:
                chosen[i] = pick(finish(processed[i], p), p, seq.generator)[0]
            except Exception as exc:
                failed[i] = exc
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for i, seq in enumerate(seqs):
                n = seq.params.logprobs
                if n is not None and i not in failed:
                    logprobs[i] = token_logprob(raw_logprobs[i], chosen[i], n)
        return chosen, logprobs, failed


    @staticmethod
    def sample_on_device(seqs: list[Sequence], logits: torch.Tensor, pending: list[torch.Tensor | None],
                         to_device: ToDevice) -> tuple[torch.Tensor, DeviceLogprobs | None]:
        """Async scheduling: the tokens `__call__` would choose for rows that all `samples_ahead`, as
        an int64 tensor [N] on the logits' device, nothing read back to the host, and when a row asks
        for logprobs, every row's (`DeviceLogprobs`, of the raw logits). `pending[i]`: row i's newest
        output token as a one-token tensor on the device, which its sequence does not hold yet (None:
        it holds them all); `to_device`: host tensors to the device without waiting."""
        chosen = Sampler.choose_on_device(seqs, logits, pending, to_device)
        return chosen, DeviceLogprobs.maybe(seqs, logits, chosen)

    @staticmethod
    def choose_on_device(seqs: list[Sequence], logits: torch.Tensor, pending: list[torch.Tensor | None],
                         to_device: ToDevice, bitmask: torch.Tensor | None = None,
                         failed: dict[int, Exception] | None = None) -> torch.Tensor:
        """`sample_on_device`'s tokens, without logprobs. `bitmask` (host, one row per sequence): the
        grammar masks, applied after the other processing as `process` applies them (`DeferredRows`).
        `failed`: record a row whose processing or draw raises there (its token is meaningless)
        rather than raise."""
        processed = logits
        for i, seq in enumerate(seqs):
            if needs_processing(seq, pending[i] is not None):
                if processed is logits:
                    processed = logits.clone()
                try:
                    process_row(processed[i], seq, pending[i], to_device)
                except Exception as exc:
                    if failed is None:
                        raise
                    failed[i] = exc
        if bitmask is not None:
            if processed is logits:
                processed = logits.clone()
            apply_bitmask(processed, None, bitmask, to_device)
        if processed.device.type == "cpu" and processed.dtype == torch.float32:
            chosen = torch.from_numpy(processed.numpy().argmax(axis=1))  # argmax_rows' faster CPU path
        else:
            chosen = processed.argmax(dim=-1)
        for i, seq in enumerate(seqs):
            p = seq.params
            if not p.greedy and (failed is None or i not in failed):
                try:
                    chosen[i:i + 1] = draw_on_device(finish(processed[i], p), seq.generator)
                except Exception as exc:
                    if failed is None:
                        raise
                    failed[i] = exc
        return chosen


@dataclass
class DeferredRows:
    """The rows of a launched step whose sampling waits (async scheduling): those that do not
    `samples_ahead`, whose grammar mask needs the matcher advanced by the token of the step before,
    which the host applies after this step is launched. vLLM's order: the forward runs, the host
    applies the step before and computes the masks, then these rows are sampled on the device.
    `finish` does that last part, once those matchers have advanced."""

    seqs: list[Sequence]  # every sampled row's sequence, in the step's order
    logits: torch.Tensor  # [N, V] the step's raw logits (fp32)
    rows: list[int]  # the rows waiting, increasing
    to_device: ToDevice

    def waiting(self) -> list[Sequence]:
        """The sequences of the rows waiting, in order."""
        return [self.seqs[r] for r in self.rows]

    @torch.inference_mode()  # the launched step's tensors are inference tensors
    def finish(self, chosen: torch.Tensor) -> tuple[DeviceLogprobs | None, dict[int, Exception]]:
        """Sample the waiting rows into `chosen` [N] (on the device; the other rows' tokens are in it
        already), as `Sampler.__call__` would now that their sequences hold every token. Returns every
        row's logprobs (None: none asked) and the rows that failed (row -> error; their token is
        meaningless). A sequence that has finished since (a stop, an abort, a failure) gets no mask
        (its matcher is not asked; the row's token is dropped)."""
        seqs = self.waiting()
        vocab = self.logits.shape[1]
        live = [i for i, seq in enumerate(seqs) if not seq.is_finished]
        failed: dict[int, Exception] = {}
        bitmask = allow_all(len(seqs), vocab)
        if live:
            masks, bad = bitmask_isolating([seqs[i] for i in live], vocab)
            bitmask[torch.tensor(live)] = masks
            failed.update({live[j]: exc for j, exc in bad.items()})
        index = self.to_device(torch.tensor(self.rows))
        picked = Sampler.choose_on_device(seqs, self.logits.index_select(0, index), [None] * len(seqs),
                                          self.to_device, bitmask, failed)
        chosen.index_copy_(0, index, picked)
        return DeviceLogprobs.maybe(self.seqs, self.logits, chosen), {self.rows[i]: e for i, e in failed.items()}


@dataclass
class DeviceLogprobs:
    """Logprobs of a step's rows left on the device (async scheduling): each row's chosen token's and
    its top max(n) alternatives; `rows` turns them into what `token_logprob` gives, once on the host."""

    top_n: list[int | None]  # per row: the alternatives it asked for (None: no logprobs)
    chosen: torch.Tensor  # [N] fp32
    top_ids: torch.Tensor  # [N, K]
    top_values: torch.Tensor  # [N, K]

    @classmethod
    def maybe(cls, seqs: list[Sequence], logits: torch.Tensor, chosen: torch.Tensor) -> DeviceLogprobs | None:
        """Of raw logits [N, V] and the rows' chosen tokens, when a row asks for logprobs (else None)."""
        top_n = [seq.params.logprobs for seq in seqs]
        if all(n is None for n in top_n):
            return None
        return cls.of(torch.log_softmax(logits, dim=-1), chosen, top_n)

    @classmethod
    def of(cls, logprobs: torch.Tensor, chosen: torch.Tensor, top_n: list[int | None]) -> DeviceLogprobs:
        k = max(n or 0 for n in top_n)
        values, ids = torch.topk(logprobs, k) if k else (logprobs[:, :0], chosen[:, None][:, :0])
        return cls(top_n, logprobs.gather(1, chosen[:, None])[:, 0], ids, values)

    def to_host(self, copy) -> DeviceLogprobs:
        """These tensors through `copy` (the launched step's copy to the host)."""
        return DeviceLogprobs(self.top_n, copy(self.chosen), copy(self.top_ids), copy(self.top_values))

    def rows(self, tokens: list[int]) -> list[TokenLogprob | None]:
        """On the host: per row its TokenLogprob (None where not asked)."""
        chosen, ids, values = self.chosen.tolist(), self.top_ids.tolist(), self.top_values.tolist()
        return [None if n is None else TokenLogprob(token_id=t, logprob=lp, top=list(zip(i[:n], v[:n])))
                for n, t, lp, i, v in zip(self.top_n, tokens, chosen, ids, values)]


def token_logprob(row_logprobs: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if top_n > 0:
        vals, ids = torch.topk(row_logprobs, top_n)
        top = list(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token_id=token, logprob=float(row_logprobs[token]), top=top)


def verify(seq: Sequence, drafts: list[int], draft_probs: torch.Tensor | None, logits: torch.Tensor
           ) -> list[int]:
    """Accept a prefix of `drafts` and add one token; logits [len(drafts) + 1, V] are the target
    model's rows at the newest token and at each draft.

    Greedy: a draft is accepted while it is the argmax, and the first mismatch (or, when all are
    accepted, the last row's argmax) is the added token, so the output is the one without
    speculation. Sampled: draft d at position j, with target distribution p_j (this sampler's,
    after every processing step, given the drafts before it) and draft distribution q_j, is
    accepted with probability min(1, p_j(d) / q_j(d)); on rejection the token is drawn from
    norm(max(0, p_j - q_j)) and the rest is dropped; when all are accepted a bonus token is drawn
    from the last row. An n-gram draft is a point mass (q_j(d) = 1): accepted with probability
    p_j(d), else drawn from p_j without d. Each emitted token is then distributed as p_j.
    """
    view = Hypothetical.of(seq)
    gen = seq.generator
    out: list[int] = []
    for j, d in enumerate(drafts):
        row = sampling_row(logits[j], view)
        if seq.params.greedy:
            t = int(row.argmax())
            if t != d:
                return out + [t]
        else:
            p = distribution(row)
            q = None if draft_probs is None else draft_probs[j].to(p.dtype)
            qd = 1.0 if q is None else float(q[d])
            u = float(torch.rand((), generator=gen, device=p.device))
            if not (qd > 0.0 and u * qd < float(p[d])):
                if q is None:
                    residual = p.clone()
                    residual[d] = 0.0
                else:
                    residual = (p - q).clamp_min(0.0)
                if float(residual.sum()) <= 0.0:  # rejected with probability 0: only by rounding
                    residual = p
                return out + [int(torch.multinomial(residual, 1, generator=gen).item())]
        out.append(d)
        view.output_ids.append(d)
    return out + [pick(sampling_row(logits[len(drafts)], view), seq.params, gen)[0]]
