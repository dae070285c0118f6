"""`EntropyProbeCallback`: the probe inside a TRL GRPOTrainer run, every K optimizer steps.

    trainer = GRPOTrainer(model=..., reward_funcs=[...], args=GRPOConfig(...), train_dataset=..., peft_config=...)
    trainer.add_callback(EntropyProbeCallback(trainer, every=5))
    trainer.train()

At a probed step (the 1st, (1+K)-th, … optimizer step) the callback, before the step, samples its own E and U
from the live policy (the trainer's prompts, chat template, reward functions and sampling settings), predicts
δH₁ ± SE for the step about to be taken (the trainer's objective, the live AdamW state, the lr the scheduler set
for it) and keeps a copy of the adapter; after the step it scores the same E under the new parameters
(`trl_step_probe.py`). Each probed step's row is appended to `OUTPUT_DIR/entropy_probe.jsonl` and logged under
`entropy_probe/` as its own log entry at the same `step` as the trainer's (`_report`): it reaches
`state.log_history`, every `report_to` integration and the console, while the trainer's own entries (loss,
grad_norm, learning_rate, TRL's averaged metrics) stay exactly what they are without the callback.

With num_iterations = μ > 1 each rollout batch serves μ optimizer steps and only the first is on-policy
(checkpoint/rollouts.py): a probed step that reuses rollouts is skipped, with a `{"step", "skipped"}` row in
entropy_probe.jsonl and a log line (steps are counted from the global_step the training session started at).

The trainer's step is untouched: random streams, train/eval mode and gradient buffers are restored
(`live_state.py`), the optimizer is only read, and parameters moved for a measurement are copied back exactly —
a run with the callback takes bit-identical steps to one without it (tests/test_trl_callback.py).

Under several processes (DDP: `accelerate launch`, torchrun) each rank samples and scores its share of the
probe's batches and every number is the union's, the same on every rank; rank 0 alone writes
entropy_probe.jsonl, the saved batches and the console line (`ranks.py`, tests/test_trl_ddp.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from entropy_experiments.checkpoint.rollouts import reuse_note, reuses_rollouts
from entropy_experiments.errors import ConfigError, ProbeError, closest_match
from entropy_experiments.integrations import ranks
from entropy_experiments.integrations import trl_trainer_view as view
from entropy_experiments.integrations.live_state import untouched
from entropy_experiments.integrations.representable import check_optimizer
from entropy_experiments.integrations.trainer_step import (
    PREDICT_MODES,
    TRAINER_STEP,
    check_trainer_step,
    check_trainer_step_trainer,
    predict_trainer_step,
    trainer_step_config,
)
from entropy_experiments.integrations.trl_step_probe import check_step, predict_step
from entropy_experiments.io_utils import atomic_write
from entropy_experiments.probe.parallel import DistributedError

log = logging.getLogger("entropy_experiments.callback")
PREFIX = "entropy_probe/"
LOG_FILE = "entropy_probe.jsonl"
BATCH_DIR = "entropy_probe"


@dataclass(frozen=True)
class CallbackOptions:
    """Sizes of the callback's probe (small by default: it runs inside training)."""

    every: int = 5              # K: probe the 1st, (1+K)-th, … optimizer step
    B_E: int = 16               # E sequences (prompts drawn with replacement, one response each)
    B_U: int = 4                # U prompts (distinct) ...
    G: int | None = None        # ... × G responses (None: the trainer's num_generations)
    seed: int = 1234            # the probe's sampling seed (+ the step number): never the trainer's streams
    microbatch_size: int = 4    # sequences per backward microbatch
    save_batches: bool = False  # keep each probed step's E and U in OUTPUT_DIR/entropy_probe/step_N/ (offline
                                # re-analysis: `torch.load(..., weights_only=True)`, the run directory's format)
    predict: str = "probe_U"    # probe_U: the step of the probe's own U; trainer_step: the trainer's next step

    def check(self) -> None:
        """ConfigError naming the option unless every size can give an error bar."""
        if not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"{view.KEY}: every must be an integer >= 1, got {self.every!r}")
        if self.predict not in PREDICT_MODES:
            raise ConfigError(f"{view.KEY}: predict must be one of {', '.join(PREDICT_MODES)}, got {self.predict!r}")
        if self.B_E < 4:
            raise ConfigError(f"{view.KEY}: B_E must be >= 4 (the jackknife SE_E needs several E units), "
                              f"got {self.B_E}")
        if self.B_U < 2:
            raise ConfigError(f"{view.KEY}: B_U must be >= 2 (SE_U leaves one U group out), got {self.B_U}")
        if self.G is not None and self.G < 2:
            raise ConfigError(f"{view.KEY}: G must be >= 2 (group advantages), got {self.G}")


def check_option_names(given: dict, extra: tuple[str, ...] = ()) -> None:
    """ConfigError (one line, with the closest valid name) for a keyword no callback option has."""
    valid = [f.name for f in dataclasses.fields(CallbackOptions)] + list(extra)
    for name in given:
        if name not in valid:
            hint = next((v for v in valid if v.lower() == name.lower()), None) or closest_match(name, valid)
            raise ConfigError(f"{view.KEY}: unknown option {name!r}"
                              + (f" (did you mean {hint!r}?)" if hint else f" (valid: {', '.join(valid)})"))


class EntropyProbeCallback(TrainerCallback):
    """Predicts each probed step's entropy change before it and checks it one step later (module docstring)."""

    option_names: tuple[str, ...] = ()  # a subclass's own keywords, named by the unknown-option message

    def __init__(self, trainer: Any, every: int = 5, **options: Any):
        check_option_names(options, self.option_names)
        self.options = CallbackOptions(every=every, **options)
        self.options.check()
        self.trainer_step = self.options.predict == TRAINER_STEP
        (check_trainer_step_trainer if self.trainer_step else view.check_trainer)(trainer)
        self.trainer = trainer
        args = trainer.args
        o = self.options
        self.config = (trainer_step_config(args, B_E=o.B_E, seed=o.seed, microbatch_size=o.microbatch_size)
                       if self.trainer_step else
                       view.probe_config(args, B_E=o.B_E, B_U=o.B_U, G=o.G, seed=o.seed,
                                         microbatch_size=o.microbatch_size))
        self.dist = ranks.current()  # accelerate made the process group with the trainer
        self.config = ranks.per_rank_config(self.config, self.dist)
        self.examples = view.trainer_examples(trainer)
        self.rewards = view.trainer_rewards(trainer)
        bc = self.config.batch_config
        # under DDP one optimizer step averages every rank's batch
        self.u_batch_ratio = bc.B_U * bc.G / (view.trainer_batch(args) * self.dist.world_size)
        self.num_iterations = int(args.num_iterations)
        self.session_start = 0  # the global_step this training session started from (on_train_begin)
        self.rows: list[dict] = []
        self.pending = None
        self.probe_seconds = 0.0
        self.train_start: float | None = None
        self.policy = None

    def step_seed(self, step: int) -> int:
        """The probe's seed at `step` (E draws seed + 1, U seed + 2: steps 1000 apart never share a stream)."""
        return self.options.seed + 1000 * step

    # ------------------------------------------------------------------ trainer events
    def on_train_begin(self, args, state, control, **kwargs):
        self.train_start = time.perf_counter()
        self.session_start = state.global_step
        if self.trainer_step:  # the optimizer exists from here on: the prediction is its step
            check_optimizer(self.trainer.optimizer)
        self.policy = view.live_policy(self.trainer, self.config)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.trainer_step or state.global_step % self.options.every:
            return
        step = state.global_step + 1
        if reuses_rollouts(step, self.num_iterations, self.session_start):
            self._record({"step": step, "skipped": reuse_note(step, self.num_iterations, self.session_start)})
            return
        config = view.step_objective(self.config.model_copy(update={"seed": self.step_seed(step)}), self.trainer)
        t0 = time.perf_counter()
        with untouched(self.policy.trainable.model):
            try:
                self.pending = predict_step(config, self.policy, self.examples, self.rewards, step, self.dist)
            except DistributedError:
                raise
            except ProbeError as exc:  # e.g. an lr of 0 (warm-up): no prediction, training goes on
                self._record({"step": step, "error": str(exc)})
        if self.pending is not None and self.options.save_batches:
            self._save_batches(step, self.pending)
        self.probe_seconds += time.perf_counter() - t0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """trainer_step: after clipping, before `optimizer.step()` — predict the step about to be taken."""
        if not self.trainer_step or state.global_step % self.options.every:
            return
        step = state.global_step + 1
        config = self.config.model_copy(update={"seed": self.step_seed(step)})
        t0 = time.perf_counter()
        with untouched(self.policy.trainable.model):
            try:
                self.pending = predict_trainer_step(config, self.policy, self.examples, step, self.dist)
            except DistributedError:
                raise
            except ProbeError as exc:
                self._record({"step": step, "error": str(exc)})
        self.probe_seconds += time.perf_counter() - t0

    def on_step_end(self, args, state, control, **kwargs):
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        t0 = time.perf_counter()
        with untouched(self.policy.trainable.model):
            row = (check_trainer_step(self.config, self.policy, pending, self.dist) if self.trainer_step else
                   check_step(self.config, self.policy, pending, self.u_batch_ratio, self.dist))
        self.probe_seconds += time.perf_counter() - t0
        self._record(row)
        self._report(row, control)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if not ranks.writes(self.dist):
            return
        total = time.perf_counter() - (self.train_start or time.perf_counter())
        share = self.probe_seconds / total if total > 0 else float("nan")
        probed = sum("realised" in r for r in self.rows)
        skipped = sum("skipped" in r for r in self.rows)
        reuse = f", {skipped} skipped (rollout reuse, num_iterations = {self.num_iterations})" if skipped else ""
        print(f"[entropy probe] {probed} probed step(s){reuse}: {self.probe_seconds:.1f} s of {total:.1f} s "
              f"of training ({100 * share:.1f} %)")

    # ------------------------------------------------------------------ output
    def _save_batches(self, step: int, pending) -> None:
        if not ranks.writes(self.dist):
            return
        folder = Path(self.trainer.args.output_dir) / BATCH_DIR / f"step_{step}"
        for name, batch in (("E_batch.pt", pending.E.to_dict()), ("U_batch.pt", pending.U.to_dict())):
            atomic_write(folder / name, lambda fh, b=batch: torch.save(b, fh), make_parents=True)

    def _record(self, row: dict) -> None:
        """Keep `row` (with the trainer's num_iterations), append it to entropy_probe.jsonl, and say its errors,
        warnings or skip in the log (rank 0; every rank keeps the row)."""
        row = {**row, "num_iterations": self.num_iterations}
        self.rows.append(row)
        if not ranks.writes(self.dist):
            return
        out = Path(self.trainer.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / LOG_FILE, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, allow_nan=True) + "\n")
        if "error" in row:
            log.warning("entropy probe at step %s: %s", row["step"], row["error"])
        if "skipped" in row:
            log.info("entropy probe skips %s", row["skipped"])
        for message in row.get("warnings", []):
            log.warning("entropy probe: %s", message)

    def _report(self, row: dict, control) -> None:
        """The row's finite numbers as one `entropy_probe/…` log entry at the trainer's current step, through
        transformers' `Trainer.log` (log_history, every report_to integration, the console). Two things keep the
        trainer's own logging intact: TRL's `log` override is not called (it would put — and clear — the metrics
        TRL averages until its next log line into this entry), and the control flags are put back (the log event
        clears `should_log`, which would cancel the trainer's own log line of this step)."""
        numbers = {PREFIX + k: float(v) for k, v in row.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step"}
        if not numbers:
            return
        flags = dataclasses.asdict(control)
        Trainer.log(self.trainer, numbers)
        for name, value in flags.items():
            setattr(control, name, value)
