"""Ground truth ΔH(η) by self-normalised importance sampling on the same E (docs/maths.md §5).

For each η the E sequences (sampled at θ) are re-scored at θ' = θ + η·v — either as a parameter
override through `functional_call` (`param_override`, the live model untouched) or after a real
`optimizer.step()` with lr = η (`real_step`, parameters and optimizer state restored exactly after).
log w_i = Σ_k (ℓ'_ik − ℓ_ik) in float64, h'_i = Σ_k H'_ik, and Ĥ' = Σ w h' / Σ w T (per_token),
by `snis.snis_delta_h`; Ĥ at θ is `surrogate.entropy_estimate`.
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..data.batch import Batch
from ..policy.engine import PolicyEngine
from ..tensors import NamedTensors
from . import snis
from .central_difference import beta_log_ratio
from .jackknife import as_float64
from .sequence_scores import SequenceScores, log_weights, score_sequences, units_of
from .surrogate import entropy_estimate

log = logging.getLogger("entropy_experiments.importance")


@contextmanager
def real_optimizer_step(optimizer, named_params: list[tuple[str, torch.nn.Parameter]], grads: NamedTensors,
                        lr: float, max_grad_norm: float | None):
    """Take a real AdamW step with learning rate `lr` from gradient `grads`, then restore everything.

    Parameters, their .grad, the optimizer state and its param_groups are snapshotted before and
    restored exactly after the block (even on error).
    """
    params = [p for _, p in named_params]
    saved_values = [p.detach().clone() for p in params]
    saved_grads = [None if p.grad is None else p.grad.clone() for p in params]
    saved_state = copy.deepcopy(optimizer.state_dict())
    try:
        for name, p in named_params:
            p.grad = grads[name].detach().to(p.dtype).clone()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        yield
    finally:
        with torch.no_grad():
            for p, value, grad in zip(params, saved_values, saved_grads):
                p.copy_(value)
                p.grad = grad
        optimizer.load_state_dict(saved_state)


def eta_grid(eta_list: list[float], symmetric: bool) -> list[float]:
    """The η values to evaluate: the configured ones, plus their negatives when `symmetric`, sorted."""
    etas = {float(e) for e in eta_list}
    if symmetric:
        etas |= {-e for e in etas}
    return sorted(etas)


@dataclass(frozen=True)
class RealStep:
    """θ' by a real AdamW step with lr = η (importance.mode real_step): the optimizer, the trainable parameters in
    optimizer order, the U gradient (unclipped; clipped here like the real training step) and the clip norm."""

    optimizer: object
    named_params: list[tuple[str, torch.nn.Parameter]]
    grads: NamedTensors
    max_grad_norm: float | None = None


@dataclass(frozen=True)
class DeltaH:
    """ΔH(η) on E for every η (docs/maths.md §5): Ĥ at θ, the results.json "true" rows (eta, deltaH_true, H_upd,
    se and the weight diagnostics), the per-sequence values of each η ({eta: {"logw", "h_new"[, "beta_logw"]}}),
    the per-sequence h and T at θ of all E (float64 [N], for the paired residuals), the linearity fits and, for
    the η the token attribution differences (token_derivatives.py), the per-token entropies at θ + η·v of all E."""

    H_orig: float | None
    rows: list[dict]
    per_sequence: dict[float, dict[str, list[float]]]
    h: np.ndarray | None
    T: np.ndarray | None
    linearity: dict
    token_entropies: dict[float, list[Tensor]] = field(default_factory=dict)

    @classmethod
    def not_measured(cls) -> DeltaH:
        """No η (importance off): no rows, NaN slopes."""
        return cls(None, [], {}, None, None, snis.linearity_fit([], []))


def score_at_eta(engine: PolicyEngine, E_batch: Batch, v_named: NamedTensors, eta: float, *,
                 real_step: RealStep | None = None, tf_batch_size: int | None = None) -> SequenceScores:
    """E scored at θ' = θ + η·v: as a parameter override, or after a real AdamW step with lr = η (undone)."""
    if real_step is None:
        return score_sequences(engine, E_batch, params_override=engine.build_params_override(v_named, eta),
                               tf_batch_size=tf_batch_size)
    with real_optimizer_step(real_step.optimizer, real_step.named_params, real_step.grads, eta,
                             real_step.max_grad_norm):
        return score_sequences(engine, E_batch, params_override=engine.build_params_override({}, 0.0),
                               tf_batch_size=tf_batch_size)


def eta_values(new: SequenceScores, base: SequenceScores, token_weights: list[Tensor] | None = None) -> dict[str, list]:
    """The per-sequence values of one η from E's scores at θ' (`new`) and at θ (`base`): log w_i, h'_i and, with
    the surrogate's β_ik (`token_weights`, central_difference.py), Σ_k β_ik (ℓ'_ik − ℓ_ik)."""
    out = {"logw": log_weights(new, base), "h_new": new.seq_entropies.tolist()}
    if token_weights is not None:
        out["beta_logw"] = beta_log_ratio(new.token_logqs, base.token_logqs, token_weights)
    return out


def delta_h_from_values(h: np.ndarray, T: np.ndarray, per_eta: dict[float, dict[str, np.ndarray]], *, normalize: str,
                        units: list[int], sampler_weights: np.ndarray | None = None) -> DeltaH:
    """ΔH(η) by SNIS for every η of `per_eta` ({eta: {"logw", "h_new"[, "beta_logw"]}}, float64 [N] over all E)
    with h, T at θ. `sampler_weights` s [N] (E drawn by a sampler other than the policy, docs/maths.md §12):
    Ĥ = Σ s h / Σ s d and Ĥ' = Σ s w h' / Σ s w d; the weight diagnostics of each row stay those of the step's
    own w = q_θ'/q_θ (the sampler's are reported once, by the sampler correction)."""
    H_orig = entropy_estimate(h, T, normalize, None if sampler_weights is None else as_float64(sampler_weights))
    rows = []
    for eta, values in per_eta.items():
        est = snis.snis_delta_h(values["logw"], values["h_new"], h, T, normalize=normalize, units=units,
                                sampler_weights=sampler_weights)
        diag = snis.importance_diagnostics(values["logw"])
        rows.append({"eta": eta, "deltaH_true": est.value, "H_upd": H_orig + est.value, "se": est.se, **diag})
        log.info("η=%+.3g  ΔH=%+.4e ± %.2e  ESS/N=%.3f  k̂=%.2f", eta, est.value, est.se,
                 diag["ess_frac"], diag["psis_khat"])
    per_sequence = {eta: {k: np.asarray(col).tolist() for k, col in values.items()} for eta, values in per_eta.items()}
    return DeltaH(H_orig, rows, per_sequence, h, T,
                  snis.linearity_fit([r["eta"] for r in rows], [r["deltaH_true"] for r in rows]))


def measure_delta_h(engine: PolicyEngine, E_batch: Batch, v_named: NamedTensors, etas: list[float], *, normalize: str,
                    base: SequenceScores | None = None, tf_batch_size: int | None = None,
                    real_step: RealStep | None = None, sampler_weights: np.ndarray | None = None) -> DeltaH:
    """ΔH(η) on the whole of `E_batch` for every η of `etas`, θ' = θ + η·v by a parameter override (or
    `real_step`); `sampler_weights` s [N] as in `delta_h_from_values`. `base` (E's scores at θ) must come from
    forwards with the layout of `tf_batch_size` rows (the probe passes the e_pass's scores and their layout: no
    pass at θ here), so that η → 0 gives log w → 0 exactly; without it E is scored at θ first. (The probe's sharded passes: probe/beyond.py.)"""
    base = base or score_sequences(engine, E_batch, tf_batch_size=tf_batch_size)
    per_eta = {}
    for eta in etas:
        new = score_at_eta(engine, E_batch, v_named, eta, real_step=real_step, tf_batch_size=tf_batch_size)
        per_eta[eta] = {k: np.asarray(col, dtype=np.float64) for k, col in eta_values(new, base).items()}
    h = np.asarray(base.seq_entropies.tolist(), dtype=np.float64)
    T = np.asarray([len(x) for x in base.token_logqs], dtype=np.float64)
    units = units_of(E_batch.num_prompts, E_batch.num_responses_per_prompt)
    return delta_h_from_values(h, T, per_eta, normalize=normalize, units=units, sampler_weights=sampler_weights)
