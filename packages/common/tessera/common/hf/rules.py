"""Tensor mapping rules between Tessera's parameter names and a Hugging Face checkpoint's.

A conversion is a list of `Rule`s, one per output tensor: which input tensors it needs and how
they combine. Converters stream through the rules, so memory holds one rule's tensors at a time.
A rule may return a view (a transpose, a row range): the writers materialise non-contiguous
results in a reused staging buffer, so no rule allocates a copy of its own.

`check_import` validates a set of import rules against the weights actually present (names,
shapes, dtypes, and no tensor left unused) before anything is converted or written, so a
directory whose config.json and weights disagree is refused instead of silently half-loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tessera.common.errors import ArtifactError

Combine = Callable[[list[torch.Tensor]], torch.Tensor]

# dtypes a model's weights may have on disk. Anything else (int8, a quantised export, float64) is
# refused: converting it to a float type here would silently produce a different model.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Buffers some exports include beside the weights; recomputed by the model, never read.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


@dataclass(frozen=True)
class Rule:
    """One output tensor: `target` = combine(inputs named `sources`), of global `shape`."""

    target: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]
    combine: Combine | None = None  # None: the single source, unchanged
    source_shapes: tuple[tuple[int, ...], ...] = ()  # of the inputs, when they differ from `shape`

    def input_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.source_shapes or tuple(self.shape for _ in self.sources)

    def apply(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        out = inputs[0] if self.combine is None else self.combine(inputs)
        if tuple(out.shape) != self.shape:
            raise AssertionError(f"{self.target}: produced shape {tuple(out.shape)}, expected {self.shape}")
        return out


class WeightSource(Protocol):
    """Named tensors of an HF directory: their headers without loading, and the tensors."""

    def names(self) -> set[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def get(self, name: str) -> torch.Tensor: ...


def transpose(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0].t()


def cat_rows_t(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, dim=0).t()


def cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, dim=0)


def zeros(shape: tuple[int, ...]) -> Combine:
    return lambda _ts: torch.zeros(shape)


def rows(lo: int, hi: int, transposed: bool) -> Combine:
    """Rows [lo, hi) of the input (of its transpose when `transposed`), as a view."""
    def take(ts: list[torch.Tensor]) -> torch.Tensor:
        t = ts[0].t() if transposed else ts[0]
        return t[lo:hi]
    return take


def zero_rows(n: int) -> Combine:
    """The input with `n` zero rows appended (vocabulary padding on import)."""
    def pad(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([ts[0], ts[0].new_zeros(n, *ts[0].shape[1:])])
    return pad


class Pick:
    """Combine: entry `index` along dim 0 of the single input (one expert of a stacked tensor), a view."""

    def __init__(self, index: int):
        self.index = index

    def __call__(self, ts: list[torch.Tensor]) -> torch.Tensor:
        return ts[0][self.index]


def stack(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(ts)


def inverse(rules: list[Rule]) -> list[Rule]:
    """The import rules of an export made of renames, row concatenations (`cat`) and picks from a
    stacked tensor (`Pick`): each rename reversed, each concatenation split back into row ranges
    (views), the picks of one tensor stacked again in index order."""
    out: list[Rule] = []
    picked: dict[str, list[Rule]] = {}
    for r in rules:
        if r.combine is None and len(r.sources) == 1:
            out.append(Rule(r.sources[0], (r.target,), r.shape))
        elif r.combine is cat:
            start = 0
            for source, shape in zip(r.sources, r.input_shapes()):
                out.append(Rule(source, (r.target,), shape, rows(start, start + shape[0], transposed=False), (r.shape,)))
                start += shape[0]
        else:
            assert isinstance(r.combine, Pick) and len(r.sources) == 1, r
            picked.setdefault(r.sources[0], []).append(r)
    for target, parts in picked.items():
        parts.sort(key=lambda p: p.combine.index)  # type: ignore[union-attr]
        assert [p.combine.index for p in parts] == list(range(len(parts))), target  # type: ignore[union-attr]
        out.append(Rule(target, tuple(p.target for p in parts), parts[0].source_shapes[0], stack,
                        tuple(p.shape for p in parts)))
    return out


def check_import(rules: list[Rule], weights: WeightSource, where: str, optional: frozenset[str] = frozenset()) -> None:
    """Every tensor the rules read exists with the right shape and a float dtype, and every tensor
    present is read (`optional` names may be present unread: a tied head transformers also ignores)."""
    names = weights.names()
    used: set[str] = set()
    for rule in rules:
        for s in rule.sources:
            if s not in names:
                raise ArtifactError(f"{where}: tensor {s!r} missing from the safetensors weights "
                                    "(config.json describes a model that has it)")
            dtype = weights.dtype(s)
            if dtype not in WEIGHT_DTYPES:
                raise ArtifactError(f"{where}: tensor {s!r} is {str(dtype).removeprefix('torch.')}; only float32, "
                                    "bfloat16 and float16 weights are supported (quantised weights are not)")
            used.add(s)
        for s, want in zip(rule.sources, rule.input_shapes()):
            if tuple(weights.shape(s)) != want:
                raise ArtifactError(f"{where}: tensor {s!r} has shape {list(weights.shape(s))}, "
                                    f"config.json implies {list(want)}")
    unused = sorted(n for n in names - used - optional if not n.endswith(IGNORED_SUFFIXES))
    if unused:
        raise ArtifactError(f"{where}: tensor {unused[0]!r} is not part of the model config.json describes "
                            f"({len(unused)} such); config.json and the weights do not belong together")

