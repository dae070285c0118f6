"""An independent implementation of sweep.json's calibration metrics (plain Python, no sweep code), and the
delete-one jackknife written out as a loop: the references of tests/test_sweep.py and test_sweep_stats.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from entropy_experiments.sweep.stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED


def ref_pearson(x, y):
    """Pearson r; None for n < 3 or a constant x or y."""
    n = len(x)
    if n < 3 or min(x) == max(x) or min(y) == max(y):
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy)


def ref_ranks(x):
    return [sum(1.0 for b in x if b < a) + (sum(1.0 for b in x if b == a) + 1) / 2 for a in x]


def ref_quantile(values, q):
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def ref_bootstrap(x, y, fn):
    if len(x) < 3:
        return [None, None]
    idx = np.random.default_rng(BOOTSTRAP_SEED).integers(0, len(x), size=(BOOTSTRAP_RESAMPLES, len(x)))
    vals = [v for v in (fn([x[i] for i in row], [y[i] for i in row]) for row in idx) if v is not None]
    return [ref_quantile(vals, 0.025), ref_quantile(vals, 0.975)] if len(vals) >= BOOTSTRAP_RESAMPLES / 2 \
        else [None, None]


def _ok(e):
    return e is not None and math.isfinite(e) and e > 0


def ref_scale(pairs):
    """Σxy/se² / Σx²/se² over (x, y, se) with a usable se, written out; None when the denominator is 0."""
    num = sum(a * b / e ** 2 for a, b, e in pairs if _ok(e))
    den = sum(a * a / e ** 2 for a, b, e in pairs if _ok(e))
    return num / den if den > 0 else None


def ref_loo_scale(x, y, se):
    """The leave-one-pair-out scale's z by a plain loop over the pairs."""
    pairs = list(zip(x, y, se))
    zs = []
    for i, (a, b, e) in enumerate(pairs):
        c = ref_scale(pairs[:i] + pairs[i + 1:])
        if _ok(e) and c is not None:
            zs.append((c * a - b) / e)
    return {"scale": ref_scale(pairs) if pairs else None,
            "coverage": sum(abs(v) < 1.96 for v in zs) / len(zs) if zs else None,
            "rms_z": math.sqrt(sum(v * v for v in zs) / len(zs)) if zs else None, "n": len(zs)}


Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def ref_fisher(r, n, rank):
    """tanh(atanh r ± 1.96·s), s² = 1/(n − 3) (Pearson) or 1.06/(n − 3) (Spearman); None for n < 4."""
    if r is None or n < 4:
        return [None, None]
    s = math.sqrt((1.06 if rank else 1.0) / (n - 3))
    centre = math.atanh(max(-1.0, min(1.0, r))) if abs(r) < 1 else math.copysign(math.inf, r)
    return [math.tanh(centre - Z95 * s), math.tanh(centre + Z95 * s)]


def ref_metrics(x, y, z, se, scale_free=False):
    def spear(a, b):
        return ref_pearson(ref_ranks(a), ref_ranks(b))

    zs = [v for v in z if v is not None]
    resolved = [(a, b) for a, b, e in zip(x, y, se) if e is not None and abs(b) > 2 * e]
    ratios = sorted(a / b for a, b in zip(x, y) if b != 0)
    med = None if not ratios else (ratios[len(ratios) // 2] if len(ratios) % 2 else
                                   0.5 * (ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2]))
    return {"n": len(x),
            "sign_agreement": sum((a > 0) == (b > 0) and (a < 0) == (b < 0) for a, b in zip(x, y)) / len(x)
            if x else None,
            "n_resolved": len(resolved),
            "sign_agreement_resolved": sum((a > 0) == (b > 0) and (a < 0) == (b < 0) for a, b in resolved)
            / len(resolved) if resolved else None,
            "pearson": {"r": ref_pearson(x, y), "ci95": ref_bootstrap(x, y, ref_pearson),
                        "ci95_fisher": ref_fisher(ref_pearson(x, y), len(x), False)},
            "spearman": {"r": spear(x, y), "ci95": ref_bootstrap(x, y, spear),
                         "ci95_fisher": ref_fisher(spear(x, y), len(x), True)},
            "coverage": {"value": sum(abs(v) < 1.96 for v in zs) / len(zs) if zs else None, "n": len(zs)},
            "median_ratio": med,
            "rms_z": math.sqrt(sum(v * v for v in zs) / len(zs)) if zs else None,
            **({"scale_free": True, "loo_scale": ref_loo_scale(x, y, se)} if scale_free else {})}


def ref_calibration(doc, scale_free=()):
    """The calibration of sweep.json `doc`; a scale-free predictor's own value is taken times its row's lr (its
    realised dH_predicted carries the interval's lr already)."""
    names = list(dict.fromkeys(n for r in doc["rows"] for n in r["predictors"]))
    names = [n for n in names if n == "displacement"] + [n for n in names if n != "displacement"]
    out = {}
    for name in names:
        lr = (lambda r: r["lr"]) if name in scale_free else (lambda r: 1.0)
        own = [(r["predictors"][name]["delta_h1"] * lr(r), r["deltaH_true"]["scaled"], r["predictors"][name]["z_own"],
                r["deltaH_true"]["se_scaled"]) for r in doc["rows"] if name in r["predictors"] and r["deltaH_true"]]
        real = [(r["predictors"][name]["dH_predicted"], r["dH_realised"], r["predictors"][name]["z"], r["se"])
                for r in doc["realised"] if name in r["predictors"]]
        out[name] = {k: ref_metrics([p[0] for p in v], [p[1] for p in v], [p[2] for p in v], [p[3] for p in v],
                                    name in scale_free)
                     for k, v in (("own", own), ("realised", real))}
        if name in scale_free:
            out[name]["own"]["predicted_as"] = "lr × proxy"
            out[name]["realised"]["predicted_as"] = "Σ lr over the interval's steps × proxy"
    return out


def assert_close(mine, ref, where=""):
    if isinstance(ref, dict):
        assert set(mine) == set(ref), where
        for k in ref:
            assert_close(mine[k], ref[k], f"{where}.{k}")
    elif isinstance(ref, list):
        assert len(mine) == len(ref), where
        for i, (a, b) in enumerate(zip(mine, ref)):
            assert_close(a, b, f"{where}[{i}]")
    elif ref is None or isinstance(ref, str):
        assert mine == ref, where
    else:
        assert mine == pytest.approx(ref, rel=1e-9, abs=1e-12), where



def jackknife(values_minus_one):
    """sqrt((n−1)/n Σ (θ₍₋i₎ − mean)²) of the n delete-one replicates."""
    n = len(values_minus_one)
    mean = sum(values_minus_one) / n
    return math.sqrt((n - 1) / n * sum((v - mean) ** 2 for v in values_minus_one))
