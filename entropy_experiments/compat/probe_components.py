"""ProbeComponents (the seeds' API) — a thin façade over the probe's phases in one process.

`ProbeComponents(model, config, sequence_processor=sp)` keeps the seeds' methods (`accumulate_sum_Y`,
`accumulate_sum_X`, `compute_delta_h1_from_batches`) and a few the tests use, each delegating to the
phase functions of probe.py and the estimators they call; it owns no maths of its own. New code calls
`entropy_experiments.probe.recipe` directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from torch import Tensor

from ..checkpoint.learning_rate import resolve_learning_rate
from ..config import ProbeConfig, config_from_dict
from ..data.batch import Batch
from ..estimators.entropy_gradient import coefficients, pieces_method
from ..estimators.objective_gradient import Trainable, UGradients, chunked, split_into_groups
from ..estimators.sequence_scores import SequenceScores
from ..estimators.step_directions import step_direction
from ..estimators.surrogate import SurrogateCoefficients
from ..probe import recipe as probe
from ..probe.recipe import DeltaH1Result, Policy
from ..tensors import NamedTensors

__all__ = ["DeltaH1Result", "EScores", "ProbeComponents", "SeedDeltaH1Result", "UGradients", "chunked",
           "split_into_groups"]

EScores = SequenceScores  # the seeds' name for the E scores


@dataclass(frozen=True)
class SeedDeltaH1Result(DeltaH1Result):
    """`DeltaH1Result` with seed 001's names (compute_delta_h1_from_batches: {delta_h1, bars_dot, Xbar, Ybar,
    timings}) as aliases of the probe's."""

    @classmethod
    def of(cls, result: DeltaH1Result) -> SeedDeltaH1Result:
        return cls(**{f.name: getattr(result, f.name) for f in fields(result)})

    @property
    def bars_dot(self) -> float:
        """X̂·v (`x_hat_dot_v`)."""
        return self.x_hat_dot_v

    @property
    def Xbar(self) -> NamedTensors:
        """X̂ (`X_hat`)."""
        return self.X_hat

    @property
    def Ybar(self) -> NamedTensors:
        """v (`v`; it is v, not README's Ȳ: that is the no_momentum direction)."""
        return self.v


class ProbeComponents:
    """One-process δH₁ pieces on packed E / U batches (see the module docstring)."""

    def __init__(self, model, config: ProbeConfig | dict, logger: logging.Logger | None = None, *,
                 sequence_processor, optimizer=None):
        self.model = model
        self.config = config if isinstance(config, ProbeConfig) else config_from_dict(config)
        self.logger = logger or logging.getLogger("entropy_experiments.probe")
        self.sp = sequence_processor
        self.trainable = Trainable.of(model)
        self.param_names = list(self.trainable.names)
        self.params = list(self.trainable.params)
        self.objective = self.config.objective_options()
        self.optimizer = optimizer

    def _policy(self, optimizer=None) -> Policy:
        return Policy(self.sp, self.trainable, optimizer if optimizer is not None else self.optimizer)

    # ------------------------------------------------------------------ U side
    def accumulate_sum_Y(self, U_batch: dict, groups: list[list[int]] | None = None) -> UGradients:
        """∇L_U of the trainer's objective per group of prompts (default: one group)."""
        U = Batch.from_dict(U_batch, "U_batch")
        return probe.update_gradients(self.config, self._policy(), U, groups or [list(range(U.num_prompts))])

    def learning_rate(self, optimizer) -> float:
        """The configured learning_rate, else the optimizer's saved lr (`checkpoint.resolve_learning_rate`)."""
        return resolve_learning_rate(self.config.learning_rate, optimizer.param_groups).value

    def update_direction(self, grads: NamedTensors, optimizer) -> tuple[NamedTensors, dict]:
        """v per unit lr from g and the optimizer's saved state (docs/maths.md §4) + a description of it."""
        return step_direction(self.config.step_options(), self._policy(optimizer), grads)

    # ------------------------------------------------------------------ E side
    def score_E(self, E_batch: dict, v_named: NamedTensors | None = None) -> SequenceScores:
        """ℓ_ik and H_ik on E (no graph); with `v_named`, also their exact derivatives along v (forward mode)."""
        return probe.score_E(self.config, self._policy(), Batch.from_dict(E_batch, "E_batch"), v_named)

    def coefficients(self, scores: SequenceScores) -> SurrogateCoefficients:
        return coefficients(scores, self.config.entropy_options())

    def accumulate_sum_X(self, E_batch: dict, coefs: SurrogateCoefficients) -> NamedTensors:
        """X̂ = ∇L_X by a microbatched backward of the surrogate (docs/maths.md §3), fp32 buffers."""
        return probe.surrogate_gradient_phase(self.config, self._policy(), Batch.from_dict(E_batch, "E_batch"), coefs)

    def accumulate_X_one_pass(self, E_batch: dict, v_named: NamedTensors | None):
        """(X̂, scores, coefficients, pieces (a, r) along v or None) from ONE forward per microbatch (baseline none)."""
        directions = {probe.MAIN: v_named} if v_named is not None else {}
        e_pass = probe.one_pass_phase(self.config, self._policy(), Batch.from_dict(E_batch, "E_batch"), directions)
        return e_pass.X_hat, e_pass.scores, e_pass.coefficients, e_pass.pieces.get(probe.MAIN)

    def pieces_method(self, want_pieces: bool) -> str:
        return pieces_method(self.trainable, self.config.entropy_options(), want_pieces)

    # ------------------------------------------------------------------ the seeds' entry point
    def compute_delta_h1_from_batches(self, E_batch: dict, U_batch: dict, optimizer, *,
                                      u_groups: list[list[int]] | None = None,
                                      per_sequence_pieces: bool = False) -> SeedDeltaH1Result:
        """δH₁ = lr · X̂·v from packed batches and the loaded optimizer (`probe.delta_h1_phase`)."""
        E, U = Batch.from_dict(E_batch, "E_batch"), Batch.from_dict(U_batch, "U_batch")
        return SeedDeltaH1Result.of(probe.delta_h1_phase(self.config, self._policy(optimizer), E, U,
                                                         u_groups=u_groups, per_sequence_pieces=per_sequence_pieces))

    def pieces(self, result: DeltaH1Result) -> tuple[Tensor, Tensor]:
        """(a [N], r [N]) per-sequence directional pieces; Σ gives X̂·v = (Σa − Ĥ Σr)/D."""
        if result.pieces is None:
            raise ValueError("per-sequence pieces need compute_delta_h1_from_batches(per_sequence_pieces=True)")
        return result.pieces
