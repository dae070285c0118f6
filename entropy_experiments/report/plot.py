"""The ΔH(η) plot: measured ΔH(η) ± SE against the first-order prediction δH₁(η) = η·X̂·v and its band.

matplotlib is imported when a plot is drawn, not when this module is. It is an optional dependency
(`pip install entropy_experiments[plots]`): without it every plot is skipped, with one warning per process.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from .. import io_utils
from ..errors import output_error_on_os_error
from .run_lines import is_finite_number
from .summary import IMPORTANCE_OFF_NOTE, UNITS_LONG, run_label

_warned_no_matplotlib = False


def can_plot() -> bool:
    """True when matplotlib is installed; else False, and the first call warns that plots are skipped."""
    global _warned_no_matplotlib
    if importlib.util.find_spec("matplotlib") is not None:
        return True
    if not _warned_no_matplotlib:
        _warned_no_matplotlib = True
        logging.getLogger("entropy_experiments").warning(
            "matplotlib is not installed: skipping the plots (pip install 'entropy_experiments[plots]')")
    return False


def _eta_grid(etas: list[float]) -> np.ndarray:
    """A dense η grid over [min η, max η] for drawing η·X̂·v; geometric on each side of 0 so that it
    looks smooth on a symlog axis."""
    lo, hi = min(etas + [0.0]), max(etas + [0.0])
    tiny = min(abs(e) for e in etas if e != 0) / 10
    parts = [np.array([0.0])]
    if hi > 0:
        parts.append(np.geomspace(min(tiny, hi), hi, 100))
    if lo < 0:
        parts.append(-np.geomspace(min(tiny, -lo), -lo, 100))
    return np.sort(np.concatenate(parts))


def plot_delta_h(results: dict[str, Any], path: str | os.PathLike) -> Path | None:
    """Plot measured ΔH(η) (± SE) against the first-order prediction δH₁(η) = η·X̂·v (± its SE band).

    Left panel: ΔH vs η. Middle panel: ΔH/η vs η against the constant X̂·v, which shows where the
    linear regime ends. Third panel (when the rows carry paired residuals): ΔH − η·X̂·v ± its paired SE
    against ½η²·d2 (when the second-order coefficient was measured). The SE of δH₁ at the config lr is se.total, so the band at η is |η|/lr·se.total.
    x is symlog when the η values span more than a decade. Without ΔH(η) rows (`true` = [],
    importance.enabled: false) only the prediction is drawn, over η ∈ [0, lr], and the title says
    ΔH(η) was not measured. Written atomically as PNG. None (nothing written) without matplotlib.
    """
    if not can_plot():
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    x_hat_dot_v, lr = results.get("x_hat_dot_v"), results.get("learning_rate")
    entries = results.get("true") or []
    points = [(e["eta"], e["deltaH_true"], e.get("se")) for e in entries
              if is_finite_number(e.get("eta")) and is_finite_number(e.get("deltaH_true"))]
    measured = bool(entries)
    etas = [e for e, _, _ in points] if measured else ([lr] if is_finite_number(lr) and lr > 0 else [])
    nonzero = [abs(e) for e in etas if e != 0]

    residuals = [(e["eta"], e["residual"]["value"], e["residual"].get("se")) for e in entries
                 if isinstance(e.get("residual"), dict) and is_finite_number(e["residual"].get("value"))]
    fig = Figure(figsize=(16 if residuals else 11, 4.5), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3 if residuals else 2)
    ax, ax_ratio = axes[0], axes[1]
    if nonzero and is_finite_number(x_hat_dot_v):
        _draw_prediction(ax, ax_ratio, _eta_grid(etas), x_hat_dot_v, results.get("se", {}).get("total"), lr)
    if points:
        _draw_measured(ax, ax_ratio, points)
    elif measured:
        ax.text(0.5, 0.5, "no finite ΔH(η)", transform=ax.transAxes, ha="center")
    else:
        ax_ratio.set_xlim(ax.get_xlim())  # nothing on the right fixes its η range: the prediction's
    if residuals:
        _draw_residuals(axes[2], residuals, _eta_grid(etas), (results.get("second_order") or {}).get("d2"))
    symlog = min(nonzero) if nonzero and max(nonzero) / min(nonzero) > 10 else None
    _style_axes(tuple(axes), etas, symlog, UNITS_LONG.get(results.get("normalize", "per_token"), "nats"))
    label = run_label(results)
    fig.suptitle("Entropy change of one update step" + (f": {label}" if label else "")
                 + ("" if measured else f" — {IMPORTANCE_OFF_NOTE}"))

    return save_png(fig, path)


def save_png(fig: Any, path: str | os.PathLike) -> Path:
    """Write a matplotlib figure to `path` as PNG, atomically; an OS error becomes one clear line."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    path = Path(path)
    with output_error_on_os_error(f"cannot write {path}"):
        io_utils.atomic_write_bytes(path, buffer.getvalue())
    return path


def _draw_prediction(ax: Any, ax_ratio: Any, grid: np.ndarray, x_hat_dot_v: float, se_total: Any,
                     lr: Any) -> None:
    """δH₁(η) = η·X̂·v with its ± SE band (left) and the flat X̂·v with its band (right)."""
    line = grid * x_hat_dot_v
    ax.plot(grid, line, color="C0", label="δH₁(η) = η·X̂·v")
    if is_finite_number(se_total) and is_finite_number(lr) and lr > 0:
        band = np.abs(grid) / lr * se_total
        ax.fill_between(grid, line - band, line + band, color="C0", alpha=0.2, label="δH₁ ± SE")
        # ΔH/η vs η: the prediction is flat at X̂·v with half-width se_total/lr.
        ax_ratio.axhspan(x_hat_dot_v - se_total / lr, x_hat_dot_v + se_total / lr, color="C0", alpha=0.2)
    ax_ratio.axhline(x_hat_dot_v, color="C0", label="X̂·v")


def _draw_measured(ax: Any, ax_ratio: Any, points: list[tuple[float, float, Any]]) -> None:
    """The finite ΔH(η) ± SE points (left) and ΔH/η ± SE/|η| for η ≠ 0 (right)."""
    eta, dh, err = (np.array(c, dtype=float) for c in zip(*[(e, d, s if is_finite_number(s) else np.nan)
                                                             for e, d, s in points]))
    ax.errorbar(eta, dh, yerr=np.nan_to_num(err), fmt="o", color="C3", capsize=3, label="ΔH (SNIS) ± SE")
    keep = eta != 0
    ax_ratio.errorbar(eta[keep], dh[keep] / eta[keep], yerr=np.nan_to_num(err[keep]) / np.abs(eta[keep]),
                      fmt="o", color="C3", capsize=3, label="ΔH/η (SNIS) ± SE")


def _draw_residuals(ax: Any, points: list[tuple[float, float, Any]], grid: np.ndarray, d2: Any) -> None:
    """ρ(η) = ΔH(η) − η·X̂·v ± its paired SE (same E), against 0 (first order exact) and ½η²·d2 (second order)."""
    eta, rho, err = (np.array(c, dtype=float) for c in zip(*[(e, r, s if is_finite_number(s) else np.nan)
                                                              for e, r, s in points]))
    ax.errorbar(eta, rho, yerr=np.nan_to_num(err), fmt="o", color="C3", capsize=3, label="ΔH − η·X̂·v ± paired SE")
    if is_finite_number(d2):
        ax.plot(grid, 0.5 * grid ** 2 * d2, color="C2", label="½η²·d2 (second order)")
    ax.set_title("residual of first order", fontsize=10)


def _style_axes(axes: tuple[Any, ...], etas: list[float], symlog: float | None, unit: str) -> None:
    """Ticks at the given η values (labelled compactly: matplotlib's default labels for η ~ 1e-5 print
    every decimal and overlap), symlog x with that linear threshold when given, zero lines, labels."""
    ticks = sorted({0.0, *etas})
    labels = ["0" if t == 0 else f"{t:.0e}".replace("e-0", "e-") for t in ticks]
    for a in axes:
        if symlog is not None:
            a.set_xscale("symlog", linthresh=symlog)
        if etas:
            a.set_xticks(ticks, labels, rotation=45, ha="right", fontsize=8)
        a.axhline(0, color="0.6", lw=0.8)
        a.axvline(0, color="0.6", lw=0.8)
        a.set_xlabel("η (learning rate of the step)")
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    axes[0].set_ylabel(f"ΔH ({unit})")
    axes[1].set_ylabel(f"ΔH/η ({unit} per unit lr)")
    if len(axes) > 2:
        axes[2].set_ylabel(f"ΔH − η·X̂·v ({unit})")
