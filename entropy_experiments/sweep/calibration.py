"""sweep.json `calibration`: per predictor, how its predictions line up with what was measured.

Two comparisons per predictor (names as in results.json `predictors`; `adamw_step` is the probe's δH₁):

* `own`: over the probed checkpoints, the predictor's δH₁ against the probe's own ΔH(η) at the smallest
  positive η, scaled to the checkpoint's lr (ΔH(η)·lr/η), with z = the row's `z_own`;
* `realised`: over the `realised` rows, dH_predicted against dH_realised = H(to) − H(from), with the row's z.

Each: n, sign agreement (over all pairs, and `sign_agreement_resolved` over the `n_resolved` pairs whose measured
value is resolved, |measured| > 2·SE), Pearson and Spearman r with 95 % percentile-bootstrap intervals (`ci95`;
pairs that share a checkpoint share its E: the bootstrap over pairs is approximate, and with few pairs too narrow)
and 95 % Fisher-z intervals (`ci95_fisher`, from n alone: wider with few pairs, independence still assumed), coverage (the fraction of finite z with
|z| < 1.96, i.e. of ±1.96·SE intervals that cover the measured value, with the number of finite z) and the median
of predicted / measured, and `rms_z` = √(mean z²) over the finite z (1 for honest error bars). The `displacement`
predictor comes first; its realised z is the first-order residual's.

The scale-free entropy proxies (estimators/entropy_proxies.py: `scale_free: true` in results.json) have no SE and
no scale, so no z. A proxy is a change per unit logit step, and the realised change scales with the lr, so each
pair's proxy is first multiplied by the lr of the step(s) it predicts (`predicted_as` says so): own, the
checkpoint's lr × proxy; realised, the interval's Σ lr × proxy (steps × the `from` checkpoint's lr, as the
predictors' K·δH₁) — one scale then fits a warm-up or a decaying schedule. Every number of the comparison (sign,
r, the scale) uses that product. They carry `loo_scale` instead of a z — {scale: the one scale c fitted on all
pairs (weighted least squares of measured on c·lr·proxy through 0, weights 1/SE² of the measured value), coverage
and rms_z of z_i = (c₍₋ᵢ₎·lr_i·proxy_i − measured_i)/SE_i with c₍₋ᵢ₎ fitted without pair i, n: the number of
finite z_i}.

`decomposition` (sweep.json): the coverage of the realised intervals' first-order, second-order and U-noise z
(sweep/decomposition.py).
"""

from __future__ import annotations

import math

from ..estimators.entropy_proxies import PROXIES
from .stats import (
    bootstrap_ci,
    coverage,
    fisher_ci,
    fitted_scale,
    loo_scale_z,
    median_ratio,
    pearson,
    rms,
    sign_agreement,
    spearman,
)

__all__ = ["LR_SCALED", "calibration", "decomposition_coverage", "metrics"]

# sweep.json `calibration.<proxy>.<vs>.predicted_as`: what the proxy's numbers were turned into before comparing
LR_SCALED = {"own": "lr × proxy", "realised": "Σ lr over the interval's steps × proxy"}


def _finite_or_none(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def _none_nan(xs: list[float | None]) -> list[float]:
    return [float("nan") if v is None else v for v in xs]


def loo_scale(predicted: list[float], measured: list[float], se_measured: list[float | None]) -> dict:
    """{scale, coverage, rms_z, n} of a scale-free predictor (see the module docstring)."""
    se = _none_nan(se_measured)
    zs = loo_scale_z(predicted, measured, se) if predicted else []
    return {"scale": _finite_or_none(fitted_scale(predicted, measured, se)) if predicted else None,
            "coverage": _finite_or_none(coverage(zs)), "rms_z": _finite_or_none(rms(zs)),
            "n": sum(1 for v in zs if math.isfinite(v))}


def metrics(predicted: list[float], measured: list[float], z: list[float | None],
            se_measured: list[float | None], scale_free: bool = False) -> dict:
    """The calibration summary of one comparison (see the module docstring); None where undefined."""
    zs = [float("nan") if v is None else v for v in z]
    resolved = [i for i, (y, se) in enumerate(zip(measured, se_measured, strict=True))
                if se is not None and math.isfinite(se) and abs(y) > 2 * se]
    out = {"n": len(predicted), "sign_agreement": _finite_or_none(sign_agreement(predicted, measured)),
           "n_resolved": len(resolved),
           "sign_agreement_resolved": _finite_or_none(sign_agreement([predicted[i] for i in resolved],
                                                                     [measured[i] for i in resolved]))}
    for name, fn in (("pearson", pearson), ("spearman", spearman)):
        lo, hi = bootstrap_ci(predicted, measured, fn)
        r = fn(predicted, measured)
        f_lo, f_hi = fisher_ci(r, len(predicted), rank=name == "spearman")
        out[name] = {"r": _finite_or_none(r), "ci95": [_finite_or_none(lo), _finite_or_none(hi)],
                     "ci95_fisher": [_finite_or_none(f_lo), _finite_or_none(f_hi)]}
    out["coverage"] = {"value": _finite_or_none(coverage(zs)), "n": sum(1 for v in zs if math.isfinite(v))}
    out["rms_z"] = _finite_or_none(rms(zs))
    out["median_ratio"] = _finite_or_none(median_ratio(predicted, measured))
    if scale_free:
        out["scale_free"], out["loo_scale"] = True, loo_scale(predicted, measured, se_measured)
    return out


def _own_pairs(rows: list[dict], name: str) -> tuple[list, list, list, list]:
    xs, ys, zs, ses = [], [], [], []
    for row in rows:
        pred, true = row["predictors"].get(name), row["deltaH_true"]
        if pred is None or true is None or pred["delta_h1"] is None or true["scaled"] is None:
            continue
        xs.append(pred["delta_h1"] * (row["lr"] if name in PROXIES else 1.0))  # realised: rows.interval_prediction
        ys.append(true["scaled"])
        zs.append(pred["z_own"])
        ses.append(true["se_scaled"])
    return xs, ys, zs, ses


def _realised_pairs(realised: list[dict], name: str) -> tuple[list, list, list, list]:
    xs, ys, zs, ses = [], [], [], []
    for row in realised:
        pred = row["predictors"].get(name)
        if pred is None or pred["dH_predicted"] is None or row["dH_realised"] is None:
            continue
        xs.append(pred["dH_predicted"])
        ys.append(row["dH_realised"])
        zs.append(pred["z"])
        ses.append(row["se"])
    return xs, ys, zs, ses


def calibration(rows: list[dict], realised: list[dict]) -> dict:
    """{predictor: {"own": metrics, "realised": metrics}} over every predictor named in any row."""
    names: list[str] = []
    for row in rows:
        names += [n for n in row["predictors"] if n not in names]
    names.sort(key=lambda n: n != "displacement")  # stable: the displacement first, the others as found
    out = {name: {"own": metrics(*_own_pairs(rows, name), scale_free=name in PROXIES),
                  "realised": metrics(*_realised_pairs(realised, name), scale_free=name in PROXIES)}
           for name in names}
    for name in set(names) & set(PROXIES):
        for vs, said in LR_SCALED.items():
            out[name][vs]["predicted_as"] = said
    return out


def decomposition_coverage(realised: list[dict]) -> dict:
    """{first_order, with_second_order, u_noise}: {coverage, n} of those z over the realised intervals."""
    out = {}
    for key in ("first_order", "with_second_order", "u_noise"):
        zs = [row[key]["z"] for row in realised if row.get(key) and row[key]["z"] is not None]
        out[key] = {"coverage": _finite_or_none(coverage(zs)) if zs else None, "n": len(zs)}
    return out
