"""precision.runtime_dtype (fp32 | bf16 base), its guards, and estimator.memory_budget_gb.

The bf16 runtime keeps the frozen base in bf16 and the adapter in fp32 (checkpoint/runtime_precision.py); a model
handed in at another precision is refused; ΔH(η) below 1000·lr in bf16 is warned (the threshold comes from
bench/bench_precision.py, README "Scaling"). The memory budget lowers the with-grad microbatch without
changing any result (the sums are the same, only split differently).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from entropy_experiments.checkpoint.runtime_precision import (
    BF16_MIN_ETA_OVER_LR,
    bf16_delta_h_warnings,
    precision_refusal,
    to_runtime_precision,
)
from entropy_experiments.config import config_from_dict
from entropy_experiments.errors import ConfigError, DeviceError
from entropy_experiments.estimators.objective_gradient import Trainable
from entropy_experiments.policy.memory_budget import ModelShape, grad_row_bytes, microbatch_within_budget
from entropy_experiments.probe import recipe
from entropy_experiments.probe.results import Policy
from entropy_experiments.probe.runner import run_probe
from entropy_experiments.testing.tiny_model import add_random_lora, build_tiny_model
from tests.run_helpers import make_run_setup


def _tiny_peft():
    return add_random_lora(build_tiny_model(64, 0))


def test_bf16_runtime_keeps_the_base_in_bf16_and_the_adapter_in_fp32():
    model = to_runtime_precision(_tiny_peft(), "bf16")
    dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
    assert precision_refusal(model, "bf16") is None
    assert "runtime_dtype is fp32" in precision_refusal(model, "fp32")  # base bf16 while fp32 is declared
    to_runtime_precision(model, "fp32")
    assert all(p.dtype == torch.float32 for p in model.parameters()) and precision_refusal(model, "fp32") is None


def test_a_bf16_adapter_is_refused_in_every_mode():
    model = _tiny_peft().to(torch.bfloat16)
    for runtime in ("fp32", "bf16"):
        assert "trainable parameter" in precision_refusal(model, runtime)


@pytest.mark.e2e
def test_a_bf16_model_handed_to_the_probe_is_refused_before_any_work():
    model = _tiny_peft().to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    policy = Policy(engine=None, trainable=Trainable.of(model), optimizer=torch.optim.AdamW(params, lr=1e-5))
    with pytest.raises(ConfigError, match="lora"):
        recipe.run(config_from_dict({}), policy=policy)


def test_bf16_delta_h_warning_names_the_etas_below_the_threshold():
    lr = 1e-5
    [message] = bf16_delta_h_warnings("bf16", [lr, -10 * lr, BF16_MIN_ETA_OVER_LR * lr], lr)
    assert "1e-05, 0.0001" in message and f"{BF16_MIN_ETA_OVER_LR * lr:.3g}" in message
    assert bf16_delta_h_warnings("bf16", [BF16_MIN_ETA_OVER_LR * lr], lr) == []
    assert bf16_delta_h_warnings("fp32", [lr], lr) == []


def test_microbatch_from_budget():
    shape = ModelShape(layers=28, hidden=1536, intermediate=8960, heads=12, vocab=151_936)
    row = grad_row_bytes(shape, positions=640, response_tokens=512)
    assert row > 4 * 3 * 512 * 151_936  # at least the vocabulary-wide logits
    assert microbatch_within_budget(4 * row / 2**30, shape, 640, 512, 8)[0] == 4
    rows, message = microbatch_within_budget(100.0, shape, 640, 512, 4)
    assert rows == 4 and message is None
    with pytest.raises(DeviceError, match="memory_budget_gb"):
        microbatch_within_budget(0.5 * row / 2**30, shape, 640, 512, 4)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model_dir):
    _, config = make_run_setup(tmp_path_factory.mktemp("precision"), tiny_model_dir,
                               estimator={"microbatch_size": 4}, second_order={"enabled": False},
                               predictors={"enabled": False})
    return config


def _run(config: dict, tmp_path, **sections) -> dict:
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
    for section, values in sections.items():
        d[section] = {**d.get(section, {}), **values}
    return run_probe(config_from_dict(d), out=str(tmp_path / "run"))


@pytest.mark.e2e
def test_memory_budget_lowers_the_microbatch_and_keeps_the_result(tiny_run, tmp_path):
    plain = _run(tiny_run, tmp_path / "a")
    shape = ModelShape(layers=2, hidden=64, intermediate=128, heads=4, vocab=384)
    positions = 40  # above any prompt + 8 response tokens of the short prompts
    budget = 1.5 * grad_row_bytes(shape, positions, 8) / 2**30  # one to three sequences per microbatch
    budgeted = _run(tiny_run, tmp_path / "b", estimator={"memory_budget_gb": budget})
    assert any(re.search("microbatch_size lowered from 4 to [123] ", w) for w in budgeted["warnings"])
    assert math.isclose(budgeted["deltaH1"], plain["deltaH1"], rel_tol=1e-5)
    assert math.isclose(budgeted["se"]["total"], plain["se"]["total"], rel_tol=1e-4)


@pytest.mark.e2e
def test_bf16_runtime_end_to_end_records_the_delta_h_warning(tiny_run, tmp_path):
    results = _run(tiny_run, tmp_path, precision={"runtime_dtype": "bf16"})
    assert any("precision.runtime_dtype bf16: ΔH(η)" in w for w in results["warnings"])
    assert math.isfinite(results["deltaH1"]) and math.isfinite(results["se"]["total"])
