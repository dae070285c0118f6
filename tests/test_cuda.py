"""CUDA-only checks (docs/scaling.md, 'On a GPU'): they skip without a GPU and run
as they are on a GPU host: `pytest -q tests/test_cuda.py`.

* every tensor the probe creates lives on the model's device: the whole tiny probe on CUDA, on the CPU run's
  own E and U batches, gives the CPU run's δH₁, SE and ΔH (both E paths: backward hooks and the surrogate
  backward after scoring), and every later phase: the second order by both methods, every predictor, the
  displacement predictor. Tolerances follow from fp32 rounding (tests/device_comparison.py: ΔH within
  z·√2·F of the rounding floor F of E, measured as fp32 − fp64 on the CPU, docs/maths.md §8); the same
  comparison runs between two CPU reduction orders in tests/test_device_comparison.py;
* a sweep step: E scored at the next checkpoint's adapter (the realised change's cross-scores) gives the CPU's
  log-weights within the rounding of the two scorings;
* the bf16 base (precision.runtime_dtype bf16) on CUDA: base weights bf16, adapter fp32, finite results;
* a real CUDA out-of-memory error is recognised and its memory given back.
"""

from __future__ import annotations

import math

import pytest
import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.estimators.sequence_scores import log_weights, score_sequences
from entropy_experiments.make_checkpoint.trained import make_checkpoint
from entropy_experiments.policy.oom import oom_reason, release_memory, unless_out_of_memory
from entropy_experiments.probe import recipe
from entropy_experiments.probe.results import WarningLog
from tests.device_comparison import differences, rounding_floor, token_rounding
from tests.run_helpers import make_run_setup

SWEEP_DEVICES = ("cpu", "cuda")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory, tiny_model_dir):
    """The tiny probe with every phase on: second order, the predictors and the displacement to a checkpoint
    trained two steps from the same seed (predictors.next_checkpoint)."""
    folder = tmp_path_factory.mktemp("cuda")
    _, config = make_run_setup(folder, tiny_model_dir, estimator={"microbatch_size": 4},
                               second_order={"enabled": True}, predictors={"enabled": True})
    make_checkpoint(folder / "next", config_from_dict(config), steps=2)
    config["predictors"]["next_checkpoint"] = str(folder / "next")
    return config


def _config(base: dict, **sections):
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for section, values in sections.items():
        d[section] = {**d.get(section, {}), **values}
    return config_from_dict(d)


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["jvp", "finite_difference"])
@pytest.mark.parametrize("variance", [True, False], ids=["backward_hooks", "surrogate_backward"])
def test_probe_on_cuda_matches_cpu_on_the_same_batches(tiny_config, variance, method):
    sections = {"variance": {"enabled": variance}, "second_order": {"method": method}}
    batches = {}
    cpu = recipe.run(_config(tiny_config, **sections), on_batches=lambda E, U: batches.update(E=E, U=U))
    cuda = recipe.run(_config(tiny_config, checkpoint={"device_map": "cuda"}, **sections),
                     batches=(batches["E"], batches["U"])).results
    floor = rounding_floor(cpu.policy, batches["E"], _config(tiny_config))
    assert cuda["environment"] and cuda["second_order"]["method"] == method
    assert "displacement" in cuda["predictors"] and "direct_only" in cuda["predictors"]
    assert differences(cpu.results, cuda, floor) == []


@pytest.mark.e2e
def test_sweep_step_cross_scores_on_cuda_match_cpu(tiny_config):
    """The sweep's realised change scores E_N at θ_{N+1} (the adapter of the next checkpoint): log w_i and h'_i
    on CUDA equal the CPU's within the rounding of two scorings per device: SDs 2·σ_ℓ·√T_i and √2·σ_H·√T_i
    (σ: the per-token fp32 − fp64 rounding on the CPU), z = 4."""
    nxt = tiny_config["predictors"]["next_checkpoint"]
    batches, scored, policies = {}, {}, {}
    recipe.run(_config(tiny_config, second_order={"enabled": False}, predictors={"enabled": False,
                                                                                 "next_checkpoint": None}),
              on_batches=lambda E, U: batches.update(E=E, U=U))
    for device in SWEEP_DEVICES:
        own_config = _config(tiny_config, checkpoint={"device_map": device})
        next_config = _config(tiny_config, checkpoint={"device_map": device, "checkpoint_path": nxt})
        own, other = (recipe.load_phase(c, recipe.process_context(c), WarningLog()) for c in (own_config, next_config))
        s_own, s_other = (score_sequences(p.engine, batches["E"]) for p in (own, other))
        scored[device], policies[device] = (log_weights(s_other, s_own), s_other.seq_entropies, s_own.lengths), own
    var_h, var_l, _ = token_rounding(policies[SWEEP_DEVICES[0]], batches["E"], _config(tiny_config))
    (lw_a, h_a, T), (lw_b, h_b, _) = (scored[d] for d in SWEEP_DEVICES)
    root_T = T.sqrt().numpy()
    assert (abs(lw_b - lw_a) <= 4 * 2 * math.sqrt(var_l) * root_T + 1e-12).all()
    assert (abs(h_b - h_a).numpy() <= 4 * math.sqrt(2 * var_h) * root_T + 1e-12).all()


@pytest.mark.e2e
def test_bf16_base_on_cuda(tiny_config):
    outcome = recipe.run(_config(tiny_config, checkpoint={"device_map": "cuda"}, precision={"runtime_dtype": "bf16"}))
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
