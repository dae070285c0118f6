"""The typed results the probe's phases hand each other (probe.py), and the warnings they collect.

(ErrorBars lives with its maths in estimators/error_bars.py.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ..estimators.objective_gradient import Trainable, UGradients
from ..estimators.sequence_scores import SequenceScores
from ..estimators.surrogate import SurrogateCoefficients
from ..policy.engine import PolicyEngine

log = logging.getLogger("entropy_experiments.probe")
NamedTensors = dict[str, Tensor]


class WarningLog:
    """Warnings that change how a result must be read: logged loudly, kept (once each) for results.json."""

    def __init__(self, logger: logging.Logger = log, messages: list[str] | None = None):
        self.logger = logger
        self.messages = messages if messages is not None else []

    def warn(self, message: str) -> None:
        self.logger.warning(message)
        if message not in self.messages:
            self.messages.append(message)


@dataclass
class Policy:
    """What the phases share once loaded: the policy engine, the trainable parameters, the optimizer."""

    engine: PolicyEngine                      # generation + teacher forcing (policy/engine.py)
    trainable: Trainable
    optimizer: Any
    tokenizer: Any = None
    checkpoint_info: dict | None = None       # layout, files, base model, lr source (results.json)
    displacement: NamedTensors | None = None  # Δθ = θ_next − θ (predictors.next_checkpoint; None: not set)


@dataclass
class DeltaH1Result:
    """Phases 1–3 (update + entropy): δH₁ = lr·X̂·v and everything the error bars and the report need."""

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
    pieces_method: str | None = None               # "backward_hooks" | "jvp" | None (not computed)
    scores_tf_batch: int | None = None             # rows per forward the scores were made with (None: config's)
    predictor_directions: dict[str, NamedTensors] = field(default_factory=dict)  # competing predictors' v'
    predictor_pieces: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)  # their (a', r')
    predictors_unavailable: dict[str, str] = field(default_factory=dict)  # name → why it has no direction
    # extra per-sequence columns for per_sequence.jsonl, {name: {column: [N]}} (filled by later phases)
    per_sequence_extra: dict[str, dict[str, list[float]]] = field(default_factory=dict)
