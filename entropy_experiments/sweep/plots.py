"""The sweep's three plots, drawn from sweep.json alone (matplotlib is imported when a plot is drawn).

* trajectory.png — left: Ĥ per step with ±1.96·SE bars; from each probed checkpoint a dashed segment to
  (next step, Ĥ + δH₁) (the predicted change of the next step); the line through the Ĥ points is what the run
  did. Right: per realised interval, dH_realised ± 1.96·SE against dH_predicted ± 1.96·√(se_pred² + se_batch²)
  and the displacement predictor δH_Δθ ± 1.96·SE_E (the step the run took; calibration.png shows it too).
* calibration.png — predicted against measured, 1:1 line, one colour per predictor; left the probe against its
  own ΔH(η)·lr/η, right the prediction against the realised change; both axes span the measured values, and a
  prediction far outside is drawn as ◀ / ▶ at the edge (counted in the legend). A scale-free proxy
  (docs/maths.md §13: a logit-space step of unknown size, not nats/token) is drawn at its fitted scale c
  (calibration.<name>.<vs>.loo_scale.scale), labelled "name × c (fitted)", or left out where c is undefined.
* predictors.png — the right panel of calibration.png split into one panel per predictor, each titled with its
  Pearson and Spearman r over the realised intervals.
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

from ..report.plot import can_plot, save_png

__all__ = ["at_fitted_scale", "plot_calibration", "plot_predictors", "plot_trajectory"]

Z95 = 1.96


def _ok(x) -> bool:
    return x is not None and math.isfinite(x)


def _figure(n_axes: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * n_axes, 4.5), constrained_layout=True)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, n_axes)


REALISED_LABEL = ("realised ΔH ± 1.96·SE (importance estimate on the same draws;\n"
                  "Ĥ(to) − Ĥ(from) only where it fell back)")
TRAJECTORY_NOTE = ("each Ĥ is on that checkpoint's own E, so its steps carry two batches' noise; the right panel's\n"
                   "realised ΔH scores the same draws at both ends (importance-weighted), so the two need not agree")


def _trajectory_panel(ax, doc: dict) -> None:
    rows = [r for r in doc["rows"] if _ok(r["H"])]
    steps, H = [r["step"] for r in rows], [r["H"] for r in rows]
    ax.errorbar(steps, H, yerr=[Z95 * (r["H_se"] or 0.0) for r in rows], fmt="o-", color="black", capsize=3,
                label="Ĥ ± 1.96·SE (realised path)")
    nxt = {a["step"]: b["step"] for a, b in itertools.pairwise(rows)}
    labelled = False
    for r in rows:
        if _ok(r["deltaH1"]):
            x1 = nxt.get(r["step"], r["step"] + 1)
            ax.plot([r["step"], x1], [r["H"], r["H"] + r["deltaH1"] * (x1 - r["step"])], "--", color="tab:red",
                    label=None if labelled else "predicted: Ĥ + δH₁ per step")
            labelled = True
        elif r["kind"] == "entropy_only":
            ax.annotate("Ĥ only", (r["step"], r["H"]), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"Ĥ ({doc['units']})")
    ax.set_title("Ĥ along the run (bars: Ĥ's own SE)", fontsize=10)
    ax.text(0.01, 0.01, TRAJECTORY_NOTE, transform=ax.transAxes, fontsize=7, va="bottom", color="dimgrey",
            wrap=True)
    ax.legend(fontsize=8)


def _realised_panel(ax, doc: dict) -> None:
    rows = [r for r in doc["realised"] if _ok(r["dH_realised"])]
    mids = [0.5 * (r["from_step"] + r["to_step"]) for r in rows]
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.errorbar(mids, [r["dH_realised"] for r in rows], yerr=[Z95 * (r["se"] or 0.0) for r in rows], fmt="o",
                color="black", capsize=3, label=REALISED_LABEL)
    pred = [(m, r) for m, r in zip(mids, rows) if _ok(r["dH_predicted"])]
    if pred:
        err = [Z95 * math.hypot(r["se_predicted"] or 0.0, r["se_batch"] or 0.0) for _, r in pred]
        ax.errorbar([m + 0.08 for m, _ in pred], [r["dH_predicted"] for _, r in pred], yerr=err, fmt="s",
                    color="tab:red", capsize=3, label="predicted (δH₁) ± 1.96·√(se² + se_batch²)")
    disp = [(m, r["displacement"]) for m, r in zip(mids, rows) if r.get("displacement") and _ok(r["displacement"]["value"])]
    if disp:
        ax.errorbar([m - 0.08 for m, _ in disp], [d["value"] for _, d in disp],
                    yerr=[Z95 * (d["se"] or 0.0) for _, d in disp], fmt="D", color="tab:green", capsize=3,
                    label="displacement δH_Δθ = X̂·Δθ ± 1.96·SE_E")
    ax.set_xlabel("training step (interval midpoint)")
    ax.set_ylabel(f"ΔH ({doc['units']})")
    ax.set_title("per-interval change: realised vs predicted")
    ax.legend(fontsize=8)


def plot_trajectory(doc: dict, path: str | os.PathLike) -> Path | None:
    """trajectory.png from sweep.json `doc` (see the module docstring); written atomically (None: no matplotlib)."""
    if not can_plot():
        return None
    fig, (ax, ax_real) = _figure(2)
    _trajectory_panel(ax, doc)
    _realised_panel(ax_real, doc)
    return save_png(fig, path)


def _limits(pairs: dict[str, list[tuple[float, float, float | None]]]) -> tuple[float, float]:
    """One range for both axes: the measured values with their ±1.96·SE bars, widened to the predictions that
    lie within one measured span of them (farther ones are drawn clamped at the edge)."""
    ends = [y + sign * Z95 * (se or 0.0) for pts in pairs.values() for _, y, se in pts for sign in (-1, 1)]
    lo, hi = min(ends), max(ends)
    span = hi - lo or abs(hi) or 1.0
    near = [x for pts in pairs.values() for x, _, _ in pts if lo - span <= x <= hi + span]
    lo, hi = min([lo, *near]), max([hi, *near])
    pad = 0.05 * (hi - lo or span)
    return lo - pad, hi + pad


def _scatter(ax, pairs: dict[str, list[tuple[float, float, float | None]]], title: str, ylabel: str,
             units: str) -> None:
    """Measured (± 1.96·SE) against predicted, the 1:1 diagonal; predictions off the range drawn as ◀ / ▶ at
    the edge (their count in the legend)."""
    from matplotlib import colormaps

    colours = colormaps["tab10"]
    lo, hi = _limits(pairs) if any(pairs.values()) else (-1.0, 1.0)
    ax.plot([lo, hi], [lo, hi], color="grey", lw=1, label="1:1")
    for i, (name, pts) in enumerate(pairs.items()):
        inside = [p for p in pts if lo <= p[0] <= hi]
        outside = [p for p in pts if not lo <= p[0] <= hi]
        label = name + (f" ({len(outside)} off scale)" if outside else "")
        if inside:
            ax.errorbar([p[0] for p in inside], [p[1] for p in inside], yerr=[Z95 * (p[2] or 0.0) for p in inside],
                        fmt="o", color=colours(i % 10), capsize=2, label=label, alpha=0.85)
        for x, y, _ in outside:
            ax.plot([hi if x > hi else lo], [y], ">" if x > hi else "<", color=colours(i % 10),
                    label=None if inside else label)
            label = None if not inside else label
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(f"predicted ({units})")
    ax.set_ylabel(f"{ylabel} ({units})")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)


def at_fitted_scale(pairs: dict[str, list[tuple[float, float, float | None]]], calibration: dict,
                    which: str) -> dict[str, list[tuple[float, float, float | None]]]:
    """`pairs` with each scale-free predictor's predictions multiplied by its fitted scale c (calibration[name]
    [which].loo_scale.scale) under the label "name × c (fitted)"; one without a finite c is left out."""
    out = {}
    for name, pts in pairs.items():
        m = calibration.get(name, {}).get(which) or {}
        if not m.get("scale_free"):
            out[name] = pts
            continue
        c = (m.get("loo_scale") or {}).get("scale")
        if _ok(c):
            out[f"{name} × {c:.3g} (fitted)"] = [(c * x, y, se) for x, y, se in pts]
    return out


def _realised_points(doc: dict, names: list[str]) -> dict[str, list[tuple[float, float, float | None]]]:
    """Per predictor: (predicted, realised, its SE) over the realised intervals it predicted."""
    return {n: [(r["predictors"][n]["dH_predicted"], r["dH_realised"], r["se"])
                for r in doc["realised"] if n in r["predictors"]
                and _ok(r["predictors"][n]["dH_predicted"]) and _ok(r["dH_realised"])] for n in names}


def plot_predictors(doc: dict, path: str | os.PathLike) -> Path | None:
    """predictors.png from sweep.json `doc`: one panel per predictor, its prediction against the realised change
    per interval with the 1:1 line (a scale-free proxy at its fitted scale, see at_fitted_scale), titled with
    its Pearson and Spearman r (None: no matplotlib, or no realised interval)."""
    if not can_plot() or not doc["realised"]:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    real = at_fitted_scale(_realised_points(doc, list(doc["calibration"])), doc["calibration"], "realised")
    cols = min(4, len(real)) or 1
    rows = math.ceil(len(real) / cols) or 1
    fig = Figure(figsize=(4.2 * cols, 3.8 * rows), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (label, pts) in zip(axes, real.items()):
        m = doc["calibration"][label.split(" ")[0]]["realised"]
        r, rho = (m.get(k, {}).get("r") for k in ("pearson", "spearman"))
        _scatter(ax, {label: pts}, f"{label}\nr {_signed(r)}, Spearman {_signed(rho)}", "realised ΔH", doc["units"])
    for ax in axes[len(real):]:
        ax.set_visible(False)
    return save_png(fig, path)


def _signed(x) -> str:
    return f"{x:+.2f}" if _ok(x) else "—"


def plot_calibration(doc: dict, path: str | os.PathLike) -> Path | None:
    """calibration.png from sweep.json `doc`: predicted vs measured with the 1:1 line, one colour per predictor
    (None: no matplotlib)."""
    if not can_plot():
        return None
    names = list(doc["calibration"])
    own = {n: [(r["predictors"][n]["delta_h1"], r["deltaH_true"]["scaled"], r["deltaH_true"]["se_scaled"])
               for r in doc["rows"] if n in r["predictors"] and r["deltaH_true"]
               and _ok(r["predictors"][n]["delta_h1"]) and _ok(r["deltaH_true"]["scaled"])] for n in names}
    real = _realised_points(doc, names)
    own, real = (at_fitted_scale(own, doc["calibration"], "own"),
                 at_fitted_scale(real, doc["calibration"], "realised"))
    fig, (ax_own, ax_real) = _figure(2)
    _scatter(ax_own, own, "probe vs its own ΔH(η)·lr/η (per checkpoint)", "measured ΔH(η)·lr/η", doc["units"])
    _scatter(ax_real, real, "prediction vs realised change (per interval)", "realised ΔH (importance estimate)",
             doc["units"])
    return save_png(fig, path)
