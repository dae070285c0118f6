"""The solved coefficient's interval by test inversion (docs/maths.md §6, "Solving for a coefficient").

The set {c : |δH₁(c) − X| ≤ q(c)·SE(c)} is every coefficient whose δH₁ the data cannot tell from the target X
at the stated level (q(c): the t quantile at SE(c)'s degrees of freedom, estimators/student_t.py). δH₁(c) is
cheap (no model pass: the U gradient interpolates exactly in c); SE(c) is not (its E side needs a jvp pass over
E), so it is evaluated at the root and at each end. Each end is solved with the last evaluation's half-width, then
with one linear between the last two (a secant, `local_model`); the half-width is evaluated at the new end and
added, until the two agree to `REL_TOL` (at most `ROUNDS` evaluations per end). Between evaluations the half-width
is taken piecewise linear in c, and flat beyond the farthest (δH₁ and SE both level off as AdamW saturates), to
check that the set is one interval around the root: no grid point inside where δH₁ leaves the band, none outside
(a geometric grid out to `REACH` times the end's distance) where it comes back.

Pure float maths on callables; no model passes of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .what_if import TotalSE

ROUNDS = 4          # evaluations of SE per end at most
REL_TOL = 0.02      # an end is settled when the half-width there is within 2 % of the one it was solved with
REACH = 100.0       # the check looks out to this many times the end's distance from the root beyond each end,
OUTSIDE_RATIO = 1.05  # on a geometric grid of this ratio (94 points a side)
INSIDE_POINTS = 32  # grid points between the root and each end for the check


@dataclass(frozen=True)
class End:
    """One end of the interval: c (None: unbounded, δH₁ never leaves the band on that side), the error bar
    evaluated there, the points (c, half-width) where the half-width was evaluated on that side (the root's first)
    and whether the half-width at the end agrees with the one it was solved with (`settled`)."""

    c: float | None
    bars: TotalSE | None
    points: tuple[tuple[float, float], ...]
    settled: bool

    def width(self, x: float) -> float:
        """The half-width at x: linear between the evaluated points, the farthest one's beyond them."""
        return half_width_model(self.points)(x)


@dataclass(frozen=True)
class InvertedInterval:
    """[lo, hi] around the root at `level`, and `note`: None when the set is one interval lo < root < hi with
    both ends settled, else what is not so."""

    lo: End
    hi: End
    level: float
    note: str | None


def half_width_model(points) -> Callable[[float], float]:
    """Piecewise-linear in |c − root| through `points` (the root's first, all on one side), flat beyond."""
    root = points[0][0]
    dist = np.array([abs(c - root) for c, _ in points])
    order = np.argsort(dist)
    xs, ws = dist[order], np.array([w for _, w in points])[order]
    return lambda x: float(np.interp(abs(x - root), xs, ws))


def _bisect(h: Callable[[float], float], inside: float, outside: float, tol: float) -> float:
    """A sign change of h between `inside` (h ≤ 0) and `outside` (h > 0), to |Δc| ≤ tol·max(1, |c|)."""
    for _ in range(200):
        mid = 0.5 * (inside + outside)
        if abs(outside - inside) <= tol * max(1.0, abs(mid)):
            break
        if h(mid) > 0:
            outside = mid
        else:
            inside = mid
    return 0.5 * (inside + outside)


def crossing(h: Callable[[float], float], root: float, side: float, step: float, *, max_doublings: int = 60,
             tol: float = 1e-9) -> float | None:
    """Where h (≤ 0 at `root`) turns positive on `side` (±1) of the root: steps of `step`·2^k out from the root
    until h > 0, then bisection. None when h stays ≤ 0 out to step·2^max_doublings."""
    inside = root
    for k in range(max_doublings):
        c = root + side * step * 2.0 ** k
        if h(c) > 0:
            return _bisect(h, inside, c, tol)
        inside = c
    return None


def local_model(points: list[tuple[float, float]]) -> Callable[[float], float]:
    """The half-width an end is solved with: the last evaluation's (the root's at first), then linear in c
    between the last two evaluations at end guesses and flat beyond them (a secant without extrapolation)."""
    recent = sorted(points[-2:] if len(points) > 2 else points[-1:])
    cs, ws = [c for c, _ in recent], [w for _, w in recent]
    return lambda x: float(np.interp(x, cs, ws))


def solve_end(f: Callable[[float], float], bars_at: Callable[[float], TotalSE], target: float, root: float,
              side: float, step: float, start: TotalSE, level: float) -> End:
    """One end: solved with `local_model` of the half-widths evaluated so far, the half-width evaluated at the
    new end and added, until it agrees with the model's there to REL_TOL (at most ROUNDS evaluations)."""
    points = [(root, start.half_width(level))]
    c, bars = None, None
    for _ in range(ROUNDS):
        model = local_model(points)
        c = crossing(lambda x, m=model: abs(f(x) - target) - m(x), root, side, step)
        if c is None:
            return End(None, None, tuple(points), True)
        bars = bars_at(c)
        there, expected = bars.half_width(level), model(c)
        points.append((c, there))
        if abs(there - expected) <= REL_TOL * there:
            return End(c, bars, tuple(points), True)
    return End(c, bars, tuple(points), False)


def _outside_point(f, target: float, root: float, end: End, side: float) -> float | None:
    """The first point beyond `end` (a geometric grid of ratio OUTSIDE_RATIO in the distance from the root, out to
    REACH times the end's) where δH₁ is back within the band."""
    distance = abs(end.c - root) * OUTSIDE_RATIO
    while distance <= REACH * abs(end.c - root):
        c = root + side * distance
        if abs(f(c) - target) <= end.width(c):
            return c
        distance *= OUTSIDE_RATIO
    return None


def _inside_point(f, target: float, root: float, end: End) -> float | None:
    """The first grid point strictly between the root and `end` where δH₁ is outside the band."""
    for i in range(1, INSIDE_POINTS):
        c = root + i / INSIDE_POINTS * (end.c - root)
        if abs(f(c) - target) > end.width(c):
            return c
    return None


def check_interval(f, target: float, root: float, lo: End, hi: End) -> str | None:
    """None when lo < root < hi, both ends settled and the set is one interval around the root; else why not."""
    for name, end, side in (("lo", lo, -1.0), ("hi", hi, 1.0)):
        if end.c is None:
            continue
        if not side * (end.c - root) > 0:
            return f"{name} {end.c:.4g} is not on its side of the root {root:.4g}"
        if not end.settled:
            return (f"{name} not settled: the half-width there moved by more than {REL_TOL:.0%} in "
                    f"{ROUNDS} evaluations of SE")
        hole = _inside_point(f, target, root, end)
        if hole is not None:
            return f"not an interval: δH₁ leaves the band at {hole:.4g}, between the root and {name}"
        back = _outside_point(f, target, root, end, side)
        if back is not None:
            return f"not an interval: δH₁ is back within the band at {back:.4g}, beyond {name}"
    return None


def inverted_interval(f: Callable[[float], float], bars_at: Callable[[float], TotalSE], target: float, root: float,
                      at_root: TotalSE, step: float, level: float) -> InvertedInterval:
    """{c : |f(c) − target| ≤ q(c)·SE(c)} around `root` (f(root) = target) at `level`, SE(c) = `bars_at(c)` at
    each end (`at_root`: the root's); an end is None where f never leaves the band on that side."""
    if not math.isfinite(at_root.half_width(level)):
        none = End(None, None, (), False)
        return InvertedInterval(none, none, level, "no interval: SE at the root is not available")
    lo = solve_end(f, bars_at, target, root, -1.0, step, at_root, level)
    hi = solve_end(f, bars_at, target, root, 1.0, step, at_root, level)
    return InvertedInterval(lo, hi, level, check_interval(f, target, root, lo, hi))
