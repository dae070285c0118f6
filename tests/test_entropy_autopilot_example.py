"""examples/entropy_autopilot.py: its core runs (a 3-step smoke of the autopilot arm and TRL's adaptive arm) and its
yardstick is the exact entropy (checked against torch's Categorical on the untouched base model)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "entropy_autopilot.py"


def _example():
    spec = importlib.util.spec_from_file_location("entropy_autopilot_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e
def test_the_example_arms_run_and_the_yardstick_is_exact(tmp_path):
    pytest.importorskip("trl")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from entropy_experiments.testing.tiny_model import build_tiny_model_dir
    from entropy_experiments.testing.trl_run import PROMPTS
    ex = _example()
    args = ex.parse_args(["--steps", "3", "--B-E", "8", "--target", "3.2"])
    model_dir = build_tiny_model_dir(tmp_path / "tiny", seed=0)
    pilot = ex.run_arm("autopilot", tmp_path / "pilot", model_dir, args, 0, autopilot={})
    trl = ex.run_arm("trl", tmp_path / "trl", model_dir, args, 0, trl_delta=ex.TRL_DEFAULT_DELTA)

    # the yardstick before training: the base model's next-token entropy (the LoRA starts at zero)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        reference = sum(float(torch.distributions.Categorical(
            logits=base(input_ids=tokenizer(p, return_tensors="pt").input_ids).logits[0, -1]).entropy())
            for p in PROMPTS) / len(PROMPTS)
    for run in (pilot, trl):
        assert len(run["H"]) == 4 and all(math.isfinite(h) for h in run["H"])
        assert run["H"][0] == pytest.approx(reference, rel=1e-5)
        assert len(run["reward"]) == 3 and len(run["trl_entropy"]) == 3
        assert all(math.isfinite(e) for e in run["trl_entropy"])
    assert len(pilot["multipliers"]) == 3 and all(0.1 <= m <= 2.0 for m in pilot["multipliers"])
    assert trl["multipliers"] == []
    rms, worst = ex.deviations(pilot, 3.2)
    assert 0 <= rms <= worst
    assert "| autopilot |" in ex.table([pilot, trl], 3.2)
