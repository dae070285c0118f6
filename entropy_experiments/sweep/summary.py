"""The sweep's summary on stdout: per checkpoint, per realised interval, and the calibration per predictor."""

from __future__ import annotations

import math

__all__ = ["print_sweep_summary"]


def _f(x, spec: str = "+.4g") -> str:
    return "—" if x is None or not math.isfinite(x) else format(x, spec)


def _pm(x, se) -> str:
    return f"{_f(x)} ± {_f(se, '.2g')}"


def _ci(entry: dict) -> str:
    lo, hi = entry["ci95"]
    return f"{_f(entry['r'], '+.2f')} [{_f(lo, '+.2f')}, {_f(hi, '+.2f')}]"


def _z(entry: dict | None, key: str = "z") -> str:
    return _f(None if not entry else entry.get(key), "+.2f")


def _loo(m: dict) -> str:
    """'c (coverage)' of a scale-free predictor's leave-one-out scale (sweep/calibration.py); '' otherwise."""
    loo = m.get("loo_scale")
    return f"{_f(loo['scale'], '.3g')} ({_f(loo['coverage'], '.2f')})" if loo else ""


def _reuse_mark(interval: dict) -> str:
    """'  reuse: steps 2, 4' for an interval holding steps that reused rollouts (objective.num_iterations > 1)."""
    steps = interval.get("rollout_reuse_steps") or []
    return f"  reuse: step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}" if steps else ""


NO_STEP_LABELS = {"reuses_rollouts": "Ĥ only (reuse step)", "schedule_ended": "Ĥ only (schedule ended)",
                  "no_next_step": "Ĥ only (no next step)"}
K_LEGEND = ("K: training steps the interval spans (Δθ is their chord; with --every K or skipped checkpoints K > 1, "
            "and the prediction is K·δH₁)")


def no_step_label(row: dict) -> str:
    """Why a row has Ĥ only: its `no_step` kind (rows written before it: from next_step_reuses_rollouts)."""
    kind = row.get("no_step") or ("reuses_rollouts" if row.get("next_step_reuses_rollouts") else "no_next_step")
    return NO_STEP_LABELS[kind]


def _print_decomposition(doc: dict) -> None:
    """Per interval: the displacement predictor and what first order leaves (sweep/decomposition.py)."""
    rows = [r for r in doc["realised"] if r.get("displacement")]
    if not rows:
        return
    print(f"\n{'interval':>12} {'K':>3} {'realised':>11} {'δH_Δθ ± SE':>22} {'½D²_Δθ H':>11} {'z₁':>6} {'z₂':>6} "
          f"{'K·lr·X̂v − δH_Δθ':>17} {'z_U':>6} {'cos':>6} {'‖K·lr·v‖/‖Δθ‖':>14}")
    for r in rows:
        d, noise = r["displacement"], r["u_noise"] or {}
        half = (d.get("second_order") or {}).get("value")
        print(f"{str(r['from_step']) + '→' + str(r['to_step']):>12} {d['steps_spanned']:>3} {_f(r['dH_realised']):>11} "
              f"{_pm(d['value'], d['se']):>22} {_f(half):>11} {_z(r['first_order']):>6} "
              f"{_z(r['with_second_order']):>6} {_f(noise.get('value')):>17} {_z(noise):>6} "
              f"{_f(d['cos_with_probe_step'], '+.2f'):>6} {_f(d['probe_step_norm_ratio'], '.3g'):>14}")
    print(K_LEGEND)
    cov = doc.get("decomposition") or {}
    print("coverage of |z| < 1.96: " + ", ".join(
        f"{k} {_f((cov.get(k) or {}).get('coverage'), '.2f')} (n = {(cov.get(k) or {}).get('n', 0)})"
        for k in ("first_order", "with_second_order", "u_noise")))


def print_sweep_summary(doc: dict) -> None:
    """Four plain-text tables (units: sweep.json `units`)."""
    print(f"\nEntropy sweep: {doc['n_checkpoints']} checkpoints ({doc['units']})")
    print(f"{'checkpoint':>18} {'step':>5} {'lr':>9} {'Ĥ ± SE':>22} {'δH₁ ± SE':>22} {'ΔH(η)·lr/η':>12} {'z':>6}")
    for r in doc["rows"]:
        truth = r["deltaH_true"] or {}
        delta = _pm(r["deltaH1"], r["se_total"]) if r["deltaH1"] is not None else no_step_label(r)
        print(f"{r['checkpoint']:>18} {r['step']:>5} {_f(r['lr'], '.3g'):>9} {_pm(r['H'], r['H_se']):>22} "
              f"{delta:>22} {_f(truth.get('scaled')):>12} {_f(r['residual_z'], '+.2f'):>6}")
    print(f"\n{'interval':>12} {'realised ± SE':>22} {'method':>19} {'changed':>9} {'ESS/N':>6} {'k̂':>5} "
          f"{'paired (diag.)':>22} {'predicted ± SE':>22} {'z':>6}")
    for r in doc["realised"]:
        changed = "—" if r.get("n_changed") is None else f"{r['n_changed']}/{r['n_common_draws']}"
        paired = r.get("paired_diagnostic") or {}
        print(f"{str(r['from_step']) + '→' + str(r['to_step']):>12} {_pm(r['dH_realised'], r['se']):>22} "
              f"{r.get('method', '—'):>19} {changed:>9} {_f(r.get('ess_frac'), '.3f'):>6} "
              f"{_f(r.get('psis_khat'), '.2f'):>5} {_pm(paired.get('value'), paired.get('se')):>22} "
              f"{_pm(r['dH_predicted'], r['se_predicted']):>22} {_f(r['z'], '+.2f'):>6}{_reuse_mark(r)}")
    _print_decomposition(doc)
    print(f"\n{'predictor':>14} {'vs':>9} {'n':>3} {'sign':>5} {'resolved':>12} {'Pearson r [95% CI]':>24} "
          f"{'Spearman r [95% CI]':>24} {'coverage':>9} {'median pred/meas':>16} {'rms z':>6} {'LOO scale (cov.)':>18}")
    for name, both in doc["calibration"].items():
        for which, m in both.items():
            resolved = f"{_f(m.get('sign_agreement_resolved'), '.2f')} ({m.get('n_resolved', 0)})"
            print(f"{name:>14} {which:>9} {m['n']:>3} {_f(m['sign_agreement'], '.2f'):>5} {resolved:>12} "
                  f"{_ci(m['pearson']):>24} {_ci(m['spearman']):>24} {_f(m['coverage']['value'], '.2f'):>9} "
                  f"{_f(m['median_ratio'], '.3g'):>16} {_f(m.get('rms_z'), '.2f'):>6} {_loo(m):>18}")
    if any(m.get("scale_free") for both in doc["calibration"].values() for m in both.values()):
        print("note: the scale-free proxies (docs/maths.md §13) are logit-space steps of unknown size, not "
              f"{doc['units']}: their coverage is only through the fitted scale c (LOO scale column)")
    for message in doc.get("warnings") or []:
        print(f"warning: {message}")
