"""Checkpoints written by verl 0.9.1 itself (FSDPCheckpointManager, FSDP2, 2 gloo ranks on CPU: the files in
tests/fixtures/framework_checkpoints/verl, made by scripts/make_framework_checkpoints.py in verl's own
environment) load by `checkpoint.checkpoint_path` alone: the gathered moments equal what verl's optimizer held in
memory when it saved, and δH₁'s v rebuilds the AdamW step verl's optimizer then took (1e-6).

The reference is verl's in-memory optimizer (reference.pt beside the checkpoints), never our own writer.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from entropy_experiments.checkpoint.layout import resolve_checkpoint
from entropy_experiments.checkpoint.load import load_for_probe, locate_checkpoint
from entropy_experiments.checkpoint.optimizer_state import trainable_named_parameters
from entropy_experiments.checkpoint.verl_fsdp import read_verl_actor
from entropy_experiments.errors import CheckpointError
from entropy_experiments.estimators.update_direction import (
    adam_state_by_name,
    hyper_by_name,
    update_direction,
)
from entropy_experiments.sweep.discovery import find_checkpoints
from entropy_experiments.testing.tiny_model import build_tiny_model, build_tiny_tokenizer

VERL = Path(__file__).parent / "fixtures" / "framework_checkpoints" / "verl"


@pytest.fixture(scope="module")
def reference():
    return torch.load(VERL / "reference.pt", weights_only=True)


@pytest.fixture(scope="module")
def verl_base(tmp_path_factory) -> Path:
    """The tiny base verl trained on (same architecture; the script builds it with the same call)."""
    path = tmp_path_factory.mktemp("verl_base")
    tokenizer = build_tiny_tokenizer(vocab_size=272)
    build_tiny_model(len(tokenizer), tokenizer.eos_token_id, hidden_size=16, num_layers=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _ck(path: Path, base: Path, **overrides) -> SimpleNamespace:
    values = {"checkpoint_path": str(path), "adapter_path": None, "optimizer_path": None, "base_model": str(base),
              "use_qlora": False, "dtype": "fp32", "device_map": "cpu", "trust_remote_code": False,
              "allow_fresh_optimizer": False}
    return SimpleNamespace(**{**values, **overrides})


@pytest.mark.parametrize("where", ["global_step_2/actor", "global_step_2"])
def test_verl_actor_is_recognised(where):
    files = resolve_checkpoint(str(VERL / where), None, None)
    assert files.layout == "verl_fsdp"
    assert files.adapter_dir == files.optimizer_path == VERL / "global_step_2" / "actor"


@pytest.mark.parametrize("step", [1, 2])
def test_gathered_moments_equal_verls_in_memory_optimizer(reference, step):
    consolidated = read_verl_actor(VERL / f"global_step_{step}" / "actor")
    saved = consolidated.optimizer_state
    names = [n for g in saved["param_groups"] for n in g["param_names"]]
    assert sorted(names) == sorted(reference[step]["names"]) and len(names) == 8
    for index, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved["state"][index][key], reference[step][key][name]), (name, key)
        assert float(saved["state"][index]["step"]) == reference[step]["step"][name] == step
    assert consolidated.lr == pytest.approx(reference[step]["lr"], rel=1e-12)  # the warm-up schedule's next lr
    assert consolidated.lr != saved["param_groups"][0]["initial_lr"]
    assert consolidated.lora_settings["lora_alpha"] == 8 and consolidated.lora_settings["r"] == 4


@pytest.mark.parametrize("step", [1, 2])
def test_probe_load_rebuilds_verls_next_adamw_step(reference, verl_base, step, caplog):
    ck = _ck(VERL / f"global_step_{step}", verl_base)
    with caplog.at_level(logging.INFO, logger="entropy_experiments"):
        loaded = load_for_probe(ck, None)
    assert "FSDP2 DTensors gathered" in caplog.text and "lr_scheduler _last_lr" in caplog.text
    ref = reference[step]
    named = dict(trainable_named_parameters(loaded.model))
    assert sorted(named) == sorted(ref["names"])
    for name, p in named.items():
        assert torch.equal(p.detach(), ref["weights"][name]), name
    assert loaded.learning_rate.value == pytest.approx(ref["next_lr"], rel=1e-12)
    assert "lr_scheduler _last_lr" in loaded.learning_rate.source
    assert loaded.info["tokenizer"]["source"] == "checkpoint"

    names = list(named)
    params = {n: p.detach() for n, p in named.items()}
    v = update_direction("adamw_step", params, ref["next_grad"], adam_state_by_name(loaded.optimizer, names),
                         hyper_by_name(loaded.optimizer, names), max_grad_norm=None)
    for name in names:
        # θ + lr·v against verl's stepped θ (θ + Δθ: Δθ was taken as the difference of two fp32 θ, so it
        # carries θ's rounding, ~1e-5 of Δθ; the stepped θ itself is exact to float precision): within 4 ulps
        # of the larger |θ| (measured ≤ 1.45 on the AVX2, AVX-512 and scalar kernel sets; a relative tolerance on
        # θ + Δθ alone failed where the step brings an entry near 0). Weight decay left out breaks it (traps.py).
        theta, delta = params[name], ref["next_delta"][name]
        ulps = 4 * torch.finfo(torch.float32).eps * torch.maximum(theta.abs(), (theta + delta).abs())
        assert ((theta + loaded.learning_rate.value * v[name]) - (theta + delta)).abs().le(ulps).all(), name
        assert torch.allclose(loaded.learning_rate.value * v[name], delta, rtol=0, atol=4e-7)  # a few ulps of θ


def test_verl_checkpoint_needs_a_base_model(verl_base):
    with pytest.raises(CheckpointError, match=r"verl_fsdp checkpoint does not name its base model; set "
                                              r"checkpoint\.base_model"):
        locate_checkpoint(_ck(VERL / "global_step_1", verl_base, base_model=None))


def test_fsdp1_actor_is_refused_with_the_merge_command(tmp_path):
    actor = tmp_path / "global_step_3" / "actor"
    actor.mkdir(parents=True)
    (actor / "fsdp_config.json").write_text('{"FSDP_version": 1, "world_size": 2}')
    (actor / "optim_world_size_2_rank_0.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"FSDP1 checkpoint .* verl\.model_merger merge"):
        read_verl_actor(actor)


def test_sweep_finds_the_verl_global_steps():
    found = find_checkpoints(VERL)
    assert [(c.name, c.step, c.files.layout) for c in found] == [("global_step_1", 1, "verl_fsdp"),
                                                                  ("global_step_2", 2, "verl_fsdp")]


def test_deepspeed_state_stays_refused_naming_the_universal_converter(tmp_path):
    """DeepSpeed 0.19.8's own save could not be run on this CPU (see docs/checkpoints-verl-deepspeed.md), so no
    DeepSpeed layout is read: the refusal names the command that writes per-parameter moments."""
    step = tmp_path / "global_step2"
    step.mkdir()
    (step / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"a DeepSpeed checkpoint .* deepspeed\.checkpoint\.ds_to_universal"):
        resolve_checkpoint(str(tmp_path), None, None)


@pytest.mark.e2e
def test_entropy_probe_run_on_a_verl_checkpoint_by_path(reference, verl_base, tmp_path, monkeypatch):
    """`entropy-probe run` with checkpoint_path at verl's global_step_N/actor: every phase runs on the gathered
    adapter and AdamW state, results.json records the layout, verl's scheduler lr and where each file came from."""
    import json

    import yaml

    from entropy_experiments import cli
    from tests.independent_checks import lr_times_snis_slope
    from tests.probe_helpers import SHORT_PROMPTS, write_prompts
    from tests.run_helpers import base_config, logging_restored

    config = base_config(verl_base, write_prompts(tmp_path / "prompts.jsonl", SHORT_PROMPTS),
                         checkpoint={"checkpoint_path": str(VERL / "global_step_2" / "actor")},
                         objective={"trainer": "verl"})
    (tmp_path / "probe.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    with logging_restored():
        assert cli.main(["run", "--config", "probe.yaml", "--out", "run"]) == 0
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["checkpoint"]["layout"] == "verl_fsdp", res["checkpoint"]
    assert res["learning_rate"] == pytest.approx(reference[2]["next_lr"], rel=1e-12)
    assert res["deltaH1"] == pytest.approx(lr_times_snis_slope(res), abs=4 * res["se"]["E"])
    assert all(row["deltaH_true"] is not None for row in res["true"])
