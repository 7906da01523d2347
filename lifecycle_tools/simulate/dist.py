"""Length distributions for the synthetic workload, parsed and range-checked before any sampling."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from lifecycle_tools.simulate.errors import ConfigProblem

#: The longest length any distribution may produce (tokens). Far beyond any pool this tool can
#: build on one machine; it exists so that a typo like ``1e300`` is refused in one line.
MAX_LEN = 1 << 22

SPELLINGS = "N, LO-HI, uniform:LO:HI, exp:MEAN[:MAX] or normal:MEAN:STD"


@dataclass(frozen=True)
class Dist:
    """A length distribution over ``lo .. hi`` (integers, ``1 <= lo <= hi <= MAX_LEN``).

    Spellings: ``N`` (constant), ``LO-HI`` or ``uniform:LO:HI``, ``exp:MEAN[:MAX]`` (exponential,
    capped at MAX, default 4 x MEAN), ``normal:MEAN:STD`` (clipped to 1 .. MEAN + 4 STD).
    """

    kind: str
    a: float
    b: float
    lo: int
    hi: int
    text: str

    def sample(self, rng: random.Random) -> int:
        """One length in ``lo .. hi``."""
        if self.kind == "const":
            return self.lo
        if self.kind == "uniform":
            return rng.randint(self.lo, self.hi)
        x = rng.expovariate(1.0 / self.a) if self.kind == "exp" else rng.gauss(self.a, self.b)
        return max(self.lo, min(self.hi, int(round(min(x, self.hi)))))


class _Parser:
    def __init__(self, text, what: str) -> None:
        self.text, self.what = text, what

    def bad(self, why: str = "") -> ConfigProblem:
        return ConfigProblem(f"bad {self.what} distribution {self.text!r}{': ' + why if why else ''} "
                             f"(use {SPELLINGS})")

    def num(self, s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise self.bad() from None
        if not math.isfinite(v):
            raise self.bad("not finite")
        return v

    def length(self, s: str, name: str) -> int:
        v = self.num(s)
        if v != int(v) or not 1 <= v <= MAX_LEN:
            raise self.bad(f"{name} must be an integer in 1..{MAX_LEN}")
        return int(v)

    def parse(self) -> Dist:
        t = str(self.text).strip().lower()
        parts = t.split(":")
        if len(parts) == 1 and "-" not in t.lstrip("-"):
            n = self.length(t, "the length")
            return Dist("const", n, n, n, n, self.text)
        if len(parts) == 1 or (parts[0] == "uniform" and len(parts) == 3):
            lo_s, hi_s = t.split("-", 1) if len(parts) == 1 else parts[1:]
            lo, hi = self.length(lo_s, "LO"), self.length(hi_s, "HI")
            if hi < lo:
                raise self.bad("need LO <= HI")
            return Dist("uniform", lo, hi, lo, hi, self.text)
        if parts[0] == "exp" and len(parts) in (2, 3):
            mean = self.num(parts[1])
            if not 1 <= mean <= MAX_LEN:
                raise self.bad(f"MEAN must lie in 1..{MAX_LEN}")
            cap = self.length(parts[2], "MAX") if len(parts) == 3 else min(MAX_LEN, int(4 * mean))
            return Dist("exp", mean, 0.0, 1, cap, self.text)
        if parts[0] == "normal" and len(parts) == 3:
            mean, std = self.num(parts[1]), self.num(parts[2])
            if not (1 <= mean <= MAX_LEN and 0 <= std <= MAX_LEN):
                raise self.bad(f"need 1 <= MEAN <= {MAX_LEN} and 0 <= STD <= {MAX_LEN}")
            return Dist("normal", mean, std, 1, min(MAX_LEN, int(mean + 4 * std)), self.text)
        raise self.bad()


def parse_dist(text, what: str = "length") -> Dist:
    """Parse a distribution spelling (see ``Dist``).

    Raises:
        ConfigProblem: a malformed spelling, or one whose range leaves ``1 .. MAX_LEN``.
    """
    return _Parser(text, what).parse()
