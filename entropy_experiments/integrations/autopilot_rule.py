"""The entropy autopilot's control law: the lr multiplier m and the entropy term κ of the next step (pure).

Inputs, all in nats/token: the step's predicted change δ ± s at the scheduler's lr with no term (m = 1, κ = 0),
the gap g ± σ_g between the target and the entropy now (the filtered estimate, entropy_filter.py), the term's
predicted effect e ± s_e per unit κ at m = 1 (None: no term this step), and the previous m. An AdamW step is
linear in its lr and the term is added outside the moments, so the step at (m, κ) changes the entropy by
m·(δ + κ·e):

    excess      x = g − δ: how far from the target the step would leave the entropy if nothing is done
    rest        |g| ≤ budget + z·σ_g and |x| ≤ budget + z·√(σ_g² + s²): the entropy is not off the target,
                and the step is not predicted to leave it off, beyond the drift budget at z noise SDs → κ = 0
                and m returns toward 1 (at most the rate limit per step). This is the law's resting state: a
                run without an entropy problem is never slowed, whatever noise the predictions carry.
    wanted      w = δ + gain·x (the share `gain` of the excess closed this step), never below −max_drop
    candidates  m ∈ {the resting m, the lr-only m}, each with κ = 0 and with κ by the shrunk ratio below
                (|κ| ≤ max_term)
    lr-only m   m_r + (w − m_r·δ)·δ / (δ² + s²), m_r the resting m: the change of m that would reach w, shrunk
                toward no change where δ is noise — a noisy δ can never ask for m = 0, and a δ within its noise
                asks for almost no lr change at all; then the rate limit (a fall to m_prev/max_rate, to
                m_prev/max_rate_clear on a clear departure; a rise to m_prev·max_rate_clear) and the bounds
                [min_multiplier, max_multiplier]
    κ at m      (w − m·δ)·e / (m·(e² + s_e²)): the same shrinkage on the term's own noise; no term unless
                e > z·s_e (u is built to raise the entropy: where E does not confirm it, the direction is noise,
                and a term along it could move the entropy either way)
    choice      the candidate with the smallest (w − m·(δ + κ·e))² + s² + κ²·s_e²: its predicted miss and the
                noise the term adds to it (not scaled by m: a smaller lr must buy a smaller miss, not merely a
                quieter prediction of a smaller step); on a tie (errors within s²/10, closer than the
                prediction can tell apart) the larger m (the term changes the
                step's direction, the lr only its size: a smaller lr slows the reward with it), then the
                smaller |κ|

Each decision says in words what set m and κ (`steering`) and which limit bound it (`limit`).

`decide_measured` runs the same law on measured changes: δ is the untouched step's ΔH measured on E before the
step (SNIS at θ + Δθ), the chosen step is measured and the law runs once more on the secants through it, and
the step whose measured change misses the wanted change least is taken (never one measured worse than resting).
A large step's curvature, which δ and e miss, is then in what the law reads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from entropy_experiments.errors import ConfigError, NumericsError

KEY = "EntropyAutopilot"
INITIAL = "initial"
NO_LIMIT = "none"
# A clear departure, beyond the budget by CLEAR·z noise SDs, may cut the lr at max_rate_clear per step: pure
# noise at the target crosses 4 SDs in 0.006 % of decisions where it crosses 2 in 4.6 % (two-sided normal), so a
# fast cut answers a real fall (AdamW's first step at a large lr) and almost never noise, even at a small budget.
CLEAR = 2.0


@dataclass(frozen=True)
class AutopilotRule:
    """The control law's settings (module docstring)."""

    budget: float = 0.02           # nats/token: the departure from the target tolerated without acting
    z: float = 2.0                 # the departure must exceed the budget by z noise SDs
    gain: float = 1.0              # share of the predicted excess closed per acting step
    max_term: float = 2.0          # |κ| bound: the term's displacement relative to the trainer's step (0: off)
    min_multiplier: float = 0.5
    max_multiplier: float = 1.0   # above 1 the autopilot may train faster than the scheduler asks
    max_rate: float = 1.25         # the factor m may fall by per step on a departure significant at z
    max_rate_clear: float = 2.0    # ... on a clear one (beyond the budget by 2z noise SDs), and rise by back to 1
    max_drop: float | None = 0.05  # nats/token per step; None: no limit

    def check(self) -> None:
        """ConfigError naming the option unless the settings make a rule."""
        if not 0 < self.min_multiplier <= 1 <= self.max_multiplier < math.inf:
            raise ConfigError(f"{KEY}: need 0 < min_multiplier <= 1 <= max_multiplier < inf, got "
                              f"{self.min_multiplier!r}, {self.max_multiplier!r}")
        if self.max_drop is not None and not self.max_drop >= 0:
            raise ConfigError(f"{KEY}: max_drop must be >= 0 nats/token (or None), got {self.max_drop!r}")
        for name in ("budget", "z", "max_term"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ConfigError(f"{KEY}: {name} must be a finite number >= 0, got {value!r}")
        if not 1 <= self.max_rate <= self.max_rate_clear < math.inf:
            raise ConfigError(f"{KEY}: need 1 <= max_rate <= max_rate_clear < inf (the factors m may change by per "
                              f"step), got {self.max_rate!r}, {self.max_rate_clear!r}")
        if not 0 < self.gain <= 1:
            raise ConfigError(f"{KEY}: gain must be in (0, 1] (the share of the excess closed per step), "
                              f"got {self.gain!r}")


@dataclass(frozen=True)
class Estimate:
    """A number in nats/token with its standard error."""

    value: float
    se: float


@dataclass(frozen=True)
class Decision:
    """The step's multiplier and term, the change aimed at and predicted, and why (in words)."""

    multiplier: float
    term: float
    wanted: float
    predicted: float
    steering: str
    limit: str = NO_LIMIT
    predicted_se: float | None = None  # set where `predicted` is a measured change


def shrunk_ratio(wanted: float, effect: Estimate) -> float:
    """wanted / effect, shrunk toward 0 by the effect's noise: wanted·e / (e² + se²) (0 where e is 0 ± 0)."""
    denominator = effect.value ** 2 + effect.se ** 2
    return wanted * effect.value / denominator if denominator > 0 else 0.0


def limited_multiplier(rule: AutopilotRule, m: float, previous: float, clear: bool = False) -> tuple[float, str]:
    """m within the rate limit around `previous` (a fall by at most max_rate, max_rate_clear on a clear departure;
    a rise by at most max_rate_clear), then within the bounds; the limit that bound it."""
    low, high = previous / (rule.max_rate_clear if clear else rule.max_rate), previous * rule.max_rate_clear
    limit = NO_LIMIT if low <= m <= high else "rate limit"
    m = min(max(m, low), high)
    if not rule.min_multiplier <= m <= rule.max_multiplier:
        m, limit = min(max(m, rule.min_multiplier), rule.max_multiplier), "multiplier bound"
    return m, limit


def term_at(rule: AutopilotRule, m: float, wanted: float, step: Estimate, term: Estimate | None) -> tuple[float, str]:
    """κ at multiplier m (shrunk ratio, |κ| ≤ max_term; 0 without a term) and the limit that bound it."""
    if term is None or rule.max_term == 0:
        return 0.0, NO_LIMIT
    if not term.value > rule.z * term.se:  # u is built to raise the entropy: unconfirmed on E, it is noise
        return 0.0, "term direction unconfirmed"
    kappa = shrunk_ratio((wanted - m * step.value) / m, term)
    if abs(kappa) > rule.max_term:
        return math.copysign(rule.max_term, kappa), "term bound"
    return kappa, NO_LIMIT


def significant(rule: AutopilotRule, gap: Estimate, excess: float, step_se: float, z: float | None = None) -> bool:
    """The entropy is off the target, or the step would leave it off, beyond the budget by z noise SDs (the
    rule's z unless given)."""
    z = rule.z if z is None else z
    off_now = abs(gap.value) > rule.budget + z * gap.se
    off_after = abs(excess) > rule.budget + z * math.hypot(gap.se, step_se)
    return off_now or off_after


def decide(rule: AutopilotRule, *, step: Estimate, gap: Estimate, previous: float,
           term: Estimate | None = None) -> Decision:
    """The next step's (m, κ) from δ ± s, the gap to the target, the term's effect per κ and the previous m."""
    excess = gap.value - step.value
    resting, rest_limit = limited_multiplier(rule, 1.0, previous)
    if not significant(rule, gap, excess, step.se):
        words = "within the budget: no action" if resting == 1.0 else "within the budget: lr returning to 1"
        return Decision(resting, 0.0, resting * step.value, resting * step.value, words, rest_limit)
    wanted = step.value + rule.gain * excess
    if rule.max_drop is not None:
        wanted = max(wanted, -rule.max_drop)
    clear = significant(rule, gap, excess, step.se, CLEAR * rule.z)
    lr_only, lr_limit = limited_multiplier(rule, resting + shrunk_ratio(wanted - resting * step.value, step), previous,
                                           clear)
    candidates = []
    for m, m_limit in dict.fromkeys([(resting, rest_limit), (lr_only, lr_limit)]):
        for kappa, k_limit in dict.fromkeys([term_at(rule, m, wanted, step, term), (0.0, NO_LIMIT)]):
            predicted = m * (step.value + kappa * (term.value if term is not None else 0.0))
            limits = [x for x in (m_limit, k_limit) if x != NO_LIMIT]
            noise = step.se ** 2 + (kappa * term.se) ** 2 if term is not None else step.se ** 2
            candidates.append(((wanted - predicted) ** 2 + noise, m, kappa, predicted, limits))
    best = min(c[0] for c in candidates) + 0.1 * step.se ** 2  # closer than the noise can tell: a tie
    _, m, kappa, predicted, limits = min((c for c in candidates if c[0] <= best), key=lambda c: (-c[1], abs(c[2])))
    if rule.max_drop is not None and predicted < -rule.max_drop * (1 + 1e-12):
        limits.append("drop limit exceeded")
    direction = "entropy falling" if excess > 0 else "entropy rising"
    how = [f"entropy term {kappa:+.3g}"] if kappa else []
    how += [f"lr x{m:.3g}"] if m != 1.0 else []
    words = f"{direction} beyond the budget: " + (" and ".join(how) if how else "no lever moves it")
    return Decision(m, kappa, wanted, predicted, words, " and ".join(limits) or NO_LIMIT)


def target_of(target: float | str | Callable[[int], float]) -> Callable[[int, float | None], float]:
    """(step, Ĥ of the first probed step) ↦ H* for a target in nats/token, a callable step ↦ H*, or "initial"
    (hold the entropy of the first probed step). ConfigError for anything else."""
    if target == INITIAL:
        return lambda step, initial: initial
    if callable(target):
        return lambda step, initial: float(target(step))
    if isinstance(target, (int, float)) and not isinstance(target, bool) and math.isfinite(target) and target >= 0:
        return lambda step, initial: float(target)
    raise ConfigError(f"{KEY}: target must be an entropy in nats/token (>= 0), a callable step -> H, or "
                      f"{INITIAL!r}; got {target!r}")


Measure = Callable[[float, float], Estimate]


def finite(measure: Measure) -> Measure:
    """`measure`, raising NumericsError on a change or SE that is not finite: the law would read a NaN as
    "within the budget" and rest, silently."""
    def checked(m: float, kappa: float) -> Estimate:
        change = measure(m, kappa)
        if not (math.isfinite(change.value) and math.isfinite(change.se)):
            raise NumericsError(f"{KEY}: the measured change of the step at lr x{m:.3g}, entropy term {kappa:+.3g} "
                                f"is not finite ({change.value} ± {change.se}): the importance weights on E "
                                "degenerated; this step keeps the previous lr multiplier and takes no term")
        return change
    return checked


def secant(untouched: Estimate, term: Estimate | None, at: Decision, measured: Estimate) -> tuple:
    """The step's and the term's effects as secants through a measured change at (m, κ) of `at`: the term's
    slope (ΔH(m, κ)/m − ΔH(1, 0))/κ where κ ≠ 0, else the step's slope ΔH(m, 0)/m; their SEs kept."""
    m, kappa = at.multiplier, at.term
    if kappa and term is not None:
        return untouched, Estimate((measured.value / m - untouched.value) / kappa, term.se)
    return Estimate(measured.value / m, measured.se / m), term


def decide_measured(rule: AutopilotRule, *, gap: Estimate, previous: float, term: Estimate | None,
                    measure: Measure) -> Decision:
    """`decide` on measured changes: the untouched step's ΔH(1, 0) in place of δ, then once more on the secants
    through the first decision's measured change; of the decisions, the one whose measured change misses the
    wanted change least (ties: the larger m, then the smaller |κ|)."""
    measure = finite(measure)
    untouched = measure(1.0, 0.0)
    first = decide(rule, step=untouched, gap=gap, previous=previous, term=term)
    resting, rest_limit = limited_multiplier(rule, 1.0, previous)
    at_rest = untouched if resting == 1.0 else measure(resting, 0.0)
    if (first.multiplier, first.term) == (resting, 0.0):
        return dataclasses.replace(first, predicted=at_rest.value, predicted_se=at_rest.se)
    tried = [(first, measure(first.multiplier, first.term))]
    step, term_secant = secant(untouched, term, first, tried[0][1])
    second = decide(rule, step=step, gap=gap, previous=previous, term=term_secant)
    if (second.multiplier, second.term) != (first.multiplier, first.term):
        tried.append((second, measure(second.multiplier, second.term)))
    words = first.steering.split(":")[0] + ": no lever predicted to do better"
    tried.append((Decision(resting, 0.0, first.wanted, at_rest.value, words, rest_limit), at_rest))

    def miss(pair: tuple[Decision, Estimate]) -> float:
        return (first.wanted - pair[1].value) ** 2 + pair[1].se ** 2

    best = min(miss(p) for p in tried) + 0.1 * untouched.se ** 2
    chosen, change = min((p for p in tried if miss(p) <= best), key=lambda p: (-p[0].multiplier, abs(p[0].term)))
    return dataclasses.replace(chosen, wanted=first.wanted, predicted=change.value, predicted_se=change.se)
