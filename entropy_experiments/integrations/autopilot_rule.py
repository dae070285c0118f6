"""The entropy autopilot's rule: which lr multiplier m the next step gets (pure, no model).

An AdamW step is linear in its learning rate, so with δH_next ± SE_E predicted at the scheduler's lr (m = 1) the
step taken with lr·m changes the entropy by m·δH_next ± m·SE_E. Given the entropy Ĥ ± SE_Ĥ now and the target H*:

    gap         g = H* − Ĥ shrunk toward 0 by deadband_z·SE_Ĥ (sign(g)·max(|g| − z·SE_Ĥ, 0)): a gap within
                Ĥ's own noise asks for no change (the step's lr is lowered, never raised, on noise in Ĥ)
    wanted      w = gain·g, but never below −max_drop (the most the entropy may fall in one step)
    deadband    |m_prev·δH_next − w| ≤ z·m_prev·SE_E: the previous multiplier already reaches w within noise → keep
    no signal   |δH_next| ≤ z·SE_E: the step's direction of change is noise → keep m_prev
    otherwise   m = w / δH_next (negative — the step moves the wrong way — ends at the smallest allowed m)
    drop limit  m·δH_next ≥ −max_drop (m lowered where the predicted fall is larger)
    rate limit  m_prev / max_rate ≤ m ≤ m_prev·max_rate
    bounds      min_multiplier ≤ m ≤ max_multiplier (applied last: m is always within them; the drop limit
                gives way only where the rate limit or min_multiplier forbids a smaller m, and the decision's
                reason then ends in `drop_limit_exceeded`)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from entropy_experiments.errors import ConfigError

KEY = "EntropyAutopilot"
INITIAL = "initial"


@dataclass(frozen=True)
class AutopilotRule:
    """The autopilot's settings (module docstring)."""

    min_multiplier: float = 0.1
    max_multiplier: float = 2.0
    max_drop: float | None = 0.05   # nats/token per step; None: no limit
    deadband_z: float = 1.0
    max_rate: float = 1.5
    gain: float = 1.0

    def check(self) -> None:
        """ConfigError naming the option unless the settings make a rule."""
        if not 0 < self.min_multiplier <= 1 <= self.max_multiplier < math.inf:
            raise ConfigError(f"{KEY}: need 0 < min_multiplier <= 1 <= max_multiplier < inf, got "
                              f"{self.min_multiplier!r}, {self.max_multiplier!r}")
        if self.max_drop is not None and not self.max_drop >= 0:
            raise ConfigError(f"{KEY}: max_drop must be >= 0 nats/token (or None), got {self.max_drop!r}")
        if not self.deadband_z >= 0:
            raise ConfigError(f"{KEY}: deadband_z must be >= 0, got {self.deadband_z!r}")
        if not 1 <= self.max_rate < math.inf:
            raise ConfigError(f"{KEY}: max_rate must be >= 1 (the factor m may change by per step), "
                              f"got {self.max_rate!r}")
        if not 0 < self.gain <= 1:
            raise ConfigError(f"{KEY}: gain must be in (0, 1] (the share of the gap closed per step), got {self.gain!r}")


@dataclass(frozen=True)
class Decision:
    """The multiplier chosen, the change it aimed at, and why (target, deadband, no_signal; + drop_limit, rate,
    bounds where those moved it; + drop_limit_exceeded where the predicted fall at m is still above max_drop)."""

    multiplier: float
    wanted: float
    reason: str


def decide(rule: AutopilotRule, *, predicted: float, se: float, H: float, H_target: float,
           previous: float, H_se: float = 0.0) -> Decision:
    """The multiplier of the next step from δH_next ± SE_E at m = 1, Ĥ ± SE_Ĥ now, the target and the previous m."""
    gap = H_target - H
    beyond_noise = max(abs(gap) - rule.deadband_z * H_se, 0.0)
    wanted = rule.gain * math.copysign(beyond_noise, gap) if beyond_noise else 0.0
    if rule.max_drop is not None:
        wanted = max(wanted, -rule.max_drop)
    if abs(previous * predicted - wanted) <= rule.deadband_z * previous * se:
        m, reasons = previous, ["deadband"]
    elif abs(predicted) <= rule.deadband_z * se:
        m, reasons = previous, ["no_signal"]
    else:
        m, reasons = wanted / predicted, ["target"]
    if rule.max_drop is not None and m * predicted < -rule.max_drop:
        m, reasons = rule.max_drop / -predicted, reasons + ["drop_limit"]
    for name, low, high in (("rate", previous / rule.max_rate, previous * rule.max_rate),
                            ("bounds", rule.min_multiplier, rule.max_multiplier)):
        if not low <= m <= high:
            m, reasons = min(max(m, low), high), reasons + [name]
    if rule.max_drop is not None and m * predicted < -rule.max_drop * (1 + 1e-12):
        reasons.append("drop_limit_exceeded")
    return Decision(float(m), float(wanted), "+".join(reasons))


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
