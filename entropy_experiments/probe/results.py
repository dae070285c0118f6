"""The typed (frozen) results the probe's phases hand each other (recipe.py), and the warnings they collect.

(ErrorBars lives with its maths in estimators/error_bars.py.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ..data.batch import Batch
from ..data.plan import IndexPlan
from ..estimators.delta_h import DeltaH
from ..estimators.error_bars import ErrorBars
from ..estimators.objective_gradient import Trainable, UGradients
from ..estimators.sequence_scores import SequenceScores
from ..estimators.surrogate import SurrogateCoefficients
from ..policy.engine import PolicyEngine
from ..tensors import NamedTensors

log = logging.getLogger("entropy_experiments.probe")


class WarningLog:
    """Warnings that change how a result must be read: logged loudly, kept (once each) for results.json."""

    def __init__(self, logger: logging.Logger = log, messages: list[str] | None = None):
        self.logger = logger
        self.messages = messages if messages is not None else []

    def warn(self, message: str) -> None:
        self.logger.warning(message)
        if message not in self.messages:
            self.messages.append(message)


@dataclass(frozen=True)
class Policy:
    """What the phases share once loaded: the policy engine, the trainable parameters, the optimizer."""

    engine: PolicyEngine                      # generation + teacher forcing (policy/engine.py)
    trainable: Trainable
    optimizer: Any
    tokenizer: Any = None
    checkpoint_info: dict | None = None       # layout, files, base model, lr source (results.json)
    displacement: NamedTensors | None = None  # Δθ = θ_next − θ (predictors.next_checkpoint; None: not set)


@dataclass(frozen=True)
class DeltaH1Result:
    """update_direction + e_pass: δH₁ = lr·X̂·v and everything the error bars and the report need."""

    delta_h1: float
    x_hat_dot_v: float                      # X̂·v: δH₁ per unit lr
    learning_rate: float
    X_hat: NamedTensors                     # X̂ = ∇L_X on E (fp32)
    v: NamedTensors                         # the update direction per unit lr (estimator.update_direction)
    coefficients: SurrogateCoefficients
    scores: SequenceScores
    u_gradients: UGradients
    update_info: dict
    timings: dict = field(default_factory=dict)
    pieces: tuple[Tensor, Tensor] | None = None   # (a [N], r [N]) when the E pass produced them
    e_pass: str | None = None                      # the E pass that ran (probe/e_pass.E_PASSES: results.json `e_pass`)
    scores_tf_batch: int | None = None             # rows per forward the scores were made with (None: config's)
    predictor_directions: dict[str, NamedTensors] = field(default_factory=dict)  # competing predictors' v'
    predictor_pieces: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)  # their (a', r')
    predictors_unavailable: dict[str, str] = field(default_factory=dict)  # name → why it has no direction
    # the sampler correction (docs/maths.md §12): s_i = q_θ(y_i)/q_sampler(y_i) normalised to mean 1, float64 [N];
    # None when the sampler is the policy (every E-side estimate then runs unweighted, bit-identical)
    sampler_weights: Tensor | None = None
    # r_i = D_v L_β,i: "backward" (exact, from the E pass) | "central_difference" (the ±η passes, docs/maths.md §6);
    # until those passes ran, `r_rows` holds D_v L_X,i [N] of the one L_X backward and `pieces` is None
    # (beyond.central_difference_phase returns a copy with the pieces)
    r_method: str = "backward"
    r_eta: float | None = None
    r_rows: Tensor | None = None


@dataclass(frozen=True)
class Samples:
    """sample: the packed E and U batches and the index plan they were drawn by (None: saved batches)."""

    E: Batch
    U: Batch
    plan: IndexPlan | None = None
    sampler: dict | None = None  # results.json "sampler" (report/results_dict.sampler_block)


@dataclass(frozen=True)
class UpdateStep:
    """update_direction: ∇L_U per group of prompts, v (the update direction per unit lr) and its description."""

    gradients: UGradients
    v: NamedTensors
    info: dict


@dataclass(frozen=True)
class SurrogatePass:
    """e_pass (on E): X̂ = ∇L_X, the E scores, the surrogate's coefficients and, per direction name, the
    per-sequence pieces (a, r) along it; `timings` of its passes when they were timed separately."""

    X_hat: NamedTensors
    scores: SequenceScores
    coefficients: SurrogateCoefficients
    pieces: dict[str, tuple[Tensor, Tensor]]
    timings: dict[str, float] = field(default_factory=dict)
    rows: Tensor | None = None  # D_v L_X,i [N] of the L_X backward when r_i is left to the ±η passes


@dataclass(frozen=True)
class Estimates:
    """update_direction, e_pass and error_bars: δH₁ (with X̂, v and the scores), its error bars and their timings."""

    delta_h1: DeltaH1Result
    error_bars: ErrorBars
    timing: dict[str, float]
    truth: DeltaH | None = None  # ΔH(η), when it was measured before the error bars (r_i by the central difference)


@dataclass(frozen=True)
class BeyondFirstOrder:
    """delta_h, second_order and predictors: ΔH(η) on E (`truth`: the rows and the linearity fits), the paired residual per η, the
    second-order report, the competing predictors (None: not run) and their timings."""

    truth: DeltaH
    residuals: list[dict]
    second_order: dict | None
    predictors: dict | None
    timing: dict[str, float]
    # extra per-sequence columns for per_sequence.jsonl, {name: {column: [N]}} (the displacement predictor's)
    per_sequence_extra: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    rounding_floor: dict | None = None    # F of ΔH from the ΔH passes (estimators/rounding_floor.py); None: not estimable
    warnings: list[str] = field(default_factory=list)  # for results.json `warnings`: ΔH rows under 5 F
