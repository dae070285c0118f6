"""sweep.json `calibration`: per predictor, how its predictions line up with what was measured.

Two comparisons per predictor (names as in results.json `predictors`; `adamw_step` is the probe's δH₁):

* `own`: over the probed checkpoints, the predictor's δH₁ against the probe's own ΔH(η) at the smallest
  positive η, scaled to the checkpoint's lr (ΔH(η)·lr/η), with z = the row's `z_own`;
* `realised`: over the `realised` rows, dH_predicted against dH_realised = H(to) − H(from), with the row's z.

Each: n, sign agreement, Pearson and Spearman r with 95 % percentile-bootstrap intervals, coverage (the
fraction of finite z with |z| < 1.96, i.e. of ±1.96·SE intervals that cover the measured value, with the
number of finite z) and the median of predicted / measured.
"""

from __future__ import annotations

import math

from .stats import bootstrap_ci, coverage, median_ratio, pearson, sign_agreement, spearman

__all__ = ["calibration", "metrics"]


def _finite_or_none(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def metrics(predicted: list[float], measured: list[float], z: list[float | None]) -> dict:
    """The calibration summary of one comparison (see the module docstring); None where undefined."""
    zs = [float("nan") if v is None else v for v in z]
    out = {"n": len(predicted), "sign_agreement": _finite_or_none(sign_agreement(predicted, measured))}
    for name, fn in (("pearson", pearson), ("spearman", spearman)):
        lo, hi = bootstrap_ci(predicted, measured, fn)
        out[name] = {"r": _finite_or_none(fn(predicted, measured)),
                     "ci95": [_finite_or_none(lo), _finite_or_none(hi)]}
    out["coverage"] = {"value": _finite_or_none(coverage(zs)), "n": sum(1 for v in zs if math.isfinite(v))}
    out["median_ratio"] = _finite_or_none(median_ratio(predicted, measured))
    return out


def _own_pairs(rows: list[dict], name: str) -> tuple[list[float], list[float], list[float | None]]:
    xs, ys, zs = [], [], []
    for row in rows:
        pred, true = row["predictors"].get(name), row["deltaH_true"]
        if pred is None or true is None or pred["delta_h1"] is None or true["scaled"] is None:
            continue
        xs.append(pred["delta_h1"])
        ys.append(true["scaled"])
        zs.append(pred["z_own"])
    return xs, ys, zs


def _realised_pairs(realised: list[dict], name: str) -> tuple[list[float], list[float], list[float | None]]:
    xs, ys, zs = [], [], []
    for row in realised:
        pred = row["predictors"].get(name)
        if pred is None or pred["dH_predicted"] is None or row["dH_realised"] is None:
            continue
        xs.append(pred["dH_predicted"])
        ys.append(row["dH_realised"])
        zs.append(pred["z"])
    return xs, ys, zs


def calibration(rows: list[dict], realised: list[dict]) -> dict:
    """{predictor: {"own": metrics, "realised": metrics}} over every predictor named in any row."""
    names: list[str] = []
    for row in rows:
        names += [n for n in row["predictors"] if n not in names]
    return {name: {"own": metrics(*_own_pairs(rows, name)), "realised": metrics(*_realised_pairs(realised, name))}
            for name in names}
