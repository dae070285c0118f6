"""`EntropyAutopilot`: steer a TRL GRPO run's entropy by scaling the lr of each step before it is taken.

    trainer.add_callback(EntropyAutopilot(trainer, target="initial", every=1, max_drop=0.02))

At each probed step, right before `optimizer.step()`, the `predict="trainer_step"` probe (trainer_step.py)
predicts δH_next ± SE_E of the step the trainer's gradients and AdamW are about to make at the scheduler's lr.
The rule (autopilot_rule.py) picks a multiplier m; every param group's lr is multiplied by m for this step and
the scheduler's value is put back right after it (the trainer's logged `learning_rate` stays the scheduler's;
the row's `lr` is the one used). Between probed steps (every > 1) the last m is kept. The row's prediction is
for the step really taken (× m); it adds `lr_multiplier`, `H_target`, `wanted` and `autopilot` (why m).

With `max_push` > 0, where the wanted change is a rise the step at m falls short of, an entropy-gradient term is
added to the trainer's gradients as well and the step is taken at m = max(m, 1) (entropy_push.py); the row then
adds `entropy_push`, `push_c`, `push_on_E1`, `push_on_E2` and its `autopilot` ends in `+push`.

Under several processes (DDP) every number the rule reads is the union's, the same on every rank, so every rank
takes the same decision; `decision()` (the multiplier, and the gradients after a push) is checked across the
ranks at every step (`ranks.agree`): ranks that disagree stop with one error instead of diverging.

The multiplier, the previous decision and the initial entropy (target "initial") are stored in the trainer's
state (`trainer_state.json` of every checkpoint, key `entropy_autopilot`) and restored when training resumes
from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from entropy_experiments.errors import ConfigError
from entropy_experiments.integrations import ranks
from entropy_experiments.integrations.autopilot_rule import KEY, AutopilotRule, decide, target_of
from entropy_experiments.integrations.entropy_push import push_step
from entropy_experiments.integrations.live_state import untouched
from entropy_experiments.integrations.trainer_step import TRAINER_STEP, PendingTrainerStep
from entropy_experiments.integrations.trl_callback import EntropyProbeCallback
from entropy_experiments.integrations.trl_step_probe import named_params

STATE_KEY = "entropy_autopilot"  # not a callback class name: transformers' callback restore leaves it alone


class EntropyAutopilot(EntropyProbeCallback):
    """Scale each step's lr so that its predicted entropy change follows a target (module docstring)."""

    def __init__(self, trainer: Any, target: float | str | Callable[[int], float] = "initial", every: int = 1, *,
                 min_multiplier: float = 0.1, max_multiplier: float = 2.0, max_drop: float | None = 0.05,
                 deadband_z: float = 1.0, max_rate: float = 1.5, gain: float = 1.0, max_push: float = 0.0,
                 **options: Any):
        super().__init__(trainer, every=every, predict=TRAINER_STEP, **options)
        self.rule = AutopilotRule(min_multiplier, max_multiplier, max_drop, deadband_z, max_rate, gain)
        self.rule.check()
        if not 0 <= max_push < math.inf:
            raise ConfigError(f"{KEY}: max_push must be >= 0 (the entropy term's largest size relative to the "
                              f"trainer's gradient; 0: off), got {max_push!r}")
        self.max_push = float(max_push)
        self.target = target_of(target)
        self.multiplier = 1.0
        self.initial_H: float | None = None
        self.scheduled_lrs: list | None = None

    def exported(self) -> dict:
        """What a resumed run needs (stored in the trainer's state at every step)."""
        return {"multiplier": self.multiplier, "initial_H": self.initial_H}

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        saved = (state.stateful_callbacks or {}).get(STATE_KEY)
        if saved:
            self.multiplier, self.initial_H = float(saved["multiplier"]), saved["initial_H"]

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        super().on_pre_optimizer_step(args, state, control, **kwargs)
        if self.pending is not None and self.pending.step == state.global_step + 1:
            self.pending = self.steered(self.pending)
            if self.wants_push(self.pending):
                t0 = time.perf_counter()
                self.pending = self.pushed(self.pending)
                self.probe_seconds += time.perf_counter() - t0
        groups = self.policy.optimizer.param_groups
        self.scheduled_lrs = [g["lr"] for g in groups]
        for group in groups:
            group["lr"] = group["lr"] * self.multiplier
        ranks.agree(self.dist, self.decision(), f"{KEY}: step {state.global_step + 1}")

    def decision(self) -> dict:
        """What every rank must apply alike to this step: the lr multiplier, and the gradients a push changed."""
        values: dict = {"lr_multiplier": self.multiplier}
        if self.pending is not None and "entropy_push" in self.pending.extra:
            values["gradients"] = ranks.grads_digest(named_params(self.policy))
        return values

    def steered(self, pending: PendingTrainerStep) -> PendingTrainerStep:
        """Choose m for the step of `pending` (predicted at m = 1) and return its prediction at m."""
        if self.initial_H is None:
            self.initial_H = pending.H
        H_target = self.target(pending.step, self.initial_H)
        decision = decide(self.rule, predicted=pending.delta_h_next, se=pending.se_E, H=pending.H,
                          H_se=pending.H_se, H_target=H_target, previous=self.multiplier)
        self.multiplier = decision.multiplier
        return pending.scaled(decision.multiplier, lr_multiplier=decision.multiplier, H_target=H_target,
                              wanted=decision.wanted, autopilot=decision.reason,
                              delta_h_next_at_scheduler_lr=pending.delta_h_next)

    def wants_push(self, pending: PendingTrainerStep) -> bool:
        """The push is on and the wanted change is a rise that the step at m falls short of beyond noise."""
        wanted = pending.extra["wanted"]
        return self.max_push > 0 and wanted > 0 and pending.delta_h_next + self.rule.deadband_z * pending.se_E < wanted

    def pushed(self, pending: PendingTrainerStep) -> PendingTrainerStep:
        """The step with the entropy-gradient term added (entropy_push.py), taken at m = max(m, 1)."""
        self.multiplier = max(self.multiplier, 1.0)
        config = self.config.model_copy(update={"seed": self.step_seed(pending.step)})
        with untouched(self.policy.trainable.model):
            again, push = push_step(config, self.policy, self.examples, pending, self.multiplier, self.max_push)
        extra = {**pending.extra, "lr_multiplier": self.multiplier, "autopilot": pending.extra["autopilot"] + "+push",
                 **push}
        return dataclasses.replace(again.scaled(self.multiplier, **extra), seconds=again.seconds + pending.seconds)

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.scheduled_lrs is not None:
            for group, lr in zip(self.policy.optimizer.param_groups, self.scheduled_lrs):
                group["lr"] = lr
            self.scheduled_lrs = None

    def on_step_end(self, args, state, control, **kwargs):
        state.stateful_callbacks[STATE_KEY] = self.exported()
        return super().on_step_end(args, state, control, **kwargs)
