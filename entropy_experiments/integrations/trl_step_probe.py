"""One probed training step: the prediction before it, the check after it (the callback's maths).

Before the trainer's step (parameters θ, the live AdamW state, the lr the step will use):

    E, U       sampled from the live policy by the probe's own plan (the trainer's prompts and rewards)
    δH₁        = lr·X̂·v ± SE (SE_E, SE_U), exactly as `entropy-probe run` on a checkpoint of θ
    θ          kept (an exact copy of the adapter parameters)

After it (parameters θ' = θ + Δθ, the step the trainer really took):

    δH_Δθ      = X̂·Δθ ± SE_E, the pieces along Δθ by one jvp pass over E at θ (θ swapped back in for it)
    ΔH_real    = Ĥ(θ') − Ĥ(θ) on the SAME E by SNIS (log w = ℓ(θ') − ℓ(θ)), with its jackknife SE
    residual   = ΔH_real − δH_Δθ, its SE from one jackknife over the E units (both share E): what first order
                 misses of the real step
    U noise    = δH₁ − δH_Δθ: the probe's step from its own U against the trainer's, z against √2·SE_U
                 (`estimators/displacement.u_noise`; the probe's U size against the trainer's batch)

These are the offline probe's numbers for the checkpoint pair (θ, θ') on the same samples: the same phase
functions (probe/recipe.py), the same estimators.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from entropy_experiments.config import ProbeConfig
from entropy_experiments.data.batch import Batch
from entropy_experiments.estimators.displacement import (
    BatchColumns,
    DisplacementPieces,
    displacement_entry,
    step_comparison,
    u_noise,
)
from entropy_experiments.estimators.error_bars import ErrorBars
from entropy_experiments.estimators.paired import paired_residual
from entropy_experiments.estimators.surrogate import directional_pieces
from entropy_experiments.integrations.live_state import copy_of, parameters_set_to
from entropy_experiments.integrations.ranks import measured_on_shares
from entropy_experiments.probe.parallel import SINGLE, DistContext
from entropy_experiments.probe.recipe import estimate_phase, score_E
from entropy_experiments.probe.results import DeltaH1Result, Policy, WarningLog
from entropy_experiments.probe.sampling import sample_phase

from ..tensors import NamedTensors


@dataclass
class PendingStep:
    """What the probe knows before the step, to be checked after it."""

    step: int
    E: Batch
    U: Batch
    res: DeltaH1Result
    bars: ErrorBars
    theta: NamedTensors
    seconds: float
    warnings: list[str] = field(default_factory=list)


def named_params(policy: Policy) -> dict:
    """{name: parameter} of the policy's trainable (adapter) parameters."""
    return dict(zip(policy.trainable.names, policy.trainable.params))


def predict_step(config: ProbeConfig, policy: Policy, examples: list, rewards, step: int,
                 dist: DistContext = SINGLE) -> PendingStep:
    """Sample E and U from the live policy, δH₁ ± SE for the step about to be taken, and keep θ (under several
    processes each rank samples and back-propagates its share, as the offline probe under torchrun)."""
    t0 = time.perf_counter()
    notes = WarningLog()
    samples = sample_phase(config, policy.engine, dist, examples=examples, rewards=rewards)
    estimates = estimate_phase(config, policy, samples.E, samples.U, notes, dist)
    theta = copy_of(named_params(policy))
    return PendingStep(step, samples.E, samples.U, estimates.delta_h1, estimates.error_bars, theta, time.perf_counter() - t0, list(notes.messages))


def displacement_pieces(config: ProbeConfig, policy: Policy, pending: PendingStep, delta: NamedTensors,
                        dist: DistContext = SINGLE):
    """(a, r) along Δθ on E at θ: one jvp scoring pass (θ swapped in, then θ' restored bit for bit)."""
    with parameters_set_to(named_params(policy), pending.theta):
        scores = score_E(config, policy, pending.E, delta, dist)
        realised = measured_on_shares(config, policy.engine, pending.E, delta, base=pending.res.scores,
                                      sampler_weights=None, dist=dist, tf_batch_size=pending.res.scores_tf_batch)
    return directional_pieces(scores.d_logq, scores.d_entropy, pending.res.coefficients), realised


def check_step(config: ProbeConfig, policy: Policy, pending: PendingStep, u_batch_ratio: float,
               dist: DistContext = SINGLE) -> dict:
    """The row of one probed step: prediction, realised change on the same E, displacement and residuals."""
    t0 = time.perf_counter()
    delta = {n: p.detach() - pending.theta[n] for n, p in named_params(policy).items()}
    pieces, realised = displacement_pieces(config, policy, pending, delta, dist)
    res, bars, normalize = pending.res, pending.bars, config.estimator.normalize
    entry = displacement_entry(res.X_hat, delta, pieces, res.scores, normalize=normalize, second=None)
    per = realised.per_sequence[1.0]
    units = res.scores.unit_of_sequence
    residual = paired_residual(per["logw"], per["h_new"], realised.h, realised.T,
                               pieces[0].numpy(), pieces[1].numpy(), 1.0, normalize=normalize, units=units)
    d = realised.T if normalize == "per_token" else np.ones_like(realised.T)
    columns = BatchColumns(h=realised.h, d=d, keys=[str(u) for u in units])
    noise = u_noise(columns, DisplacementPieces(a=pieces[0].numpy(), r=pieces[1].numpy(),
                                                a_v=None if bars.a is None else bars.a.numpy(),
                                                r_v=None if bars.r is None else bars.r.numpy()),
                    step_lr=res.learning_rate, steps=1, se_U=bars.se["U"], u_batch_ratio=u_batch_ratio)
    true = realised.rows[0]
    warnings = list(pending.warnings)
    if entry["zero_displacement"]:
        warnings.append(f"step {pending.step}: the trainer's step left the adapter unchanged (Δθ = 0): δH_Δθ = 0 "
                        "and the realised change is 0 by construction (a skipped step?)")
    return {"step": pending.step, "lr": res.learning_rate, "H": realised.H_orig,
            "delta_h1": res.delta_h1, "se": bars.se["total"], "se_E": bars.se["E"], "se_U": bars.se["U"],
            "realised": true["deltaH_true"], "realised_se": true["se"], "ess_frac": true["ess_frac"],
            "displacement": entry["delta_h1"], "displacement_se": entry["se"],
            "first_order_residual": residual.value, "first_order_residual_se": residual.se,
            "first_order_z": residual.value / residual.se if residual.se else None,
            "u_noise": None if noise is None else noise["value"], "u_noise_z": None if noise is None else noise["z"],
            **step_comparison(res.v, res.learning_rate, delta), "delta_theta_norm": entry["delta_theta_norm"],
            "n_E": len(units), "n_U": pending.U.num_prompts * pending.U.num_responses_per_prompt,
            "seconds": pending.seconds + time.perf_counter() - t0, "warnings": warnings}
