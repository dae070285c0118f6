"""Two probe runs on the same E and U that differ only in floating-point reduction order (a CPU and a GPU; eager
and SDPA attention on one CPU) must agree within tolerances that follow from fp32 rounding, not guesses
(estimators/rounding_floor.py, docs/maths.md §8):

* gradient quantities (δH₁, the predictors' lr·X̂·v', X_H·v, X̂·Δθ, the exact d2 by jvp): relative `GRADIENT_REL`
  (a predictor's: of the larger of its size and |δH₁|),
  their jackknife SEs `SE_REL` (as the first GPU run passed them);
* ΔH(η): rel·|ΔH| + z·√2·F, F = the rounding floor of E measured as fp32 − fp64 per token at θ on the CPU;
* d2 by the second difference at η: (ΔH(η) + ΔH(−η))/η², rounding SD √3·F/η² per run (the θ pass is shared by
  both signs), so two runs differ by z·√6·F/η² + rel·|d2|;
* measured_over_predicted: the relative tolerance of ΔH at the smallest positive η plus that of the predictor.
`differences(a, b, floor)` lists every field that breaks its tolerance (empty: the runs agree).
"""

from __future__ import annotations

import copy
import math

import torch

from entropy_experiments.estimators.rounding_floor import (
    delta_h_rounding_floor,
    delta_h_tolerance,
    per_token_rounding,
)
from entropy_experiments.estimators.sequence_scores import score_sequences
from entropy_experiments.policy.engine import PolicyEngine

GRADIENT_REL = 1e-4
SE_REL = 1e-3
Z = 4.0


def token_rounding(policy, E, config) -> tuple[float, float, object]:
    """(σ_H², σ_ℓ², the float64 scores of E): the per-token fp32 − fp64 rounding of H and ℓ at θ on the CPU (an
    SDPA copy of the model in each dtype: transformers' eager mask gives NaN rows in float64 with left padding)."""
    model = policy.trainable.model
    engines = {}
    for dtype in (torch.float32, torch.float64):
        twin = copy.deepcopy(model).to(device="cpu", dtype=dtype)
        twin.set_attn_implementation("sdpa")
        engines[dtype] = PolicyEngine(twin, policy.tokenizer, config.policy_settings())
    s32, s64 = (score_sequences(engines[d], E) for d in (torch.float32, torch.float64))
    var_h = per_token_rounding(s32.token_entropies, s64.token_entropies)
    var_l = per_token_rounding(s32.token_logqs, s64.token_logqs)
    return var_h, var_l, s64


def rounding_floor(policy, E, config) -> float:
    """F of E (delta_h_rounding_floor) from `token_rounding`."""
    var_h, var_l, s64 = token_rounding(policy, E, config)
    return delta_h_rounding_floor(s64.seq_entropies, s64.lengths, var_h, var_l,
                                  normalize=config.estimator.normalize)


def _close(a, b, tol: float) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.isnan(a) and math.isnan(b) or a == b
    return abs(a - b) <= tol


def _rel(a, b, rel: float) -> bool:
    return _close(a, b, rel * max(abs(a or 0.0), abs(b or 0.0)) + 1e-30)


def _truth(a: dict, b: dict, floor: float, bad: list[str]) -> dict[float, float]:
    """ΔH per η against its tolerance; returns {η: relative tolerance of ΔH(η)}."""
    rel_of = {}
    for x, y in zip(a["true"], b["true"]):
        if x["eta"] != y["eta"]:
            bad.append(f"η grids differ: {x['eta']} vs {y['eta']}")
            continue
        tol = delta_h_tolerance(x["deltaH_true"], floor, z=Z)
        rel_of[x["eta"]] = tol / max(abs(x["deltaH_true"]), 1e-300)
        if not _close(x["deltaH_true"], y["deltaH_true"], tol):
            bad.append(f"ΔH(η={x['eta']:g}): {x['deltaH_true']:.6e} vs {y['deltaH_true']:.6e} (tolerance {tol:.2e})")
    return rel_of


def _second_order(a: dict | None, b: dict | None, floor: float, bad: list[str]) -> None:
    if a is None or b is None:
        if a is not b:
            bad.append("second_order present in one run only")
        return
    if a["method"] == "jvp":
        if not _rel(a["d2"], b["d2"], SE_REL):
            bad.append(f"d2 (jvp): {a['d2']:.6e} vs {b['d2']:.6e}")
        return
    for x, y in zip(a["per_eta"], b["per_eta"]):
        tol = SE_REL * abs(x["d2"]) + Z * math.sqrt(6.0) * floor / x["eta"] ** 2
        if not _close(x["d2"], y["d2"], tol):
            bad.append(f"d2 (second difference, η={x['eta']:g}): {x['d2']:.6e} vs {y['d2']:.6e} (tol {tol:.2e})")


def _predictors(a: dict | None, b: dict | None, ratio_rel: float, scale: float, bad: list[str]) -> None:
    """A predictor's slope to `GRADIENT_REL` of the larger of its size and `scale` (|δH₁| of the run): a small
    slope such as direct_only's is a sum that cancels from the scale of the E pieces, and rounds on that scale
    (2e-4 of its own size between eager and SDPA attention on the scalar kernel set)."""
    if a is None or b is None:
        if a is not b:
            bad.append("predictors present in one run only")
        return
    for name, x in a.items():
        y = b.get(name, {})
        size = max(abs(x["delta_h1"]), 1e-300)
        slope_rel = GRADIENT_REL * max(1.0, scale / size)
        for key, rel in (("delta_h1", slope_rel), ("se_E", SE_REL), ("se_U", SE_REL),
                         ("measured_over_predicted", ratio_rel + slope_rel)):
            if key in x and not _rel(x[key], y.get(key), rel):
                bad.append(f"predictors.{name}.{key}: {x[key]} vs {y.get(key)}")
        half_a, half_b = x.get("second_order"), y.get("second_order")
        if half_a is not None and not _rel(half_a["value"], (half_b or {}).get("value"), SE_REL):
            bad.append(f"predictors.{name}.second_order: {half_a} vs {half_b}")


def differences(a: dict, b: dict, floor: float) -> list[str]:
    """Every field of results `a`, `b` (same E, U) outside its tolerance, given the rounding floor F of E."""
    bad = []
    if not _rel(a["deltaH1"], b["deltaH1"], GRADIENT_REL):
        bad.append(f"δH₁: {a['deltaH1']:.8e} vs {b['deltaH1']:.8e}")
    for key in ("E", "U", "total"):
        if not _rel(a["se"][key], b["se"][key], SE_REL):
            bad.append(f"SE_{key}: {a['se'][key]} vs {b['se'][key]}")
    rel_of = _truth(a, b, floor, bad)
    positive = [eta for eta in rel_of if eta > 0]
    _second_order(a.get("second_order"), b.get("second_order"), floor, bad)
    _predictors(a.get("predictors"), b.get("predictors"), rel_of[min(positive)] if positive else 0.0,
                abs(a["deltaH1"]), bad)
    return bad
