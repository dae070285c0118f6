"""The policy of each checkpoint of a sweep, on ONE base model loaded once (`SweepPolicies.policy_for`).

The first checkpoint is loaded as the probe loads one (base + adapter: `checkpoint.load.load_policy`); every
later one swaps its LoRA weights into that PeftModel (`checkpoint.swap.swap_adapter`). Then the checkpoint's
AdamW state is loaded onto the same parameters exactly as `load_for_probe` loads it — or, when its saved lr is
0.0 (the end of a schedule) and the config sets no learning_rate, or when its next step reuses rollouts
(objective.num_iterations > 1, checkpoint/rollouts.py), not at all: `no_step` then says why, and the sweep
measures only the entropy there. The warnings a fresh load would give (base model, objective, fresh
optimizer) are returned in a WarningLog for the run's results.json.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.base_model import resolve_base_model_id
from ..checkpoint.layout import checkpoint_info, log_checkpoint_files
from ..checkpoint.learning_rate import LearningRate, resolve_learning_rate
from ..checkpoint.load import load_optimizer, load_policy
from ..checkpoint.optimizer_state import read_optimizer_file
from ..checkpoint.rollouts import reuse_refusal
from ..checkpoint.swap import saved_lr_ended, swap_adapter
from ..checkpoint.tokenizer_source import TokenizerChoice, choose_tokenizer, tokenizer_info
from ..checkpoint.trainer_log import rollout_reuse_warnings, vllm_correction_warnings
from ..config import ProbeConfig
from ..errors import ConfigError
from ..estimators.objective_gradient import Trainable
from ..policy.engine import PolicyEngine
from ..probe.results import Policy, WarningLog
from .discovery import SweepCheckpoint

__all__ = ["CheckpointPolicy", "SweepPolicies", "scoring_engine"]

log = logging.getLogger("entropy_experiments.sweep")


@dataclass
class CheckpointPolicy:
    """A checkpoint's policy (optimizer None when no step follows it), its load warnings, and why no step follows."""

    policy: Policy
    notes: WarningLog
    no_step: str | None


class SweepPolicies:
    """Holds the one base model (+ LoRA) of a sweep and puts each checkpoint's adapter and optimizer on it."""

    def __init__(self, logger: logging.Logger = log):
        self.logger = logger
        self.model = None
        self.tokenizer = None
        self.base_name: str | None = None
        self.tokenizer_choice: TokenizerChoice | None = None

    def _adapter(self, config: ProbeConfig, ck: SweepCheckpoint, notes: WarningLog):
        """The base model choice of `ck`, its adapter on the (loaded once) base model."""
        files = ck.files
        log_checkpoint_files(files, self.logger)
        base = resolve_base_model_id(config.checkpoint.base_model, files.adapter_dir)
        if base.warning is not None:
            notes.warn(base.warning)
        if self.model is None:
            self.logger.info("base model: %s (from %s), loaded once for the sweep", base.name, base.source)
            self.model, self.tokenizer = load_policy(config.checkpoint, str(files.adapter_dir), base,
                                                     config.checkpoint.device_map, config.precision.runtime_dtype)
            self.base_name = base.name
            self.tokenizer_choice = choose_tokenizer(files.adapter_dir, base)  # the first checkpoint's, if it has one
        else:
            swap_adapter(self.model, files.adapter_dir, base, self.base_name)
        return base

    def policy_adapter(self, config: ProbeConfig, ck: SweepCheckpoint) -> None:
        """Put `ck`'s adapter on the shared model (loading the base model first when none is loaded)."""
        self._adapter(config, ck, WarningLog(self.logger))

    def policy_for(self, config: ProbeConfig, ck: SweepCheckpoint) -> CheckpointPolicy:
        """`ck`'s policy on the shared model: adapter swapped in, AdamW state loaded (unless no step follows)."""
        notes = WarningLog(self.logger)
        base = self._adapter(config, ck, notes)
        for message in [*config.objective_warnings(ck.files.layout), *vllm_correction_warnings(
                ck.files.trainer_state_path, config.objective.vllm_importance_sampling_correction),
                *rollout_reuse_warnings(ck.files.trainer_state_path, config.objective.num_iterations)]:
            notes.warn(message)
        ended = saved_lr_ended(ck.files, config.learning_rate)  # no next step at all: said before any reuse
        no_step = ended or reuse_refusal(ck.name, ck.step, config.objective.num_iterations)  # off-policy next step
        optimizer = None
        if no_step is None:
            optimizer, lr, fresh_warning = load_optimizer(config.checkpoint, self.model, ck.files,
                                                          config.learning_rate, self.logger)
            if fresh_warning:
                notes.warn(fresh_warning)
        elif ended:
            lr = LearningRate(0.0, "optimizer param_groups lr (0.0: the schedule ended)")
        else:  # the next step reuses rollouts: not probed, but its lr is the schedule's
            lr = next_step_lr(ck.files, config.learning_rate)
        engine = PolicyEngine(self.model, self.tokenizer, config.policy_settings(), self.logger)
        info = checkpoint_info(ck.files, base, lr)
        info["tokenizer"] = tokenizer_info(self.tokenizer_choice, self.tokenizer)
        info["next_step_lr"] = lr.value
        policy = Policy(engine, Trainable.of(self.model), optimizer, self.tokenizer, info)
        return CheckpointPolicy(policy, notes, no_step)


def next_step_lr(files, config_lr: float | None) -> LearningRate:
    """The lr of the step after a checkpoint that is not probed (its next step reuses rollouts): config
    learning_rate, else the saved param-group lr; 0.0 where neither can be read."""
    path = files.optimizer_path
    if config_lr is None and (path is None or not Path(path).is_file()):
        return LearningRate(0.0, "not read (no optimizer file)")
    groups = read_optimizer_file(Path(path))["param_groups"] if config_lr is None else []
    try:
        return resolve_learning_rate(config_lr, groups)
    except ConfigError as err:
        return LearningRate(0.0, f"not read ({err})")


def scoring_engine(policies: SweepPolicies, config: ProbeConfig, ck: SweepCheckpoint) -> PolicyEngine:
    """A policy engine at `ck`'s parameters (adapter swapped in; no optimizer): for teacher forcing only."""
    policies.policy_adapter(config, ck)
    return PolicyEngine(policies.model, policies.tokenizer, config.policy_settings(), policies.logger)
