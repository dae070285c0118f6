"""`ProbeConfig`: the whole probe configuration, its cross-section checks, dumps and hash."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml
from pydantic import Field, model_validator

from entropy_experiments.data.datasets.gsm_symbolic import DEFAULT_POOL_SIZE
from entropy_experiments.data.datasets.gsm_symbolic import NAME as GENERATED_DATASET
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

# config_hash is taken over the spelling a run directory's hash was written with, so that every run directory
# and sweep on disk resumes: section -> (its hashed name, {key: its hashed name}).
HASHED_AS: dict[str, tuple[str, dict[str, str]]] = {
    "sampler": ("probe_rework", {"batched": "use_sequence_processor_sampling"}),
}
# Keys hashed only when set to something other than the value under which a config computes what a config
# without the key computes, so that run directories on disk still resume: section -> {key: that value}.
HASHED_WHEN_CHANGED: dict[str, dict[str, object]] = {
    "objective": {"kl_in_reward_coef": 0.0, "vllm_importance_sampling_mode": "sequence_mask",
                  "vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_clip_max": 3.0,
                  "use_bias_correction_kl": False, "use_adaptive_entropy": False, "entropy_target": 0.2,
                  "policy_loss": "vanilla", "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
                  "kl_cov_ratio": 0.0002, "ppo_kl_coef": 1.0, "epsilon": None,
                  "epsilon_high": None},
    "second_order": {"method": "jvp", "eta_list": [0.0003, 0.001]},  # the values existing run hashes assume
    "variance": {"r_method": "backward", "r_eta": None},
    "importance": {"eta_over_lr": None},  # None: η from eta_list, absolute
    # gen_batch_size is always hashed (an explicit integer fixes the draws; "auto" draws otherwise, so its hash
    # differs). The sampler's dtype and engine enter only when set.
    "generation": {"sampler_dtype": "auto", "sampler_engine": "generate"},
    # on: next_checkpoint (null outside a sweep) decides; a sweep's per-checkpoint config differs anyway
    "predictors": {"displacement": True},
}


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
        """First 16 hex chars of sha256 over the canonical JSON of the config, `output`, `distributed` and `what_if`
        excluded (none changes a number of the run: a run can be resumed on any number of ranks or backend, and the
        what-if, asked on the command line, runs after it); sections under their hashed names (`HASHED_AS`),
        some keys only when changed (`HASHED_WHEN_CHANGED`),
        objective.use_bias_correction_kl only where it changes the gradient, a null pool_size of the generated
        default data set as the 500 problems it makes."""
        d = self.model_dump(mode="json", exclude={"output", "distributed", "what_if"})
        # use_bias_correction_kl enters as whether it acts (trl, β ≠ 0, on): the numbers of a config changed
        # only there, so only there its hash changes (`HASHED_WHEN_CHANGED` drops its inactive value, False)
        d["objective"]["use_bias_correction_kl"] = self.objective_options().weights_kl
        # a null batch_config.pool_size means the data set's own size, for the generated default data set 500
        # problems: hashed as 500, the size that data set always has (a read split's null stays null)
        if d["batch_config"]["pool_size"] is None and d["batch_config"]["dataset_name"] == GENERATED_DATASET:
            d["batch_config"]["pool_size"] = DEFAULT_POOL_SIZE
        for section, keys in HASHED_WHEN_CHANGED.items():
            for key, earlier in keys.items():
                if d[section].get(key) == earlier:
                    del d[section][key]
        for section, (old_section, old_keys) in HASHED_AS.items():
            d[old_section] = {old_keys.get(k, k): v for k, v in d.pop(section).items()}
        payload = json.dumps(
            d,
            sort_keys=True,
            separators=(",", ":"),
            allow_nan=False,
        )
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]
