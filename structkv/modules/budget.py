"""Budget: how much a method keeps, parsed and checked in one place for every door (library,
command line, eval, bench, server).

A budget is a ratio in (0, 1] of each row's prompt length, written with a decimal point ("0.1",
0.1, 1.0), or a token count >= 1, written as an integer ("512", 512). The two spellings never
overlap: "1.0" keeps every token, "1" keeps one.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Budget:
    value: float | int

    def __post_init__(self):
        check(self.value)

    @classmethod
    def parse(cls, x, what: str = "budget") -> "Budget":
        """A Budget from a Budget, a number or its text; a clear ValueError names `what` otherwise."""
        if isinstance(x, Budget):
            return x
        if isinstance(x, str):
            x = _from_text(x.strip(), what)
        check(x, what)
        return cls(x)

    def tokens(self, lengths: torch.Tensor | list[int]) -> list[int]:
        """Tokens kept per row: floor(length * ratio), at least one; or min(count, length)."""
        lens = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
        if isinstance(self.value, float):
            return [min(n, max(1, int(n * self.value))) for n in lens]
        return [min(self.value, n) for n in lens]

    @property
    def is_ratio(self) -> bool:
        return isinstance(self.value, float)

    def __str__(self) -> str:
        """The budget as it parses back exactly: a ratio always with a decimal point (1.0 is not 1)."""
        return repr(float(self.value)) if self.is_ratio else str(self.value)


def check(value, what: str = "budget") -> None:
    """Raise a ValueError naming `what` and saying what a budget must be, unless `value` is one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a ratio in (0, 1] (e.g. 0.1) or a token count >= 1 (e.g. 512), "
                         f"got {value!r}")
    if isinstance(value, numbers.Integral):
        if value < 1:
            raise ValueError(f"{what} must be a positive token count, got {value}")
        return
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        hint = f"; for a count of {int(value)} tokens write it as an integer ({int(value)})" if (
            math.isfinite(value) and value > 1 and value == int(value)) else ""
        raise ValueError(f"{what} ratio must be in (0, 1], got {value!r}{hint}")


def _from_text(text: str, what: str) -> float | int:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number; give a ratio in (0, 1] (e.g. 0.1) or a token count "
                         "(e.g. 512)") from None
