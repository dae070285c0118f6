"""EntropyAutopilot holds a toy run's EXACT entropy at a constant target where the same run uncontrolled drifts.

A real trl.GRPOTrainer trains a LoRA on the enumerable 4-token toy model (testing/tiny_model.py: every response
of every prompt can be listed) with the "count the a's" reward at lr 2e-2, 4 prompts × 4 completions per step.
The yardstick is independent of the probe: after every step the exact per-token entropy over the prompt pool by
enumeration (tests/sweep_helpers.py `exact_entropy`, float64, no probe code). Two arms, same seed:

- uncontrolled: the exact entropy falls from 0.622 to 0.317 in 10 steps (drift 0.305 nats/token);
- EntropyAutopilot(target = the exact initial entropy, B_E = 128, min_multiplier 0.01, max_rate 3).

Tolerance 0.05 nats/token, chosen once by hand (2026-11-26, this file's settings): over trainer seeds 0 and 1 ×
probe seeds 0–9 (20 controlled runs) the largest |H − target| over the 10 steps was 0.021 (0.008–0.012 at seed 0), while
the uncontrolled runs drifted 0.305 (seed 0) and 0.201 (seed 1). The test runs trainer seed 0 and asserts
a drift of at least 4 × the tolerance for the uncontrolled arm. The lr knob can only slow a fall (it holds
the entropy by shrinking the lr: the multiplier's range is printed), so the controlled arm reaches the target
mostly from above and stays there.
"""

from __future__ import annotations

import pytest
from transformers import TrainerCallback

pytest.importorskip("trl")

from entropy_experiments.testing.tiny_model import build_toy_enumerable_dir
from entropy_experiments.testing.trl_run import cpu_grpo_trainer
from tests.sweep_helpers import MAX_NEW, TOY_PROMPTS, exact_entropy

pytestmark = pytest.mark.xdist_group("trl_callback")
STEPS, LR, TOLERANCE = 10, 2e-2, 0.05


def count_a(prompts, completions, **kwargs) -> list[float]:
    """TRL's reward convention: the number of 'a' tokens in each completion."""
    return [float(c.count("a")) for c in completions]


class ExactEntropy(TrainerCallback):
    """The policy's exact entropy before training and after every optimizer step (enumeration)."""

    def __init__(self, trainer):
        self.trainer, self.H = trainer, []

    def _measure(self):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.H.append(exact_entropy(model, self.trainer.processing_class))

    def on_train_begin(self, args, state, control, **kwargs):
        self._measure()

    def on_step_end(self, args, state, control, **kwargs):
        self._measure()


def _run(out, toy, pilot_options=None, steps=STEPS):
    from datasets import Dataset

    from entropy_experiments.integrations.autopilot import EntropyAutopilot

    trainer = cpu_grpo_trainer(toy, out, reward_funcs=count_a, train_dataset=Dataset.from_dict({"prompt": TOY_PROMPTS * 8}),
                               steps=steps, learning_rate=LR, num_generations=4, prompts_per_step=4,
                               max_completion_length=MAX_NEW, seed=0, lora_r=4, lora_alpha=8,
                               lora_targets=("q_proj", "v_proj"), save_strategy="no", gradient_checkpointing=False)
    meter = ExactEntropy(trainer)
    trainer.add_callback(meter)
    pilot = None
    if pilot_options is not None:
        pilot = EntropyAutopilot(trainer, **pilot_options)
        trainer.add_callback(pilot)
    trainer.train()
    return meter.H, pilot


@pytest.mark.e2e
def test_the_autopilot_holds_the_exact_entropy_where_the_uncontrolled_run_drifts(tmp_path):
    toy = build_toy_enumerable_dir(tmp_path / "toy", seed=0)
    free, _ = _run(tmp_path / "free", toy)
    target = free[0]
    held, pilot = _run(tmp_path / "held", toy, {"target": target, "B_E": 128, "seed": 3, "min_multiplier": 0.01,
                                               "max_rate": 3.0})
    drift = max(abs(h - target) for h in free)
    deviation = max(abs(h - target) for h in held)
    multipliers = [r["lr_multiplier"] for r in pilot.rows if "lr_multiplier" in r]
    print(f"target {target:.4f}; uncontrolled {' '.join(f'{h:.3f}' for h in free)} (drift {drift:.3f}); "
          f"controlled {' '.join(f'{h:.3f}' for h in held)} (max deviation {deviation:.3f}); "
          f"m {min(multipliers):.2f}–{max(multipliers):.2f}")
    assert held[0] == target and len(held) == len(free) == STEPS + 1
    assert len(multipliers) == STEPS
    assert drift > 4 * TOLERANCE
    assert deviation < TOLERANCE


RISE, START = 0.15, 0.6217  # START: the toy's exact entropy before training (seed 0), checked below


@pytest.mark.e2e
def test_the_entropy_push_raises_the_exact_entropy_toward_a_target_above_it(tmp_path):
    """Target 0.15 above the start. The lr knob alone cannot raise the entropy (the step lowers it, m only slows
    that); with max_push the entropy-gradient term raises it. By hand (2026-11-26, 8 steps, trainer seeds 0, 1 ×
    probe seeds 0–3): with the push the exact entropy rose by 0.082–0.150 after 8 steps (0.064–0.105 after 6),
    without it it ended 0.029–0.045 BELOW the start."""
    toy = build_toy_enumerable_dir(tmp_path / "toy", seed=0)
    options = {"B_E": 128, "seed": 3, "min_multiplier": 0.01, "max_rate": 3.0, "max_multiplier": 1.0}
    lr_only, _ = _run(tmp_path / "lr_only", toy, {"target": START + RISE, **options}, steps=6)
    pushed, pilot = _run(tmp_path / "pushed", toy, {"target": START + RISE, "max_push": 10.0, **options}, steps=6)
    start = pushed[0]
    rows = [r for r in pilot.rows if "realised" in r]
    print(f"start {start:.4f}, target {start + RISE:.4f}; lr only {' '.join(f'{h:.3f}' for h in lr_only)}; "
          f"pushed {' '.join(f'{h:.3f}' for h in pushed)}; κ {[r.get('entropy_push') for r in rows]}")
    assert start == pytest.approx(START, abs=5e-5) and lr_only[0] == start
    assert max(lr_only) < start + 0.04 and lr_only[-1] < start
    assert sum("entropy_push" in r for r in rows) >= 4 and all(r["step_error"] < 1e-6 for r in rows)
    assert pushed[-1] > start + 0.04 and pushed[-1] < start + RISE + 0.05
