"""One-line texts of a run shared by the console summary, report.html and the benches: number formatting, which
optional phases ran, the sampler and its correction, the trainer objective v is the step of."""

from __future__ import annotations

import math
from typing import Any


def is_finite_number(x: Any) -> bool:
    """Whether `x` is a finite int / float (not a bool, not None / NaN / ±inf)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def format_number(x: Any, spec: str = ".4g") -> str:
    """Format a number; None / NaN (written as null in results.json) show as 'n/a'."""
    return format(x, spec) if is_finite_number(x) else "n/a"


OPTIONAL_PHASES = (("variance.enabled", "error_bars"), ("importance.enabled", "delta_h"),
                   ("second_order.enabled", "second_order"), ("predictors.enabled", "predictors"))


def optional_phases_line(timing: dict[str, Any]) -> str:
    """Which optional phases ran, with their seconds and share of the total (results.json `timing`), and which
    were off, so that a user sees where the time went and which switch saves it."""
    total = timing.get("total")
    ran, off = [], []
    for switch, key in OPTIONAL_PHASES:
        seconds = timing.get(key)
        if not is_finite_number(seconds):
            off.append(switch.split(".")[0])
            continue
        share = f" ({100 * seconds / total:.0f} %)" if is_finite_number(total) and total > 0 else ""
        ran.append(f"{switch.split('.')[0]} {seconds:.1f} s{share}")
    text = "ran: " + (", ".join(ran) if ran else "none")
    if ran:
        text += " (set <phase>.enabled: false to skip one)"
    return text + ("; off: " + ", ".join(off) if off else "")


def sampler_lines(sampler: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(label, text) rows for results.json `sampler`: what drew E and U and how fast, then the importance
    correction's distance from the policy when the sampler was not the policy (docs/sampler-correction.md)."""
    if not sampler:
        return []
    rows = []
    if sampler.get("sampled"):
        speeds = "; ".join(f"{name} {gen.get('rows_per_call')} rows/call, "
                           f"{format_number(gen.get('tokens_per_s'), '.4g')} new tokens/s"
                           for name in ("E", "U") if isinstance(gen := sampler.get(name), dict))
        rows.append(("sampler", f"{sampler.get('dtype')}, {sampler.get('engine')}, {sampler.get('draws')}"
                                + (f"; {speeds}" if speeds else "")))
    elif sampler.get("sampled") is False:
        rows.append(("sampler", "saved batches reused (not sampled by this run)"))
    c = sampler.get("correction")
    if c:
        text = (f"ESS/E {format_number(c.get('ess_frac'), '.4f')}, k̂ {format_number(c.get('psis_khat'), '.2f')}, "
                f"KL {format_number(c.get('mean_token_kl'), '.2g')} nats/token, "
                f"max |Δlog q| {format_number(c.get('max_abs_dlogq'), '.2g')}")
        rows.append(("sampler correction", text))
    return rows


def objective_lines(objective: dict[str, Any] | None) -> tuple[str, str] | None:
    """The resolved trainer objective v is the step of (results.json update.objective): (loss and advantages,
    the other terms and constants)."""
    if not objective:
        return None
    o, scaling = objective, objective.get("scale_rewards")
    eps = f" (ε {format_number(o.get('advantage_eps'), 'g')})" if scaling not in (None, "none") else ""
    kl = f" ({o.get('kl_estimator')})" if is_finite_number(o.get("kl_coef")) and o["kl_coef"] != 0 else ""
    trainer = f" (trainer {o['trainer']})" if o.get("trainer") else ""
    terms = (f"β {format_number(o.get('kl_coef'), 'g')}{kl}, entropy_coef {format_number(o.get('entropy_coef'), 'g')}, "
             f"max_grad_norm {format_number(o.get('max_grad_norm'), 'g')}, max_completion_length "
             f"{o.get('max_completion_length')}, micro_batches {o.get('micro_batches')}, "
             f"num_iterations {o.get('num_iterations', 1)}{clip_note(o)}")
    return f"{o.get('loss_type')}{trainer}, advantages {scaling}{eps}", terms


def clip_note(objective: dict[str, Any]) -> str:
    """', ε 0.2 / ε_high 0.28 (no effect on the first on-policy step: ratio = 1)' when the clip range was given."""
    eps, high = objective.get("epsilon"), objective.get("epsilon_high")
    if eps is None and high is None:
        return ""
    return (f", ε {format_number(eps, 'g') if eps is not None else 'default'} / ε_high "
            f"{format_number(high, 'g') if high is not None else 'default'} (no effect on the first on-policy step: "
            "ratio = 1)")
