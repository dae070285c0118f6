"""`ProbeConfig`: the whole probe configuration, its cross-section checks, dumps and hash."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml
from pydantic import Field, model_validator

from entropy_experiments.errors import ConfigError

from .sections import (
    BatchSection,
    CheckpointSection,
    DistributedSection,
    EstimatorSection,
    GenerationSection,
    ImportanceSection,
    ObjectiveSection,
    OutputSection,
    PrecisionSection,
    PredictorsSection,
    RewardSection,
    SamplerSection,
    SecondOrderSection,
    VarianceSection,
    _Section,
)
from .what_if_section import WhatIfSection

# How each trainer samples by default (docs/objectives.md; trl 1.16.0 GRPOConfig: temperature 1.0, top_p 1.0, top_k 0,
# no stop strings; verl's rollout and OpenRLHF the same): the probe's generation keys the presets set.
# The probe has no top-k (it samples from the full vocabulary, as top_k 0 does).
TRAINER_GENERATION: dict[str, dict[str, Any]] = {
    trainer: {"stop_strings": [], "temperature": 1.0, "top_p": 1.0} for trainer in ("trl", "verl", "openrlhf")}

# Sections that change no number of a run: a run resumes on any number of ranks or backend, and the what-if, asked on
# the command line, runs after it. config_hash leaves them out.
UNHASHED_SECTIONS = frozenset({"output", "distributed", "what_if"})


class ProbeConfig(_Section):
    """The whole probe configuration (every key with its comment: `entropy-probe config --show`)."""

    seed: int = Field(42, ge=0)
    learning_rate: float | None = Field(None, gt=0)  # None: the optimizer's saved param_groups lr
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    batch_config: BatchSection = Field(default_factory=BatchSection)
    generation: GenerationSection = Field(default_factory=GenerationSection)
    precision: PrecisionSection = Field(default_factory=PrecisionSection)
    sampler: SamplerSection = Field(default_factory=SamplerSection)
    estimator: EstimatorSection = Field(default_factory=EstimatorSection)
    objective: ObjectiveSection = Field(default_factory=ObjectiveSection)
    importance: ImportanceSection = Field(default_factory=ImportanceSection)
    variance: VarianceSection = Field(default_factory=VarianceSection)
    second_order: SecondOrderSection = Field(default_factory=SecondOrderSection)
    predictors: PredictorsSection = Field(default_factory=PredictorsSection)
    what_if: WhatIfSection = Field(default_factory=WhatIfSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    output: OutputSection = Field(default_factory=OutputSection)

    @model_validator(mode="after")
    def _trainer_generation(self) -> ProbeConfig:
        """`objective.trainer` sets the generation keys the user did not give to that trainer's sampling
        (TRAINER_GENERATION); the resolved values are what config.yaml records."""
        preset = TRAINER_GENERATION.get(self.objective.trainer or "", {})
        for key, value in preset.items():
            if key not in self.generation.model_fields_set:
                setattr(self.generation, key, list(value) if isinstance(value, list) else value)
        return self

    @model_validator(mode="after")
    def _check_cross_section(self) -> ProbeConfig:
        # The U-side jackknife leaves out one group of prompts at a time: it needs >= 1 prompt per group.
        groups = self.variance.u_groups
        if groups is not None and groups > self.batch_config.B_U:
            raise ValueError(
                f"variance.u_groups: must be <= batch_config.B_U ({self.batch_config.B_U}), got {groups}"
            )
        try:  # an unknown loss type or a micro-batch count that cannot split U fails here, before any work
            options = self.objective_options()
            n_u = self.batch_config.B_U * self.batch_config.G
            if n_u % options.micro_batches:
                raise ConfigError(f"objective.micro_batches: must divide the {n_u} U sequences "
                                  f"(batch_config.B_U·G), got {options.micro_batches}")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        self._check_r_method()
        return self

    def _check_r_method(self) -> None:
        """variance.r_method central_difference needs the backward-hook pieces and an η (one line naming the key)."""
        var, imp = self.variance, self.importance
        if not var.enabled or var.r_method != "central_difference":
            return
        from ..estimators.central_difference import central_difference_eta, r_eta_message
        from ..estimators.delta_h import eta_grid

        for key, value, needed in (("estimator.baseline", self.estimator.baseline, "none"),
                                   ("variance.directional", var.directional, "auto or backward_hooks")):
            if value not in needed.split(" or "):
                raise ValueError(f"{key}: variance.r_method central_difference needs {key} {needed} (the backward-hook "
                                 f"pieces), got {value}; set variance.r_method backward")
        if central_difference_eta(var.r_eta, eta_grid(imp.eta_list, imp.symmetric) if imp.enabled else []) is None:
            raise ValueError(r_eta_message(imp.enabled))

    def delta_h_etas(self) -> list[float]:
        """The η of the ΔH passes, sorted ([] with importance off): importance.eta_list (with −η when symmetric)
        and the ±η of the finite-difference second order, which are measured anyway and so enter `true`."""
        from ..estimators.delta_h import eta_grid

        imp, so = self.importance, self.second_order
        if not imp.enabled:
            return []
        pairs = list(so.eta_list) if so.enabled and so.method == "finite_difference" else []
        return sorted(set(eta_grid(imp.eta_list, imp.symmetric)) | set(eta_grid(pairs, True)))

    def objective_options(self):
        """The resolved `objectives.ObjectiveOptions` (explicit keys > trainer preset > defaults)."""
        from ..estimators.objectives import resolve

        explicit = self.objective.explicit()
        if self.objective.use_adaptive_entropy:  # TRL's controller: the coefficient and gate saved with the checkpoint
            from ..checkpoint.entropy_ctrl_state import read_entropy_ctrl_state
            from ..estimators.entropy_terms import adaptive_entropy_coef

            if self.objective.trainer != "trl":
                raise ConfigError("objective.use_adaptive_entropy: true is TRL's adaptive entropy controller, "
                                  f"objective.trainer is {self.objective.trainer or 'null'}: set objective.trainer: trl")
            coef, last = read_entropy_ctrl_state(self.checkpoint.checkpoint_path)
            explicit["entropy_coef"] = adaptive_entropy_coef(coef, last, self.objective.entropy_target)
        return resolve(explicit, default_completion_length=self.generation.max_new_tokens)

    def u_group_count(self, n_prompts: int | None = None) -> int:
        """K of the SE_U jackknife over U groups: variance.u_groups (null: min(B_U, 8)) capped at the U prompts
        (`n_prompts`, default batch_config.B_U); whether the jackknife runs at all is variance.enabled."""
        n = self.batch_config.B_U if n_prompts is None else n_prompts
        return min(self.variance.u_groups or min(n, 8), n)

    def entropy_options(self):
        """The E side's `entropy_gradient.EntropyOptions` (estimator.* and variance.directional)."""
        from ..estimators.entropy_gradient import EntropyOptions

        est = self.estimator
        return EntropyOptions(normalize=est.normalize, x_mode=est.x_mode, baseline=est.baseline,
                              microbatch_size=est.microbatch_size, directional=self.variance.directional)

    def step_options(self):
        """The `step_directions.StepOptions`: estimator.update_direction, the resolved objective, predictors.enabled."""
        from ..estimators.step_directions import StepOptions

        return StepOptions(self.estimator.update_direction, self.objective_options(), self.predictors.enabled)

    def policy_settings(self):
        """The policy engine's `PolicySettings` (the generation and precision sections, validated)."""
        from ..policy.generation_config import parse_settings

        d = self.to_dict()
        return parse_settings({k: d[k] for k in ("generation", "precision")})

    def sequence_processor_settings(self) -> dict[str, Any]:
        """The sections the seed façade `compat.sequence_processor.SequenceProcessor` reads (generation, precision,
        reward, batch_config)."""
        d = self.to_dict()
        return {k: d[k] for k in ("generation", "precision", "reward", "batch_config")}

    def objective_warnings(self, layout: str) -> list[str]:
        """Warnings where the objective may not be the trainer's, for a checkpoint of `layout` (results.json)."""
        objective, ck, warnings = self.objective, self.checkpoint, []
        if layout == "trainer" and objective.trainer is None and objective.loss_type is None:
            warnings.append(f"OBJECTIVE NOT SET: {ck.checkpoint_path} was written by a Hugging Face Trainer (TRL?) but "
                            "neither objective.trainer nor objective.loss_type is set, so v is the step of the seeds' "
                            "Dr-GRPO loss (dr_grpo_per_prompt), not your trainer's; set objective.trainer: trl "
                            "(or verl / openrlhf) — see README 'Probing a TRL / verl / OpenRLHF run'")
        preset = TRAINER_GENERATION.get(objective.trainer or "", {})
        if preset and self.generation.stop_strings:
            warnings.append(f"generation.stop_strings is {self.generation.stop_strings} but {objective.trainer} stops "
                            "at EOS only (or max length): responses cut at a stop string are not the trainer's samples")
        options, max_new = self.objective_options(), self.generation.max_new_tokens
        if options.loss_type == "dr_grpo" and options.max_completion_length != max_new:
            warnings.append(f"objective.max_completion_length is {options.max_completion_length} (dr_grpo's constant "
                            f"normaliser) but generation.max_new_tokens is {max_new}: set both to your trainer's "
                            "max_completion_length, or the gradient scale and the sampled lengths are not the trainer's")
        # use_bias_correction_kl null is the trainer's default (TRL: true), recorded in results.json: no warning
        return warnings

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of the resolved config (YAML / JSON safe)."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        """Resolved config as YAML; `load_config` on it gives an equal config."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    def config_hash(self) -> str:
        """First 16 hex chars of sha256 over the canonical JSON (sorted keys, compact) of the config without
        `UNHASHED_SECTIONS`. A run directory records it with the results.json schema version
        (report/results_schema.SCHEMA_VERSION): --resume needs both to match."""
        d = self.model_dump(mode="json", exclude=set(UNHASHED_SECTIONS))
        payload = json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]
