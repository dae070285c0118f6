"""Ground truth ΔH(η) by self-normalised importance sampling on the same E (MATH.md §5).

For each η the E sequences (sampled at θ) are re-scored at θ' = θ + η·v — either as a parameter
override through `functional_call` (`param_override`, the live model untouched) or after a real
`optimizer.step()` with lr = η (`real_step`, parameters and optimizer state restored exactly after).
log w_i = Σ_k (ℓ'_ik − ℓ_ik) in float64, h'_i = Σ_k H'_ik, and Ĥ' = Σ w h' / Σ w T (per_token).
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .data.batch import batch_to_sequences, subset_batch
from .distributed import SINGLE, DistContext
from .estimators import snis as stats

NamedTensors = dict[str, Tensor]
log = logging.getLogger("entropy_experiments.importance")


@dataclass
class TokenScores:
    """ℓ_ik and H_ik of every E sequence (float64 [T_i] each), in (prompt, response) order."""

    logq: list[Tensor]
    entropy: list[Tensor]


def score_sequences(sp, E_batch: dict, params_override: NamedTensors | None = None) -> TokenScores:
    """No-grad teacher forcing of E at θ (or at the override mapping): per-token ℓ and RB entropy."""
    lp = sp.teacher_force_logprobs(batch_to_sequences(E_batch), with_grad=False, compute_rb=True,
                                   params_override=params_override)
    logq = [torch.as_tensor(t).double() for row in lp.token_logqs for t in row]
    entropy = [torch.as_tensor(h).double() for row in lp.rb_entropies for h in row]
    return TokenScores(logq=logq, entropy=entropy)


def log_weights(new: TokenScores, old: TokenScores) -> np.ndarray:
    """log w_i = Σ_k (ℓ'_ik − ℓ_ik), summed in float64 from per-token differences; −inf when a realised
    token left the new nucleus."""
    return np.array([float((n.double() - o.double()).sum()) for n, o in zip(new.logq, old.logq)])


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


def measure_delta_h(sp, E_batch: dict, v_named: NamedTensors, etas: list[float], *, normalize: str,
                    mode: str = "param_override", optimizer=None, named_params=None, grads=None,
                    max_grad_norm: float | None = None, base: TokenScores | None = None,
                    dist: DistContext | None = None) -> dict:
    """ΔH(η) with diagnostics for every η; returns {"base": {...}, "true": [...], "per_sequence": {...}}.

    `base` (scores at θ) is recomputed through the same no-grad path unless given, so that η → 0
    gives log w → 0 exactly. real_step needs `optimizer`, `named_params` (trainable, in optimizer
    order) and `grads` (the U gradient, unclipped; clipped here like the real training step).

    Distributed (`dist`): each rank scores its own prompts (whole teacher-forcing chunks) at θ and at
    every θ'; the per-sequence T, h, log w and h' are gathered in global order and the SNIS estimate
    runs on the whole E, identically on every rank. real_step needs the all-reduced gradient.
    """
    dist = dist or SINGLE
    G = E_batch["num_responses_per_prompt"]
    N = E_batch["num_prompts"] * G
    units = [b for b in range(E_batch["num_prompts"]) for _ in range(G)]
    if dist.enabled:
        mine = dist.prompt_slice(E_batch["num_prompts"], max(1, int(sp.config.tf_batch_size) // G))
        rows_mine = [b * G + g for b in mine for g in range(G)]
        local_E = subset_batch(E_batch, mine)
        if base is not None:
            base = TokenScores(logq=[base.logq[n] for n in rows_mine], entropy=[base.entropy[n] for n in rows_mine])
    else:
        rows_mine, local_E = list(range(N)), E_batch

    def gather(values_mine: list[float], what: str) -> np.ndarray:
        if not dist.enabled:
            return np.asarray(values_mine, dtype=np.float64)
        full = np.zeros(N, dtype=np.float64)
        full[rows_mine] = values_mine
        return dist.sum_rows(full, what)

    def score(override) -> TokenScores | None:
        return score_sequences(sp, local_E, override) if rows_mine else None

    base = base or score(None)
    T = gather([len(x) for x in base.logq] if base else [], "E lengths gather")
    h = gather([float(x.sum()) for x in base.entropy] if base else [], "E entropies gather")
    d = T if normalize == "per_token" else np.ones_like(T)
    H_orig = float(h.sum() / d.sum())

    rows, per_seq = [], {}
    for eta in etas:
        if mode == "param_override":
            new = score(sp.build_params_override(v_named, eta))
        elif mode == "real_step":
            with real_optimizer_step(optimizer, named_params, grads, eta, max_grad_norm):
                new = score(sp.build_params_override({}, 0.0))
        else:
            raise ValueError(f"importance.mode must be param_override or real_step, got {mode!r}")
        logw = gather(log_weights(new, base) if new else [], f"log-weights gather (η={eta:g})")
        h_new = gather([float(x.sum()) for x in new.entropy] if new else [], f"new entropies gather (η={eta:g})")
        est = stats.snis_delta_h(logw, h_new, h, T, normalize=normalize, units=units)
        diag = stats.importance_diagnostics(logw)
        rows.append({"eta": eta, "deltaH_true": est.value, "H_upd": H_orig + est.value, "se": est.se, **diag})
        per_seq[eta] = {"logw": logw.tolist(), "h_new": h_new.tolist()}
        log.info("η=%+.3g  ΔH=%+.4e ± %.2e  ESS/N=%.3f  k̂=%.2f", eta, est.value, est.se,
                 diag["ess_frac"], diag["psis_khat"])
    return {"H_orig": H_orig, "true": rows, "per_sequence": per_seq,
            "linearity": stats.linearity_fit([r["eta"] for r in rows], [r["deltaH_true"] for r in rows])}
