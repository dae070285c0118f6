"""CUDA-only checks (docs/scaling.md, 'On a GPU'): they skip without a GPU and run
as they are on a GPU host: `pytest -q tests/test_cuda.py`.

* every tensor the probe creates lives on the model's device: the whole tiny probe on CUDA, on the CPU run's
  own E and U batches, gives the CPU run's δH₁, SE and ΔH (both E paths: backward hooks and the surrogate
  backward after scoring);
* the bf16 base (precision.runtime_dtype bf16) on CUDA: base weights bf16, adapter fp32, finite results;
* a real CUDA out-of-memory error is recognised and its memory given back.
"""

from __future__ import annotations

import math

import pytest
import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.policy.oom import oom_reason, release_memory, unless_out_of_memory
from entropy_experiments.probe import recipe as probe
from tests.run_helpers import make_run_setup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory, tiny_model_dir):
    _, config = make_run_setup(tmp_path_factory.mktemp("cuda"), tiny_model_dir, estimator={"microbatch_size": 4},
                               second_order={"enabled": True}, predictors={"enabled": True})
    return config


def _config(base: dict, **sections):
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for section, values in sections.items():
        d[section] = {**d.get(section, {}), **values}
    return config_from_dict(d)


def _close(a: float, b: float, rel: float = 1e-4) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


@pytest.mark.parametrize("variance", [True, False], ids=["backward_hooks", "surrogate_backward"])
def test_probe_on_cuda_matches_cpu_on_the_same_batches(tiny_config, variance):
    batches = {}
    cpu = probe.run(_config(tiny_config, variance={"enabled": variance}),
                    on_batches=lambda E, U: batches.update(E=E, U=U)).results
    cuda = probe.run(_config(tiny_config, variance={"enabled": variance}, checkpoint={"device_map": "cuda"}),
                     batches=(batches["E"], batches["U"])).results
    assert cuda["environment"] and _close(cuda["deltaH1"], cpu["deltaH1"])
    for key in ("E", "U", "total"):
        assert _close(cuda["se"][key], cpu["se"][key], 1e-3) or not math.isfinite(cpu["se"][key])
    for a, b in zip(cpu["true"], cuda["true"]):
        assert a["eta"] == b["eta"] and _close(a["deltaH_true"], b["deltaH_true"], 1e-3)


def test_bf16_base_on_cuda(tiny_config):
    outcome = probe.run(_config(tiny_config, checkpoint={"device_map": "cuda"}, precision={"runtime_dtype": "bf16"}))
    model = outcome.policy.trainable.model
    assert {(p.requires_grad, p.dtype) for p in model.parameters()} == {(True, torch.float32),
                                                                          (False, torch.bfloat16)}
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert math.isfinite(outcome.results["deltaH1"]) and math.isfinite(outcome.results["se"]["total"])


def test_a_real_cuda_out_of_memory_is_recognised_and_released():
    release_memory()
    before = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory

    def too_big():
        keep = torch.empty(total // 4, dtype=torch.uint8, device="cuda")  # noqa: F841 (held while the next fails)
        return torch.empty(2 * total, dtype=torch.uint8, device="cuda")

    result, reason = unless_out_of_memory(too_big)
    assert result is None and reason is not None
    release_memory()
    assert torch.cuda.memory_allocated() == before
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    except Exception as exc:  # noqa: BLE001 (whatever type this torch raises, oom_reason must know it)
        assert oom_reason(exc) is not None
