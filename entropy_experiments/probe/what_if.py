"""What-if (`entropy-probe run --what-if objective.<key>=<value> … [--solve objective.entropy_coef]`, docs/outputs.md
"what_if"): δH₁ of other objectives on the SAME E and U as the run, each against the run's own objective.

X̂ (and the E scores, the surrogate's coefficients) come from the run; each variant costs one U backward (its
objective's gradient per U group → v by the loaded AdamW state) and one no-grad jvp pass over E for its pieces
a, r along v (the E side of its error bar). The baseline's pieces are taken by the same jvp pass, so that the
paired differences are of like with like (estimators/what_if.py).

`--solve` (a coefficient the loss is affine in) takes two U backwards, at 0 and 1: g(c) = g(0) + c·(g(1) − g(0))
exactly, and δH₁(c) = lr·X̂·v(g(c)) through AdamW (nonlinear in g) is solved by bisection; one more U backward at the
root checks the interpolation and gives the SE whose band δH₁ ± SE crossing the target is the interval.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import yaml

from ..config import ProbeConfig, config_from_dict
from ..config.messages import unknown_key_problem
from ..config.sections import ObjectiveSection
from ..data.batch import Batch
from ..errors import ConfigError
from ..estimators.jackknife import leave_one_group_out_directions
from ..estimators.objective_gradient import UGradients, split_into_groups
from ..estimators.solve_interval import End, inverted_interval
from ..estimators.step_directions import probe_step
from ..estimators.student_t import t_quantile
from ..estimators.surrogate import directional_pieces
from ..estimators.update_direction import named_dot
from ..estimators.what_if import (
    DirectionEstimate,
    EStatistic,
    direction_estimate,
    find_root,
    interpolated,
    paired_difference,
)
from . import recipe
from .parallel import SINGLE, DistContext
from .results import Policy

SOLVABLE_KEYS = ("objective.entropy_coef",)  # coefficients the trainer loss is affine in (docs/objectives.md)
_SPEC = re.compile(r"\s*([A-Za-z_][\w.]*)\s*=(.*)", re.DOTALL)


@dataclass(frozen=True)
class WhatIfRequest:
    """The variants ((objective.<key>, value) pairs), the key to solve for (None: none) and its target δH₁."""

    variants: tuple[tuple[str, Any], ...]
    solve: str | None = None
    target: float = 0.0


def variant_config(config: ProbeConfig, key: str, value: Any) -> ProbeConfig:
    """`config` with objective key `key` (dotted, objective.*) set to `value`; ConfigError naming it when invalid."""
    d = config.to_dict()
    d["objective"][key.split(".", 1)[1]] = value
    try:
        variant = config_from_dict(d)
        variant.objective_options()
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"--what-if {key}={value!r}: {exc}") from None
    return variant


def parse_value(text: str) -> Any:
    """A --what-if value read as YAML, with `1e-3` a float (YAML 1.2)."""
    try:
        return float(text) if re.fullmatch(r"\s*[-+]?\d+(\.\d*)?[eE][-+]?\d+\s*", text) else yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(f"--what-if: value {text!r} is not valid YAML") from None


def parse_request(config: ProbeConfig, specs: list[str] | None, solve: str | None,
                  target: float | None) -> WhatIfRequest | None:
    """The what-if of the command line, every variant checked against `config` (None: no --what-if, no --solve)."""
    if not specs and solve is None:
        if target is not None:
            raise ConfigError("--solve-target needs --solve objective.<key>")
        return None
    variants = []
    for spec in specs or []:
        match = _SPEC.fullmatch(spec)
        if match is None:
            raise ConfigError(f"--what-if expects objective.<key>=<value>, got {spec!r}")
        key, value = match.group(1), parse_value(match.group(2))
        section, _, leaf = key.partition(".")
        if section != "objective" or leaf not in ObjectiveSection.model_fields:
            raise ConfigError(f"--what-if {key}: " + (unknown_key_problem(key) or "not an objective key "
                              "(objective.entropy_coef, objective.loss_type, objective.top_entropy_quantile, …)"))
        variant_config(config, key, value)
        variants.append((key, value))
    if solve is not None:
        if solve not in SOLVABLE_KEYS:
            raise ConfigError(f"--solve {solve}: not a scalar coefficient the objective is affine in "
                              f"(one of {', '.join(SOLVABLE_KEYS)})")
        check_solvable(config, solve)
        if config.objective.use_adaptive_entropy:
            raise ConfigError(f"--solve {solve}: objective.use_adaptive_entropy sets the coefficient from the "
                              "checkpoint's controller state")
    if target is not None and not math.isfinite(target):
        raise ConfigError(f"--solve-target {target!r}: must be a finite number")
    return WhatIfRequest(tuple(variants), solve, 0.0 if target is None else float(target))


def check_solvable(config: ProbeConfig, solve: str) -> None:
    """ConfigError unless SE_U exists (≥ 2 U groups): the solved interval is an interval of δH₁'s whole error."""
    if not config.variance.enabled:
        raise ConfigError(f"--solve {solve}: needs SE_U (≥ 2 U groups) for its interval; variance.enabled is false")
    groups = config.u_group_count()
    if groups < 2:
        raise ConfigError(f"--solve {solve}: needs SE_U (≥ 2 U groups) for its interval; batch_config.B_U "
                          f"{config.batch_config.B_U} and variance.u_groups {config.variance.u_groups} give {groups}")


@dataclass(frozen=True)
class Context:
    """What every variant shares: the run's config, policy, E, U groups, X̂ and coefficients, and the E statistic."""

    config: ProbeConfig
    policy: Policy
    E: Batch
    U: Batch
    groups: list[list[int]]
    res: Any  # probe.results.DeltaH1Result of the run
    e_stat: EStatistic
    dist: DistContext

    def value(self, config: ProbeConfig, grads: dict) -> float:
        """δH₁ = lr·X̂·v for the U gradient `grads` under `config`'s step options."""
        return self.e_stat.learning_rate * named_dot(self.res.X_hat, probe_step(config.step_options(), self.policy,
                                                                                grads))

    def estimate(self, config: ProbeConfig, v: dict, grads: UGradients) -> DirectionEstimate:
        """δH₁ along v with its pieces (one jvp pass over E) and the U replicates lr·X̂·v₍₋k₎."""
        lr, X = self.e_stat.learning_rate, self.res.X_hat
        scores = recipe.score_E(config, self.policy, self.E, v, self.dist)
        a, r = directional_pieces(scores.d_logq, scores.d_entropy, self.res.coefficients)
        loo = (leave_one_group_out_directions(partial(probe_step, config.step_options(), self.policy), grads)
               if len(grads.groups) >= 2 else [])
        return direction_estimate(lr * named_dot(X, v), a, r, [lr * named_dot(X, w) for w in loo], self.e_stat)

    def gradients(self, config: ProbeConfig) -> UGradients:
        return recipe.update_gradients(config, self.policy, self.U, self.groups, self.dist)


def estimate_entry(est: DirectionEstimate) -> dict:
    """δH₁ and its SEs: `se` NaN (null in results.json) where SE_U is missing, `se_U_df` its degrees of freedom."""
    return {"deltaH1": est.value, "se": est.se, "se_E": est.se_E, "se_U": est.se_U, "se_U_df": est.df_U}


def variant_entry(ctx: Context, key: str, value: Any, baseline: DirectionEstimate) -> dict:
    """One variant: one U backward, its direction, δH₁ ± SE and its paired difference from the baseline."""
    config = variant_config(ctx.config, key, value)
    grads = ctx.gradients(config)
    est = ctx.estimate(config, probe_step(config.step_options(), ctx.policy, grads.total), grads)
    diff = paired_difference(est, baseline, ctx.e_stat)
    return {"key": key, "value": value, **estimate_entry(est), "diff": diff.value, "diff_se": diff.se,
            "diff_se_E": diff.se_E, "diff_se_U": diff.se_U, "u_loss": grads.loss}


def interpolated_gradients(a: UGradients, b: UGradients, t: float) -> UGradients:
    """The U gradients at a + t·(b − a) of a coefficient the loss is affine in: the total and every group's
    (exact; the normalisers and so the leave-one-out scales do not depend on the coefficient)."""
    return replace(a, total=interpolated(a.total, b.total, t),
                   groups=[interpolated(x, y, t) for x, y in zip(a.groups, b.groups, strict=True)],
                   loss=a.loss + t * (b.loss - a.loss))


def end_entry(end: End, level: float) -> dict | None:
    """results.json `solve.ends[i]` (None: unbounded on that side)."""
    if end.c is None:
        return None
    bars = end.bars
    return {"value": end.c, "se": bars.se, "se_E": bars.se_E, "se_U": bars.se_U, "df": bars.df,
            "quantile": t_quantile(level, bars.df), "settled": end.settled}


def solve_entry(ctx: Context, key: str, target: float) -> dict:
    """The coefficient at which δH₁ = target, its interval at the configured level by test inversion (SE evaluated
    at each end), whether that set is one interval around it, and the interpolation check."""
    at = {c: ctx.gradients(variant_config(ctx.config, key, c)) for c in (0.0, 1.0)}
    f = lambda c: ctx.value(ctx.config, interpolated(at[0.0].total, at[1.0].total, c))
    current = float(getattr(ctx.config.objective_options(), key.split(".", 1)[1]))
    step, level = max(abs(current), 1e-3), ctx.config.what_if.level
    root = find_root(f, target, current, step)
    out = {"key": key, "target": target, "value": root, "level": level, "interval": [None, None],
           "ends": [None, None], "interval_note": None, "deltaH1": None, "se": None, "se_E": None, "se_U": None,
           "df": None,
           "interpolation_error": None}
    if root is None:
        out["reason"] = f"δH₁ does not reach {target:g} for any {key} within ±{step * 2.0 ** 60:.3g} of {current:g}"
        return out
    config = variant_config(ctx.config, key, root)
    grads = ctx.gradients(config)
    est = ctx.estimate(config, probe_step(config.step_options(), ctx.policy, grads.total), grads)

    def bars_at(c: float) -> DirectionEstimate:  # the U side exact from the interpolated groups, E by a jvp pass
        config_c, grads_c = variant_config(ctx.config, key, c), interpolated_gradients(at[0.0], at[1.0], c)
        return ctx.estimate(config_c, probe_step(config_c.step_options(), ctx.policy, grads_c.total), grads_c)

    inv = inverted_interval(f, bars_at, target, root, est, step, level)
    out.update(interval=[inv.lo.c, inv.hi.c], ends=[end_entry(inv.lo, level), end_entry(inv.hi, level)],
               interval_note=inv.note, deltaH1=est.value, se=est.se, se_E=est.se_E, se_U=est.se_U, df=est.df,
               interpolation_error=abs(est.value - f(root)))
    return out


def what_if_phase(request: WhatIfRequest, config: ProbeConfig, policy: Policy, E: Batch, U: Batch, res,
                  dist: DistContext = SINGLE) -> dict:
    """results.json `what_if_baseline`, `what_if` (one entry per variant) and `solve` (None: not asked), with the
    seconds they took (`what_if_seconds`)."""
    t0 = time.perf_counter()
    s = res.scores
    e_stat = EStatistic(s.seq_entropies, s.lengths, list(s.unit_of_sequence), config.estimator.normalize,
                        res.learning_rate, res.sampler_weights)
    groups = split_into_groups(U.num_prompts, len(res.u_gradients.groups))
    if request.solve and len(groups) < 2:  # a resumed run's U may hold fewer prompts than the config says
        raise ConfigError(f"--solve {request.solve}: needs SE_U (≥ 2 U groups) for its interval; U has "
                          f"{len(groups)} group")
    ctx = Context(config, policy, E, U, groups, res, e_stat, dist)
    baseline = ctx.estimate(config, res.v, res.u_gradients)
    rows = [variant_entry(ctx, key, value, baseline) for key, value in request.variants]
    solved = solve_entry(ctx, request.solve, request.target) if request.solve else None
    return {"what_if_baseline": estimate_entry(baseline), "what_if": rows, "solve": solved,
            "what_if_seconds": time.perf_counter() - t0, "warnings": what_if_warnings(baseline, solved)}


def what_if_warnings(baseline: DirectionEstimate, solved: dict | None) -> list[str]:
    """Once per what-if: the total SEs left out (SE_U missing), and a solved set that is not one interval."""
    out = []
    if not math.isfinite(baseline.se_U):
        out.append("what-if: SE_U unavailable (one U group: variance.enabled false or B_U = 1), so every total SE "
                   "of the what-if is n/a (null in results.json); SE_E alone leaves out U's sampling noise, "
                   "usually the larger side")
    if solved and solved.get("interval_note"):
        out.append(f"solve {solved['key']}: {solved['interval_note']}")
    return out


def what_if_hook(request: WhatIfRequest | None):
    """The `after_estimates` callback of `recipe.run` for `request` (None: no what-if)."""
    if request is None:
        return None
    return partial(what_if_phase, request)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _pm(value: Any, se: Any) -> str:
    """`value ± se` (n/a where a number is missing: null in results.json, NaN before it is written)."""
    if not _finite(value):
        return "n/a"
    return f"{value:+.4e} ± {se:.2e}" if _finite(se) else f"{value:+.4e} ± n/a"


def _sides(entry: dict) -> str:
    """`(SE_E …, SE_U … with its df)`, or what the n/a total leaves out when SE_U is missing."""
    se_e, se_u, df = entry.get("se_E"), entry.get("se_U"), entry.get("se_U_df")
    if not _finite(se_u):
        return f"(SE_E {se_e:.2e} only: no SE_U, one U group)" if _finite(se_e) else ""
    return f"(SE_E {se_e:.2e}, SE_U {se_u:.2e}, df {df:.0f})" if _finite(df) else ""


def solve_text(solved: dict) -> list[str]:
    """The solved coefficient, its interval at its level and the SE at each end, and a note when the set is not
    one interval around it."""
    if solved["value"] is None:
        return [f"  solve {solved['key']}: {solved['reason']}"]
    lo, hi = (f"{x:.4g}" if x is not None else "unbounded" for x in solved["interval"])
    ses = "; ".join(f"SE at {name} {end['se']:.2e} (t {end['quantile']:.3g}, df {end['df']:.3g})"
                    for name, end in zip(("lo", "hi"), solved.get("ends") or []) if end)
    level = solved.get("level")
    level_text = f"{100 * level:g} % interval" if _finite(level) else "interval"
    head = (f"  solve {solved['key']}: δH₁ = {solved['target']:g} at {solved['value']:.4g}, {level_text} "
            f"[{lo}, {hi}] (|δH₁(c) − {solved['target']:g}| ≤ t·SE(c); {ses or 'no end'}); δH₁ of a U backward "
            f"there {_pm(solved['deltaH1'], solved['se'])}")
    lines = [head]
    if solved.get("interval_note"):
        lines.append(f"    ⚠ {solved['interval_note']}")
    return lines


def what_if_text(results: dict) -> str:
    """The printed what-if table (empty when the run had none)."""
    rows, base = results.get("what_if"), results.get("what_if_baseline")
    if base is None:
        return ""
    lines = ["What-if (same E and U):",
             f"  {'baseline objective':<36} δH₁ = {_pm(base['deltaH1'], base['se'])} {_sides(base)}"]
    for row in rows or []:
        label = f"{row['key']}={row['value']}"
        lines.append(f"  {label:<36} δH₁ = {_pm(row['deltaH1'], row['se'])} {_sides(row)}   "
                     f"diff = {_pm(row['diff'], row['diff_se'])} (paired)")
    if results.get("solve"):
        lines += solve_text(results["solve"])
    return "\n".join(lines)
