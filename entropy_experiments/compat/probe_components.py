"""ProbeComponents (the seeds' API) — a thin façade over the probe's phases in one process.

`ProbeComponents(model, config, sequence_processor=sp)` keeps the seeds' compute methods on packed E / U
batch dicts (`accumulate_sum_Y`, `accumulate_sum_X`, `compute_delta_h1_from_batches`), each delegating to
a phase function of `entropy_experiments.probe.recipe`; it owns no maths of its own. New code calls the
recipe directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from ..config import ProbeConfig, config_from_dict
from ..data.batch import Batch
from ..estimators.objective_gradient import Trainable, UGradients
from ..estimators.surrogate import SurrogateCoefficients
from ..probe import recipe
from ..probe.recipe import DeltaH1Result, Policy
from ..tensors import NamedTensors

__all__ = ["ProbeComponents", "SeedDeltaH1Result"]



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
    """One-process δH₁ pieces on packed E / U batch dicts (see the module docstring)."""

    def __init__(self, model, config: ProbeConfig | dict, logger: logging.Logger | None = None, *,
                 sequence_processor, optimizer=None):
        self.model = model
        self.config = config if isinstance(config, ProbeConfig) else config_from_dict(config)
        self.logger = logger or logging.getLogger("entropy_experiments.probe")
        self.sp = sequence_processor
        self.optimizer = optimizer

    def _policy(self, optimizer=None) -> Policy:
        return Policy(self.sp, Trainable.of(self.model), optimizer if optimizer is not None else self.optimizer)

    def accumulate_sum_Y(self, U_batch: dict, groups: list[list[int]] | None = None) -> UGradients:
        """∇L_U of the trainer's objective per group of prompts (default: one group) (`recipe.update_gradients`)."""
        U = Batch.from_dict(U_batch, "U_batch")
        return recipe.update_gradients(self.config, self._policy(), U, groups or [list(range(U.num_prompts))])

    def accumulate_sum_X(self, E_batch: dict, coefs: SurrogateCoefficients) -> NamedTensors:
        """X̂ = ∇L_X by a microbatched backward of the surrogate (`recipe.surrogate_gradient_phase`)."""
        return recipe.surrogate_gradient_phase(self.config, self._policy(), Batch.from_dict(E_batch, "E_batch"), coefs)

    def compute_delta_h1_from_batches(self, E_batch: dict, U_batch: dict, optimizer, *,
                                      u_groups: list[list[int]] | None = None,
                                      per_sequence_pieces: bool = False) -> SeedDeltaH1Result:
        """δH₁ = lr · X̂·v from packed batches and the loaded optimizer (`recipe.delta_h1_phase`)."""
        E, U = Batch.from_dict(E_batch, "E_batch"), Batch.from_dict(U_batch, "U_batch")
        return SeedDeltaH1Result.of(recipe.delta_h1_phase(self.config, self._policy(optimizer), E, U,
                                                         u_groups=u_groups, per_sequence_pieces=per_sequence_pieces))
