"""The console summary of a results dict: Ĥ, δH₁ ± SE, the measured ΔH(η) rows and the linearity fits.

Also the number formatting and labels the plot shares (`format_number`, `run_label`, `UNITS_LONG`).
rich is imported when a summary is rendered, not when this module is.
"""

from __future__ import annotations

import io
import sys
from pathlib import PurePath
from typing import Any

from ..checkpoint.file_names import ADAPTER_SUBDIR
from ..estimators.snis import PSIS_PRIOR_DRAWS, psis_tail_size
from .run_lines import format_number, is_finite_number, objective_lines, optional_phases_line, sampler_lines

UNITS = {"per_token": "nats/token", "per_sequence": "nats/seq"}
UNITS_LONG = {"per_token": "nats per token", "per_sequence": "nats per sequence"}


def u_df_text(se: dict) -> str:
    """`, df K−1` after SE_U: the degrees of freedom of its jackknife over K U groups ('' when not recorded)."""
    df = se.get("U_df")
    return f", df {df:.0f}" if is_finite_number(df) else ""


def _ratio(num: Any, den: Any) -> float | None:
    return num / den if is_finite_number(num) and is_finite_number(den) and den != 0 else None


def verdict_line(results: dict[str, Any]) -> str:
    """First order against the measured ΔH at the smallest positive η: the η table's measured/predicted and its
    residual verdict (`residual_verdict`), in one line for the summary's head and report.html's header."""
    x_hat_dot_v = results.get("x_hat_dot_v")
    rows = [e for e in results.get("true") or [] if is_finite_number(e.get("eta")) and e["eta"] > 0
            and is_finite_number(e.get("deltaH_true"))]
    if not rows:
        return IMPORTANCE_OFF_NOTE
    entry = min(rows, key=lambda e: e["eta"])
    predicted = entry["eta"] * x_hat_dot_v if is_finite_number(x_hat_dot_v) else None
    residual = entry.get("residual") or {}
    verdict = residual_verdict(residual.get("z"), residual.get("se"), predicted) or "no paired residual"
    return (f"at η={format_number(entry['eta'], '.3g')}: measured/predicted "
            f"{format_number(_ratio(entry['deltaH_true'], predicted), '.3f')}, first order {verdict}"
            + (f" (z {format_number(residual.get('z'), '+.2f')})" if is_finite_number(residual.get("z")) else ""))


def run_label(results: dict[str, Any]) -> str | None:
    """The checkpoint probed (or the model's name), when the run recorded one.

    results.json's `checkpoint` entry (checkpoint/layout.checkpoint_info) names the files it was read from: the
    checkpoint directory is the adapter's, or for this project's layout the one holding the adapter as `model/`."""
    for key in ("checkpoint", "model"):
        value = results.get(key)
        if isinstance(value, dict):
            value = value.get("name") or value.get("path") or _checkpoint_directory(value)
        if value:
            return str(value)
    return None


def _checkpoint_directory(info: dict[str, Any]) -> str | None:
    adapter = (info.get("files") or {}).get("adapter")
    if not isinstance(adapter, str):
        return None
    own = info.get("layout") == "own" and PurePath(adapter).name == ADAPTER_SUBDIR
    return str(PurePath(adapter).parent) if own else adapter


# A paired residual reads "consistent within noise" only when |z| < Z_AGREE AND its 95 % interval is narrow
# enough to have shown a discrepancy: 1.96·SE ≤ INFORMATIVE_FRACTION·|δH₁(η)| (docs/faq.md, "Agreement").
Z_AGREE = 2.0
INFORMATIVE_FRACTION = 0.5
RESIDUAL_NOTE = ("ΔH − δH₁(η): measured minus first-order prediction on the same E, with its paired SE and "
                 "z = residual / SE. 'consistent': |z| < 2 and the 95 % interval (±1.96 SE) is within ±50 % of "
                 "δH₁(η), i.e. first order agrees within noise; 'too noisy': |z| < 2 but that interval is wider, "
                 "so the data cannot tell; 'off': |z| ≥ 2, first order misses ΔH at that η.")
MEASURED_OVER_PREDICTED = "ΔH/δH₁(η)\nmeasured/\npredicted"
IMPORTANCE_OFF_NOTE = "ΔH(η) not measured (importance.enabled: false)"


def render_summary(results: dict[str, Any]) -> str:
    """The console summary as plain text (rich tables, 110 columns, no colour codes).

    A run without ΔH(η) rows (`true` = [], i.e. importance.enabled: false) gets one line saying so
    instead of the ΔH and linearity tables.
    """
    from rich.console import Console

    unit = UNITS.get(results.get("normalize", "per_token"), "nats")
    x_hat_dot_v = results.get("x_hat_dot_v")
    buffer = io.StringIO()
    console = Console(file=buffer, width=110, color_system=None, force_terminal=False, soft_wrap=False)
    console.print(_head_table(results, unit))
    console.print()
    entries = results.get("true") or []
    if entries:
        console.print(_eta_table(entries, unit, x_hat_dot_v))
        for note in (_khat_note(entries), khat_missing_note(entries, (results.get("counts") or {}).get("B_E"))):
            if note:
                console.print(note, markup=False, highlight=False)
        if any(entry.get("residual") for entry in entries):
            console.print(RESIDUAL_NOTE, markup=False, highlight=False)
        console.print()
        console.print(_fit_table(results.get("linearity") or {}, x_hat_dot_v, results.get("second_order"),
                                 results.get("rounding_floor")))
    else:
        console.print(IMPORTANCE_OFF_NOTE, markup=False, highlight=False)
    if results.get("predictors"):
        console.print()
        console.print(_predictors_table(results["predictors"], entries, unit))
        for name, entry in results["predictors"].items():
            if entry.get("warning"):
                console.print(f"  {name}: {entry['warning']}", markup=False, highlight=False)
    console.print()
    warnings = results.get("warnings") or []
    if warnings:
        console.print(f"Warnings ({len(warnings)}):")
        for w in warnings:
            console.print(f"  ⚠ {w}", markup=False, highlight=False)
    # rich pads every line to the console width; drop that so the text copies cleanly.
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"


def _head_table(results: dict[str, Any], unit: str) -> Any:
    """Ĥ, δH₁ ± SE, X̂·v, lr, batch counts, update and time."""
    from rich.table import Table

    se, x_hat_dot_v, label = results.get("se", {}), results.get("x_hat_dot_v"), run_label(results)
    head = Table(title="Entropy probe" + (f": {label}" if label else ""), show_header=False, box=None,
                 title_justify="left", padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    H = results.get("H_orig", {})
    head.add_row("Ĥ per token", f"{format_number(H.get('per_token'), '.4f')} nats/token")
    head.add_row("Ĥ per sequence", f"{format_number(H.get('per_sequence'), '.4f')} nats/seq")
    head.add_row("normalize", str(results.get("normalize", "per_token")))
    head.add_row("δH₁ ± SE", f"{format_number(results.get('deltaH1'), '+.4g')} ± {format_number(se.get('total'), '.2g')} {unit}"
                             f"  (SE_E {format_number(se.get('E'), '.2g')}, SE_U {format_number(se.get('U'), '.2g')}"
                             f"{u_df_text(se)})")
    head.add_row("X̂·v", f"{format_number(x_hat_dot_v, '+.4g')} {unit} per unit lr")
    head.add_row("learning rate", format_number(results.get("learning_rate"), ".3g"))
    head.add_row("verdict", verdict_line(results))
    counts = results.get("counts", {})
    if counts:
        head.add_row("batches", f"E {counts.get('B_E')} seqs ({counts.get('unique_E_prompts')} unique prompts, "
                                f"{counts.get('E_tokens')} tokens); U {counts.get('B_U')} prompts × G "
                                f"{counts.get('G')} ({counts.get('U_tokens')} tokens, "
                                f"{counts.get('zero_advantage_prompts')} zero-advantage)")
    update = results.get("update", {})
    if update:
        head.add_row("update", f"{update.get('direction')}: ‖v‖ {format_number(update.get('norm'), '.4g')}, "
                               f"‖g‖ {format_number(update.get('grad_norm'), '.4g')}, clipped {update.get('clipped')}")
        if objective := objective_lines(update.get("objective")):
            head.add_row("objective", objective[0])
            head.add_row("objective terms", objective[1])
    for label, line in sampler_lines(results.get("sampler")):
        head.add_row(label, line)
    total_time = results.get("timing", {}).get("total")
    if is_finite_number(total_time):
        head.add_row("time", f"{total_time:.1f} s")
        head.add_row("optional phases", optional_phases_line(results.get("timing", {})))
    return head


# The optional phases: their switch in the config and their key in results.json `timing`.
def _eta_table(entries: list[dict[str, Any]], unit: str, x_hat_dot_v: Any) -> Any:
    """One row per measured η: ΔH ± SE, ESS/N, k̂ (✗ above its threshold), measured/predicted ΔH/δH₁(η), the paired residual
    ΔH − δH₁(η) ± SE with its z and verdict (`residual_verdict`), zero weights."""
    from rich import box
    from rich.table import Table

    etas = Table(title="Measured ΔH(η) by SNIS on E", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("η", f"ΔH ± SE\n({unit})", "ESS/N", "k̂", MEASURED_OVER_PREDICTED, "ΔH − δH₁(η)\n± paired SE",
                "z, verdict", "zero-w"):
        etas.add_column(col, justify="right", no_wrap=True)
    for entry in entries:
        eta = entry.get("eta")
        khat, thr = entry.get("psis_khat"), entry.get("khat_threshold")
        flag = " ✗" if is_finite_number(khat) and is_finite_number(thr) and khat > thr else ""
        predicted = eta * x_hat_dot_v if is_finite_number(eta) and is_finite_number(x_hat_dot_v) else None
        etas.add_row(format_number(eta, ".3g"),
                     f"{format_number(entry.get('deltaH_true'), '+.4g')} ± {format_number(entry.get('se'), '.2g')}",
                     format_number(entry.get("ess_frac"), ".3f"),
                     format_number(khat, ".2f") + flag,
                     format_number(_ratio(entry.get("deltaH_true"), predicted), ".3f"),
                     *_residual_cells(entry.get("residual"), predicted),
                     str(entry.get("zero_weight_count", "n/a")))
    return etas


def _residual_cells(residual: dict[str, Any] | None, predicted: Any) -> tuple[str, str]:
    """('ρ ± SE', 'z verdict') of a paired residual (`residual_verdict`); 'n/a' for results without one."""
    if not residual:
        return "n/a", "n/a"
    z = residual.get("z")
    verdict = residual_verdict(z, residual.get("se"), predicted)
    return (f"{format_number(residual.get('value'), '+.2g')} ± {format_number(residual.get('se'), '.2g')}",
            format_number(z, "+.2f") + (f" {verdict}" if verdict else ""))


def residual_verdict(z: Any, se: Any, predicted: Any) -> str:
    """'off' (|z| ≥ 2), 'consistent' (|z| < 2 with an informative interval) or 'too noisy' (|z| < 2 with an
    interval wider than ±50 % of the prediction); '' when z is undefined."""
    if not is_finite_number(z):
        return ""
    if abs(z) >= Z_AGREE:
        return "off"
    informative = (is_finite_number(se) and is_finite_number(predicted) and predicted != 0
                   and 1.96 * se <= INFORMATIVE_FRACTION * abs(predicted))
    return "consistent" if informative else "too noisy"


def _slope_cells(item: dict[str, Any], x_hat_dot_v: Any) -> str:
    """A symmetric slope, measured/predicted, and its paired residual's z with the verdict (`residual_verdict`)."""
    s, residual = item.get("slope"), item.get("residual") or {}
    text = f"{format_number(s, '+.4g')}  (measured/predicted {format_number(_ratio(s, x_hat_dot_v), '.3f')}"
    if not residual:
        return text + ")"
    verdict = residual_verdict(residual.get("z"), residual.get("se"), x_hat_dot_v)
    return text + f"; slope − X̂·v z {format_number(residual.get('z'), '+.2f')}" + (f" {verdict})" if verdict else ")")


def _fit_table(lin: dict[str, Any], x_hat_dot_v: Any, second_order: dict[str, Any] | None = None,
               floor: dict[str, Any] | None = None) -> Any:
    """The linearity fits of ΔH in η against X̂·v (each symmetric slope with its paired residual: the first-order
    check that ½η²·d2 cannot hide), the second-order coefficient with η* and ΔH's rounding floor when measured."""
    from rich.table import Table

    fit = Table(title="Linearity of ΔH in η", show_header=False, box=None, title_justify="left", padding=(0, 2))
    fit.add_column(style="bold")
    fit.add_column()
    slope = lin.get("slope_through_origin")
    fit.add_row("slope through origin", f"{format_number(slope, '+.4g')}  vs X̂·v {format_number(x_hat_dot_v, '+.4g')}  "
                                        f"(measured/predicted {format_number(_ratio(slope, x_hat_dot_v), '.3f')})")
    fit.add_row("log-log slope", f"{format_number(lin.get('loglog_slope'), '.3f')}  (1 in the linear regime)")
    for item in lin.get("symmetric_slopes") or []:
        fit.add_row(f"symmetric slope η={format_number(item.get('eta'), '.3g')}", _slope_cells(item, x_hat_dot_v))
    if floor:
        fit.add_row("ΔH rounding floor F", f"{format_number(floor.get('value'), '.2g')}  (rows under 5 F are warned)")
    if second_order:
        fit.add_row("second order d2 = D²_v H", f"{format_number(second_order.get('d2'), '+.4g')} ± "
                                                f"{format_number(second_order.get('se'), '.2g')} per unit η²")
        fit.add_row("η* (½η²d2 = 10 % of η·X̂·v)", format_number(second_order.get("eta_star"), ".3g"))
        reported = [r for r in second_order.get("per_eta") or [] if r.get("eta") == second_order.get("eta")]
        if reported and "eta_sd_s" in reported[0]:
            r = reported[0]
            fit.add_row(f"weights at ±{format_number(r['eta'], '.3g')}",
                        f"η·SD(s_i) {format_number(r['eta_sd_s'], '.2g')}, ESS/N {format_number(r['ess_frac_plus'], '.3f')}"
                        f" / {format_number(r['ess_frac_minus'], '.3f')}")
    return fit


PREDICTOR_MEANINGS = {
    "adamw_step": "exact AdamW step (δH₁)",
    "no_momentum": "g / saved √s, no momentum",
    "sgd_same_norm": "−g rescaled to ‖v‖",
    "direct_only": "Σ_k D_v H_k alone",
}
SCALE_FREE_MEANING = "scale-free proxy on U: per unit logit step, not nats (maths §13)"
SCALE_FREE_NOTE = ("The scale-free proxies (Cui et al.'s covariances, Wang et al.'s S*, STEER's Ω; maths §13) are "
                   "closed forms per unit of a logit-space step of unknown size, not nats/token: their number is "
                   "comparable with a change only through a scale fitted over a sweep's intervals (its calibration's "
                   "LOO scale), never on its own.")


def _predictors_table(predictors: dict[str, dict[str, Any]], entries: list[dict[str, Any]], unit: str) -> Any:
    """Competing predictors of the same step: prediction ± SE (SE_E, SE_U) and measured/predicted, the measured ΔH
    over the prediction (results.json's measured_over_predicted), read the same way as the η table's column."""
    from rich.table import Table

    positive = [e["eta"] for e in entries if is_finite_number(e.get("eta")) and e["eta"] > 0]
    against = f"ΔH(η={min(positive):.3g})·lr/η" if positive else "ΔH (not measured)"
    table = Table(title=f"Competing predictors of the same step ({unit}; measured = {against})",
                  title_justify="left", box=None, padding=(0, 2))
    for column in ("predictor", "predicted ΔH", "± SE", "SE_E / SE_U", "measured/predicted", "what it assumes"):
        table.add_column(column, justify="left" if column in ("predictor", "what it assumes") else "right")
    for name, entry in predictors.items():
        table.add_row(name, format_number(entry.get("delta_h1"), "+.4g"), format_number(entry.get("se"), ".2g"),
                      f"{format_number(entry.get('se_E'), '.2g')} / {format_number(entry.get('se_U'), '.2g')}",
                      format_number(entry.get("measured_over_predicted"), ".3f"),
                      PREDICTOR_MEANINGS.get(name, SCALE_FREE_MEANING if entry.get("scale_free") else ""))
    return table


def _khat_note(entries: list[dict[str, Any]]) -> str | None:
    """A footnote when k̂ rests on so few tail draws that arviz-stats' prior (towards 0.5) dominates it."""
    entry = next((e for e in entries if is_finite_number(e.get("ess")) and is_finite_number(e.get("ess_frac"))
                  and e["ess_frac"] > 0), None)
    if entry is None:
        return None
    n = round(entry["ess"] / entry["ess_frac"])  # every η scores the same N sequences
    tail = psis_tail_size(n)
    if not 5 <= tail < 2 * PSIS_PRIOR_DRAWS:
        return None
    return (f"k̂ is fit to the M = {tail} largest of N = {n} weights and shrunk towards 0.5 by a prior "
            f"worth {PSIS_PRIOR_DRAWS} draws, so at this N a k̂ above its threshold "
            f"({format_number(entry.get('khat_threshold'), '.2f')}) is weak evidence; "
            "ESS/N is the steadier guide.")


def khat_missing_note(entries: list[dict[str, Any]], n: Any) -> str | None:
    """Why k̂ shows n/a (estimators/snis.psis_khat's rules), for the N = `n` E sequences; None when every k̂ is there."""
    missing = [e for e in entries if not is_finite_number(e.get("psis_khat"))]
    if not missing:
        return None
    if is_finite_number(n) and psis_tail_size(int(n)) < 5:
        return (f"k̂ n/a: PSIS k̂ fits a Pareto tail to the N/5 largest of the N importance weights and needs at least "
                f"5 of them, so N ≥ 25 E sequences; this run has N = {n} (raise batch_config.B_E). ESS/N still holds.")
    tail = psis_tail_size(int(n)) if is_finite_number(n) else None
    reasons = []
    for e in missing:
        zeros = e.get("zero_weight_count")
        if tail is not None and is_finite_number(zeros) and n - zeros <= tail:
            reasons.append(f"η={format_number(e.get('eta'), '.3g')}: only {n - zeros} non-zero weights, the fit "
                           f"needs more than M = {tail}")
        else:
            reasons.append(f"η={format_number(e.get('eta'), '.3g')}: the largest weights are all equal or the fit "
                           "failed")
    return "k̂ n/a at " + "; ".join(reasons) + "."


def print_summary(results: dict[str, Any]) -> None:
    """Print `render_summary(results)` to stdout."""
    sys.stdout.write(render_summary(results))
    sys.stdout.flush()
