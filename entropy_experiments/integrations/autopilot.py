"""`EntropyAutopilot`: hold a TRL GRPO run's entropy on a target without stopping the learning.

    trainer.add_callback(EntropyAutopilot(trainer, target="initial"))

At each probed step (every = 1 by default), right before `optimizer.step()`:

1. one pass over a fresh evaluation batch E predicts δ ± s, the entropy change of the step the trainer is about
   to take, and e ± s_e, that of the entropy term along the previous step's entropy gradient
   (steered_step.py);
2. the filter (entropy_filter.py) combines E's Ĥ with the paired realised changes of the steps so far into the
   gap to the target;
3. the control law (autopilot_rule.py) rests at "do nothing" (m = 1, κ = 0) and acts only on a significant
   predicted departure beyond the drift budget — through the entropy term first (it changes the step's
   direction), through the lr where that is predicted to do better; by default each candidate step is
   measured on E before it is taken (SNIS at θ + Δθ(m, κ), `steer_on="measured"`), so a large step's
   curvature is seen (`"first_order"`: δ and e alone);
4. every param group's lr is multiplied by m for this step (the scheduler's value is put back right after it);
   right after the step the term m·κ·‖Δθ_next‖·u is added to the parameters, outside AdamW's moments.

After the step the row is checked as the `trainer_step` callback checks it; its `realised` is the measurement
made in 3. of the step taken, wherever torch took that step to float rounding. `realised` and `first_order_z`
grade the first-order prediction on E (the step really taken, term included), not the controller. The controller's
own error is the next row's `controller_error`: that step's fresh Ĥ minus the target the previous decision
aimed at. The state (m, the filter, the target's start) is stored in the trainer's state (`trainer_state.json`
of every checkpoint, key `entropy_autopilot`) and restored when training resumes.

Under several processes (DDP) each rank draws and scores its share of E, and every number the law reads (δ, e,
Ĥ, X̂, the realised change) is the union's, the same on every rank, so every rank takes the same decision;
`decision()` (the multiplier, the term and its displacement) is checked across the ranks at every step
(`ranks.agree`): ranks that disagree stop with one error instead of diverging.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from entropy_experiments.errors import ConfigError, ProbeError
from entropy_experiments.integrations import ranks
from entropy_experiments.integrations.autopilot_rule import (
    INITIAL,
    KEY,
    AutopilotRule,
    Estimate,
    decide,
    decide_measured,
    target_of,
)
from entropy_experiments.integrations.entropy_filter import EntropyTrack, after_step, first_track, observe
from entropy_experiments.integrations.live_state import untouched
from entropy_experiments.integrations.steered_step import (
    SteerablePass,
    add_to_parameters,
    change_of,
    measurement,
    remembered,
    steerable_prediction,
    steered,
    term_displacement,
)
from entropy_experiments.integrations.trainer_step import TRAINER_STEP, sample_E
from entropy_experiments.integrations.trl_callback import EntropyProbeCallback

log = logging.getLogger("entropy_experiments.callback")
STATE_KEY = "entropy_autopilot"  # not a callback class name: transformers' callback restore leaves it alone
DIRECTION_MEMORY = 0.7  # the share of the term direction kept from earlier steps (a moving average of X̂)
RULE_OPTIONS = tuple(f.name for f in dataclasses.fields(AutopilotRule))
MEASURED, FIRST_ORDER = "measured", "first_order"


class EntropyAutopilot(EntropyProbeCallback):
    """Steer each step's entropy change toward a target by an entropy term and the lr (module docstring)."""

    option_names = (*RULE_OPTIONS, "steer_on")

    def __init__(self, trainer: Any, target: float | str | Callable[[int], float] = INITIAL, every: int = 1,
                 steer_on: str = MEASURED, **options: Any):
        rule = {k: options.pop(k) for k in RULE_OPTIONS if k in options}
        super().__init__(trainer, every=every, predict=TRAINER_STEP, **options)
        self.rule = AutopilotRule(**rule)
        self.rule.check()
        if steer_on not in (MEASURED, FIRST_ORDER):
            raise ConfigError(f"{KEY}: steer_on must be {MEASURED!r} or {FIRST_ORDER!r}, got {steer_on!r}")
        self.steer_on = steer_on
        self.hold_initial = target == INITIAL
        self.target = target_of(target)
        self.multiplier = 1.0
        self.track: EntropyTrack | None = None
        self.direction = None
        self.aimed_at: float | None = None
        self.scheduled_lrs: list | None = None
        self.term: dict = {}

    def exported(self) -> dict:
        """What a resumed run needs (stored in the trainer's state at every step)."""
        track = None if self.track is None else [self.track.h0, self.track.drift, *self.track.cov]
        return {"multiplier": self.multiplier, "track": track, "aimed_at": self.aimed_at}

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        saved = (state.stateful_callbacks or {}).get(STATE_KEY)
        if saved:
            self.multiplier, self.aimed_at = float(saved["multiplier"]), saved.get("aimed_at")
            if saved.get("track"):
                h0, drift, *cov = saved["track"]
                self.track = EntropyTrack(h0, drift, tuple(cov))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        step = state.global_step + 1
        if not state.global_step % self.options.every:
            config = self.config.model_copy(update={"seed": self.step_seed(step)})
            t0 = time.perf_counter()
            with untouched(self.policy.trainable.model):
                try:
                    E = sample_E(config, self.policy, self.examples, self.dist)
                    drawn = time.perf_counter() - t0
                    steerable = steerable_prediction(config, self.policy, E, step, t0, self.direction, self.dist)
                    self.pending = self.decided(config, steerable, drawn)
                except ProbeError as exc:
                    self._record({"step": step, "error": str(exc)})
            self.probe_seconds += time.perf_counter() - t0
        groups = self.policy.optimizer.param_groups
        self.scheduled_lrs = [g["lr"] for g in groups]
        for group in groups:
            group["lr"] = group["lr"] * self.multiplier
        ranks.agree(self.dist, self.decision(), f"{KEY}: step {step}")

    def decision(self) -> dict:
        """What every rank must apply alike to this step: the lr multiplier and the term's displacement."""
        return {"lr_multiplier": self.multiplier, **{f"term/{n}": t for n, t in self.term.items()}}

    def decided(self, config, steerable: SteerablePass, drawn: float):
        """The decision for the step of `steerable` (E drawn in `drawn` seconds), and its prediction at (m, κ)
        with the row's fields."""
        pending = steerable.pending
        fresh = Estimate(pending.H, pending.H_se)
        self.track = first_track(fresh) if self.track is None else observe(self.track, fresh)
        H_target = self.track.h0 if self.hold_initial else self.target(pending.step, self.track.h0)
        gap = self.track.gap_to(None if self.hold_initial else H_target)
        term = steerable.term_effect(config)
        measured = {}  # (m, κ) → its measurement: the chosen step's is its realised change (step_ok)
        if self.steer_on == MEASURED:
            def measure(m: float, kappa: float) -> Estimate:
                measured[m, kappa] = measurement(config, self.policy, steerable, m, kappa, self.dist)
                return change_of(measured[m, kappa])
            started = time.perf_counter()
            decision = decide_measured(self.rule, gap=gap, previous=self.multiplier, term=term, measure=measure)
            measuring = time.perf_counter() - started
        else:
            decision, measuring = decide(self.rule, step=Estimate(pending.delta_h_next, pending.se_E), gap=gap,
                                         previous=self.multiplier, term=term), 0.0
        outcome = None if self.aimed_at is None else pending.H - self.aimed_at
        self.multiplier, self.aimed_at = decision.multiplier, H_target
        self.term = term_displacement(steerable, decision.multiplier, decision.term)
        self.direction = remembered(self.direction, steerable.X_hat, DIRECTION_MEMORY)
        filtered = self.track.entropy
        return steered(config, steerable, decision.multiplier, decision.term,
                       measured.get((decision.multiplier, decision.term)),
                       lr_multiplier=decision.multiplier, entropy_term=decision.term, H_target=H_target,
                       H_filtered=filtered.value, H_filtered_se=filtered.se, gap=gap.value, gap_se=gap.se,
                       wanted=decision.wanted, measured_change=decision.predicted if decision.predicted_se is not None else None,
                       measured_change_se=decision.predicted_se, delta_h_next_unsteered=pending.delta_h_next,
                       se_E_unsteered=pending.se_E, steering=decision.steering, limit=decision.limit,
                       controller_error=outcome, controller_error_se=pending.H_se if outcome is not None else None,
                       seconds_drawing_E=drawn, seconds_measuring=measuring)

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.scheduled_lrs is not None:
            for group, lr in zip(self.policy.optimizer.param_groups, self.scheduled_lrs):
                group["lr"] = lr
            self.scheduled_lrs = None
        if self.term:
            add_to_parameters(self.policy, self.term)
            self.term = {}

    def on_step_end(self, args, state, control, **kwargs):
        result = super().on_step_end(args, state, control, **kwargs)
        row = self.rows[-1] if self.rows else {}
        if self.track is not None and row.get("step") == state.global_step and "realised" in row:
            realised = Estimate(row["realised"], row["realised_se"])
            if not (math.isfinite(realised.value) and math.isfinite(realised.se)):
                # unmeasured: the step's change is taken as unknown to within a fresh Ĥ's noise, not as 0 ± 0
                log.warning("%s: step %s: the realised change is not finite; the filter carries it as 0 ± SE_Ĥ",
                            KEY, state.global_step)
                realised = Estimate(0.0, row["H_se"] if math.isfinite(row.get("H_se", math.nan)) else 1.0)
            self.track = after_step(self.track, realised, self.options.every)
        state.stateful_callbacks[STATE_KEY] = self.exported()
        return result
