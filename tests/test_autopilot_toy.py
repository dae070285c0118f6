"""EntropyAutopilot at its defaults in the enumerable world (testing/enumerable_world.py), against exact numbers.

A real trl.GRPOTrainer trains the 4-token toy under a LoRA with the "contains a" reward at lr 2e-2; after every
step the exact entropy and the exact expected reward are enumerated (no probe code). Trainer seed 0:

- uncontrolled, the entropy collapses (rms |H − H₀| over 12 steps 0.54) while the reward climbs +0.45;
- `EntropyAutopilot(trainer, target="initial")` holds it (examples/entropy_autopilot.py over trainer seeds 0–15:
  rms 0.10–0.24 at these defaults; seed 0: rms 0.14 and 0.85× the uncontrolled run's reward gain);
- at lr 2e-4 (no entropy problem) it never acts: m stays 1 and no term is added.

The bounds below sit between the measured spread and the failure they guard against (the autopilot off or
throttling: ratio 1, or a gain near 0).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("trl")

from entropy_experiments.integrations.autopilot import EntropyAutopilot
from entropy_experiments.testing.enumerable_world import world_model, world_trainer

pytestmark = [pytest.mark.xdist_group("trl_callback"), pytest.mark.e2e]


def _run(tmp_path, name, lr=2e-2, pilot=True):
    trainer, meter = world_trainer(world_model(tmp_path / "toy"), tmp_path / name, steps=12, lr=lr, seed=0)
    autopilot = EntropyAutopilot(trainer, target="initial", seed=0) if pilot else None
    if autopilot is not None:
        trainer.add_callback(autopilot)
    trainer.train()
    rows = [r for r in autopilot.rows if "realised" in r] if autopilot else []
    return meter, rows


def _rms(H):
    return math.sqrt(sum((h - H[0]) ** 2 for h in H[1:]) / (len(H) - 1))


def test_the_autopilot_holds_the_exact_entropy_and_the_reward_still_climbs(tmp_path):
    free, _ = _run(tmp_path, "free", pilot=False)
    held, rows = _run(tmp_path, "held")
    print(f"free H {np.round(free.H, 3)} R {np.round(free.R, 3)}\nheld H {np.round(held.H, 3)} R {np.round(held.R, 3)}"
          f"\nm {[round(r['lr_multiplier'], 2) for r in rows]} κ {[round(r['entropy_term'], 2) for r in rows]}")
    assert held.H[0] == free.H[0] and _rms(free.H) > 0.4
    assert _rms(held.H) < 0.4 * _rms(free.H)
    assert held.R[-1] - held.R[0] > 0.5 * (free.R[-1] - free.R[0]) > 0
    assert sum(r["entropy_term"] > 0 for r in rows) >= 4 and all(r["step_ok"] for r in rows)


def test_on_a_quiet_run_the_autopilot_does_nothing(tmp_path):
    meter, rows = _run(tmp_path, "quiet", lr=2e-4)
    assert len(rows) == 12 and _rms(meter.H) < 0.02
    assert np.mean([r["lr_multiplier"] for r in rows]) >= 0.8
    assert all(r["entropy_term"] == 0.0 for r in rows)
    assert all(r["steering"].startswith("within the budget") for r in rows)
