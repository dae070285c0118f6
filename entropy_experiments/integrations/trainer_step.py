"""The callback's `predict="trainer_step"` mode: the entropy change of the step the trainer is about to take.

Right before `optimizer.step()` (after gradient clipping; parameters θ, the trainer's gradients in `.grad`):

    Δθ_next    the exact AdamW step those gradients and the optimizer's state are about to make, with the lr
               the scheduler set in each param group (`next_step.next_adamw_step`: nothing is stepped)
    E          a fresh evaluation batch drawn by the probe's own sampler from the live policy (its own seed,
               the trainer's prompts and sampling settings; independent of the trainer's batch)
    δH_next    = X̂·Δθ_next ± SE_E: the pieces a, r along Δθ_next by one forward-mode (jvp) scoring pass
               over E, the statistic (A − Ĥ·B)/D and its jackknife over the E units — the probe's first-order
               prediction along a given step. No U term: the step is the trainer's, not a sample of the probe's.

After the step (parameters θ'):

    realised   Ĥ(θ') − Ĥ(θ) on the SAME E by SNIS (log w = ℓ(θ') − ℓ(θ)) with its jackknife SE
               (the autopilot measures E at θ + Δθ before the step it takes: where θ' is that to float rounding,
               that measurement is `realised`)
    residual   realised − δH_next, ONE jackknife over the E units (both share E): what first order misses
    step_error max |θ' − θ − Δθ_next|: the prediction's step against the one torch took (float rounding)

The trainer's gradients drive the step, so this mode needs no rollouts, rewards or objective of its own: a
trainer's loss type, vLLM generation, rollout reuse and loss terms the `probe_U` mode refuses are all fine
here. Only sampling settings the probe's q (temperature + top-p) cannot represent are refused — E must be
drawn from the policy whose entropy is reported.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from entropy_experiments.config import ProbeConfig
from entropy_experiments.data.batch import Batch
from entropy_experiments.errors import ConfigError
from entropy_experiments.estimators.delta_h import DeltaH
from entropy_experiments.estimators.entropy_gradient import coefficients, sampler_weights
from entropy_experiments.estimators.jackknife import entropy_with_se, se_E
from entropy_experiments.estimators.paired import paired_residual
from entropy_experiments.estimators.sequence_scores import SequenceScores
from entropy_experiments.estimators.surrogate import directional_pieces
from entropy_experiments.integrations import ranks
from entropy_experiments.integrations import trl_trainer_view as view
from entropy_experiments.integrations.live_state import copy_of, parameters_set_to
from entropy_experiments.integrations.next_step import NextStep, next_adamw_step
from entropy_experiments.integrations.representable import check_representable, step_agrees
from entropy_experiments.integrations.trl_step_probe import named_params
from entropy_experiments.probe.parallel import SINGLE, DistContext
from entropy_experiments.probe.recipe import score_E
from entropy_experiments.probe.results import Policy
from entropy_experiments.probe.sampling import BatchDraw, SamplingSpec, draw_plan, sample_sharded

TRAINER_STEP, PROBE_U = "trainer_step", "probe_U"
PREDICT_MODES = (PROBE_U, TRAINER_STEP)
SAMPLING_KEYS = ("top_k", "min_p", "repetition_penalty", "generation_kwargs")


def check_trainer_step_trainer(trainer: Any) -> None:
    """ConfigError (one line) unless `trainer` is a GRPOTrainer (one process or DDP) whose sampling E can mirror
    and whose next step the AdamW prediction can be (representable.py)."""
    view.check_grpo(trainer)
    check_representable(trainer)
    refusals = view.unsupported_settings(trainer.args)
    for key in SAMPLING_KEYS:
        refused, why = refusals[key]
        if refused:
            raise ConfigError(f"{view.KEY}: GRPOConfig.{key}={getattr(trainer.args, key)!r} is not supported "
                              f"({why})")


def trainer_step_config(args: Any, *, B_E: int, seed: int, microbatch_size: int) -> ProbeConfig:
    """The probe's config for E only: the trainer's sampling, no objective of its own (the trainer's gradients
    make the step)."""
    return view.probe_config(args, B_E=B_E, B_U=2, G=None, seed=seed, microbatch_size=microbatch_size,
                             objective={"trainer": "trl"})


@dataclass
class PendingTrainerStep:
    """What is known before the trainer's step, to be checked after it."""

    step: int
    E: Batch
    scores: SequenceScores
    pieces: tuple[Tensor, Tensor]
    weights: Tensor | None       # the sampler correction's s [N] (None: E drawn by the policy)
    theta: dict[str, Tensor]
    next_step: NextStep
    H: float
    H_se: float
    delta_h_next: float
    se_E: float
    seconds: float
    warnings: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # further row fields (the autopilot's)
    measured: DeltaH | None = None  # ΔĤ on E at θ + Δθ_next, measured before the step (the autopilot's)

    def prediction(self) -> dict:
        """The row's numbers known before the step."""
        return {"step": self.step, "predict": TRAINER_STEP, "H": self.H, "H_se": self.H_se, "delta_h_next": self.delta_h_next,
                "se_E": self.se_E, "lr": self.next_step.lr, "lrs": list(self.next_step.lrs),
                "step_norm": self.next_step.norm, **self.extra}

    def scaled(self, multiplier: float, **extra) -> PendingTrainerStep:
        """The same prediction for the step taken with every group's lr × `multiplier` (an AdamW step is linear
        in its lr: Δθ, the pieces, δH_next and SE_E all scale by it), with `extra` row fields."""
        m = float(multiplier)
        upcoming = NextStep({n: m * s for n, s in self.next_step.step.items()}, tuple(m * lr for lr in self.next_step.lrs))
        return dataclasses.replace(self, pieces=(m * self.pieces[0], m * self.pieces[1]), next_step=upcoming,
                                   delta_h_next=m * self.delta_h_next, se_E=abs(m) * self.se_E,
                                   extra={**self.extra, **extra})


def sample_E(config: ProbeConfig, policy: Policy, examples: list, dist: DistContext | None = None) -> Batch:
    """A fresh E by the probe's own sampler (its index plan and seed + 1, as the probe's E). Under several
    processes (`dist`, None: the trainer's, `ranks.current`) each rank draws its share with its own seed
    stream and every rank gets the union in plan order."""
    dist = ranks.current() if dist is None else dist
    bc = config.batch_config
    plan = draw_plan(config, len(examples), SINGLE)  # a function of the seed: the same on every rank
    spec = SamplingSpec.choose(policy.engine, reference=not config.sampler.batched,
                               chat_template_kwargs=bc.chat_template_kwargs,
                               memory_budget_gb=config.estimator.memory_budget_gb)
    return sample_sharded(spec, examples, BatchDraw(plan.E_prompt_indices, plan.E_responses_per_prompt,
                                                    config.seed + 1, what="E"), dist)


def predict_trainer_step(config: ProbeConfig, policy: Policy, examples: list, step: int,
                         dist: DistContext | None = None) -> PendingTrainerStep:
    """Δθ_next from the live gradients and optimizer, a fresh E, and δH_next = X̂·Δθ_next ± SE_E on it."""
    t0 = time.perf_counter()
    E = sample_E(config, policy, examples, dist)
    return predict_on_E(config, policy, E, step, t0, dist)


def predict_on_E(config: ProbeConfig, policy: Policy, E: Batch, step: int, t0: float,
                 dist: DistContext | None = None) -> PendingTrainerStep:
    """δH_next = X̂·Δθ_next ± SE_E on a given E (the union of the ranks'), Δθ_next from the gradients now in
    `.grad` (`t0`: when the probe's work on this step began). Each rank scores its share of E (`dist`, None:
    `ranks.current`); the per-sequence pieces are gathered, so every number is the union's on every rank."""
    named = named_params(policy)
    upcoming = next_adamw_step(policy.optimizer, named)
    scores = score_E(config, policy, E, upcoming.step, ranks.current() if dist is None else dist)
    weights = sampler_weights(scores, E.sampler_response_logqs())
    pieces = directional_pieces(scores.d_logq, scores.d_entropy, coefficients(scores, config.entropy_options(),
                                                                             weights))
    normalize = config.estimator.normalize
    value, se = se_E(pieces[0], pieces[1], scores.seq_entropies, scores.lengths, scores.unit_of_sequence,
                     normalize=normalize, learning_rate=1.0, sampler_weights=weights)
    d = scores.lengths if normalize == "per_token" else torch.ones_like(scores.lengths)
    H = entropy_with_se(scores.seq_entropies, d, scores.unit_of_sequence, weights)
    return PendingTrainerStep(step, E, scores, pieces, weights, copy_of(named), upcoming, H.value, H.se, value, se,
                              time.perf_counter() - t0)


def check_trainer_step(config: ProbeConfig, policy: Policy, pending: PendingTrainerStep,
                       dist: DistContext | None = None) -> dict:
    """The row of one probed step: the prediction, the realised change on the same E, the residual (each rank
    scores its share of E at θ', `ranks.measured_on_shares`). Where the step taken is the predicted one to
    float rounding (`step_ok`) and E was already measured at θ + Δθ_next before the step (`pending.measured`),
    that measurement is the realised change: E scored again at θ' would give it to rounding."""
    t0 = time.perf_counter()
    named = named_params(policy)
    delta = {n: p.detach() - pending.theta[n] for n, p in named.items()}
    step_error = max((float((delta[n] - pending.next_step.step[n].to(delta[n])).abs().max()) for n in delta),
                     default=0.0)
    largest = max((float(s.abs().max()) for s in pending.next_step.step.values()), default=0.0)
    step_ok = step_agrees(step_error, largest, max((float(t.abs().max()) for t in pending.theta.values()), default=0.0))
    weights = None if pending.weights is None else pending.weights.numpy()
    before_step = step_ok and pending.measured is not None
    if before_step:
        realised = pending.measured
    else:
        with parameters_set_to(named, pending.theta):
            realised = ranks.measured_on_shares(config, policy.engine, pending.E, delta, base=pending.scores,
                                                sampler_weights=weights,
                                                dist=ranks.current() if dist is None else dist)
    per, true = realised.per_sequence[1.0], realised.rows[0]
    residual = paired_residual(per["logw"], per["h_new"], realised.h, realised.T, pending.pieces[0].numpy(),
                               pending.pieces[1].numpy(), 1.0, normalize=config.estimator.normalize,
                               units=pending.scores.unit_of_sequence, sampler_weights=weights)
    return {**pending.prediction(), "realised": true["deltaH_true"], "realised_se": true["se"],
            "realised_before_step": before_step, "ess_frac": true["ess_frac"],
            "first_order_residual": residual.value, "first_order_residual_se": residual.se,
            "first_order_z": residual.value / residual.se if residual.se else None, "step_error": step_error,
            "step_ok": step_ok, "n_E": len(pending.scores.unit_of_sequence),
            "seconds": pending.seconds + time.perf_counter() - t0,
            "warnings": step_warnings(pending, delta, step_error, largest, step_ok)}


def step_warnings(pending: PendingTrainerStep, delta: dict[str, Tensor], step_error: float, largest: float,
                  step_ok: bool) -> list[str]:
    """The prediction's warnings, and those of a step taken other than predicted or not taken at all."""
    warnings = list(pending.warnings)
    if not step_ok:
        warnings.append(f"step {pending.step}: the step taken differs from the predicted AdamW step by {step_error:.3g} "
                        f"(largest predicted change {largest:.3g}): another callback changed `.grad` or the lr "
                        "after this one, or the optimizer is not the one predicted")
    if all(not torch.any(d != 0) for d in delta.values()):
        warnings.append(f"step {pending.step}: the trainer's step left the adapter unchanged (Δθ = 0, a skipped "
                        "step or an lr of 0): the prediction and the realised change are 0")
    return warnings
