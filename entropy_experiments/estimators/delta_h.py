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
from collections.abc import Callable
from contextlib import contextmanager

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


def gather_locally(values: list[float], what: str) -> np.ndarray:
    """The one-process `gather`: the local values are already every sequence's."""
    return np.asarray(values, dtype=np.float64)


def score_at_eta(engine: PolicyEngine, E_batch: Batch, v_named: NamedTensors, eta: float, *, mode: str, optimizer=None,
                 named_params=None, grads: NamedTensors | None = None, max_grad_norm: float | None = None,
                 tf_batch_size: int | None = None) -> SequenceScores:
    """E scored at θ' = θ + η·v: as a parameter override, or after a real AdamW step with lr = η (undone)."""
    if mode == "param_override":
        return score_sequences(engine, E_batch, params_override=engine.build_params_override(v_named, eta),
                               tf_batch_size=tf_batch_size)
    if mode == "real_step":
        with real_optimizer_step(optimizer, named_params, grads, eta, max_grad_norm):
            return score_sequences(engine, E_batch, params_override=engine.build_params_override({}, 0.0),
                                   tf_batch_size=tf_batch_size)
    raise ValueError(f"importance.mode must be param_override or real_step, got {mode!r}")


def measure_delta_h(engine: PolicyEngine, E_batch: Batch | None, v_named: NamedTensors, etas: list[float], *, normalize: str,
                    units: list[int] | None = None, mode: str = "param_override", optimizer=None, named_params=None,
                    grads=None, max_grad_norm: float | None = None, base: SequenceScores | None = None,
                    tf_batch_size: int | None = None,
                    gather: Callable[[list[float], str], np.ndarray] = gather_locally,
                    sampler_weights: np.ndarray | None = None, token_weights: list[Tensor] | None = None) -> dict:
    """ΔH(η) with diagnostics for every η; returns {"H_orig", "true": [...], "per_sequence", "base", "linearity"}
    ("base": the per-sequence h and T at θ of all E, float64 [N], for the paired residuals).

    `base` (the scores at θ of the sequences of `E_batch`) must come from forwards with the layout of
    `tf_batch_size` rows (the probe passes phase 1's scores and their layout: no pass at θ here), so that
    η → 0 gives log w → 0 exactly; without it E is scored at θ first. real_step needs `optimizer`,
    `named_params` (trainable, in optimizer order) and `grads` (the U gradient, unclipped; clipped here like
    the real training step).

    `E_batch` may be a share of E (None: no sequence here) when `gather` turns the share's per-sequence
    values into arrays over all of E in order (parallel.py) and `units` gives every sequence's prompt;
    the SNIS estimate then runs on the whole E. By default E is whole and `gather` is the identity.

    `sampler_weights` s [N] over all of E (E drawn by a sampler other than the policy, docs/maths.md §12):
    Ĥ = Σ s h / Σ s d and Ĥ' = Σ s w h' / Σ s w d. The weight diagnostics of each row stay those of the
    step's own w = q_θ'/q_θ (the sampler's are reported once, by the sampler correction).

    `token_weights` β_ik of the sequences of `E_batch` (the surrogate's, for r_i by the central difference,
    central_difference.py): each η's per_sequence entry also gets "beta_logw", Σ_k β_ik (ℓ'_ik − ℓ_ik) [N].
    """
    if units is None:
        units = units_of(E_batch.num_prompts, E_batch.num_responses_per_prompt)
    local = E_batch is not None
    base = base or (score_sequences(engine, E_batch, tf_batch_size=tf_batch_size) if local else None)
    T = gather([len(x) for x in base.token_logqs] if local else [], "E lengths gather")
    h = gather(base.seq_entropies.tolist() if local else [], "E entropies gather")
    H_orig = entropy_estimate(h, T, normalize, None if sampler_weights is None else as_float64(sampler_weights))
    rows, per_seq = [], {}
    for eta in etas:
        new = (score_at_eta(engine, E_batch, v_named, eta, mode=mode, optimizer=optimizer, named_params=named_params,
                            grads=grads, max_grad_norm=max_grad_norm, tf_batch_size=tf_batch_size)
               if local else None)
        logw = gather(log_weights(new, base) if local else [], f"log-weights gather (η={eta:g})")
        h_new = gather(new.seq_entropies.tolist() if local else [], f"new entropies gather (η={eta:g})")
        est = snis.snis_delta_h(logw, h_new, h, T, normalize=normalize, units=units,
                                sampler_weights=sampler_weights)
        diag = snis.importance_diagnostics(logw)
        rows.append({"eta": eta, "deltaH_true": est.value, "H_upd": H_orig + est.value, "se": est.se, **diag})
        per_seq[eta] = {"logw": logw.tolist(), "h_new": h_new.tolist()}
        if token_weights is not None:
            bw = beta_log_ratio(new.token_logqs, base.token_logqs, token_weights) if local else []
            per_seq[eta]["beta_logw"] = gather(bw, f"β-weighted log-ratios gather (η={eta:g})").tolist()
        log.info("η=%+.3g  ΔH=%+.4e ± %.2e  ESS/N=%.3f  k̂=%.2f", eta, est.value, est.se,
                 diag["ess_frac"], diag["psis_khat"])
    return {"H_orig": H_orig, "true": rows, "per_sequence": per_seq, "base": {"h": h, "T": T},
            "linearity": snis.linearity_fit([r["eta"] for r in rows], [r["deltaH_true"] for r in rows])}
