"""Checkpoint layouts, the base model from adapter_config.json, optimizer state saved with torch's
`param_names`, learning-rate provenance and non-finite adapter weights (a checkpoint written by a real
Hugging Face Trainer: tests/test_trainer_checkpoints.py).

References are independent of the code under test: file trees laid out by hand after docs/objectives.md,
`torch.optim.AdamW` built over named parameters (torch saves `param_names`) or with an empty no-decay
group as the Trainer builds it, and tensors written into the adapter file by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from entropy_experiments import checkpoint as cl
from entropy_experiments.checkpoint.adapter import create_lora_model, load_peft_for_probe
from entropy_experiments.checkpoint.optimizer_state import (
    load_adam_optimizer_from_path,
    trainable_named_parameters,
)
from entropy_experiments.errors import CheckpointError, ConfigError, OptimizerStateError
from entropy_experiments.models.embedded import CACHE_ENV_VAR, EMBEDDED_MODEL_NAME, embedded_model_dir


def _touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _adapter(folder: Path, base: str = "Org/base-model") -> Path:
    _touch(folder / "adapter_config.json", json.dumps({"base_model_name_or_path": base, "peft_type": "LORA"}))
    _touch(folder / "adapter_model.safetensors")
    return folder


# ------------------------------------------------------------------------------------------------
# layouts (file trees laid out after docs/user-guide.md "Checkpoints")
# ------------------------------------------------------------------------------------------------

def test_own_layout(tmp_path):
    _adapter(tmp_path / "model")
    for name in ("optimizer.pt", "optimizer_param_names.json", "checkpoint.json"):
        _touch(tmp_path / name)
    files = cl.resolve_checkpoint(str(tmp_path), None, None)
    assert (files.layout, files.adapter_dir, files.optimizer_path) == ("own", tmp_path / "model",
                                                                         tmp_path / "optimizer.pt")
    assert files.param_names_path == tmp_path / "optimizer_param_names.json" and files.position_order == "model"
    assert files.scheduler_path is None and files.trainer_state_path is None
    assert set(files.sources) == {"adapter", "optimizer", "param_names"}


def test_trainer_layout_never_touches_training_args(tmp_path):
    ckpt = _adapter(tmp_path / "checkpoint-2")
    for name in ("optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth", "tokenizer.json"):
        _touch(ckpt / name)
    _touch(ckpt / "training_args.bin", "a pickle that must never be opened")
    files = cl.resolve_checkpoint(str(ckpt), None, None)
    assert (files.layout, files.adapter_dir, files.optimizer_path) == ("trainer", ckpt, ckpt / "optimizer.pt")
    assert (files.scheduler_path, files.trainer_state_path) == (ckpt / "scheduler.pt", ckpt / "trainer_state.json")
    assert files.param_names_path is None and files.position_order == "trainer"
    assert "training_args" not in json.dumps(cl.checkpoint_info(
        files, cl.BaseModelChoice("b", "s"), cl.LearningRate(1e-3, "config")))


def test_adapter_dir_with_optimizer_in_its_parent(tmp_path):
    """The seeds' layout: checkpoint_path = step_40/model, optimizer at step_40/optimizer.pt."""
    adapter = _adapter(tmp_path / "step_40" / "model")
    _touch(tmp_path / "step_40" / "optimizer.pt")
    files = cl.resolve_checkpoint(str(adapter), None, None)
    assert files.layout == "adapter_with_parent_optimizer"
    assert (files.adapter_dir, files.optimizer_path) == (adapter, tmp_path / "step_40" / "optimizer.pt")
    assert "parent" in files.sources["optimizer"] and files.position_order == "model"


def test_explicit_paths_win(tmp_path):
    ckpt = _adapter(tmp_path / "checkpoint-2")
    _touch(ckpt / "optimizer.pt")
    other_adapter = _adapter(tmp_path / "elsewhere" / "adapter")
    other_opt = _touch(tmp_path / "elsewhere" / "opt.pt")
    files = cl.resolve_checkpoint(str(ckpt), str(other_adapter), None)
    assert (files.adapter_dir, files.optimizer_path) == (other_adapter, ckpt / "optimizer.pt")
    assert files.sources["adapter"] == "checkpoint.adapter_path" and files.layout == "trainer"
    files = cl.resolve_checkpoint(str(ckpt), str(other_adapter), str(other_opt))
    assert (files.layout, files.adapter_dir, files.optimizer_path) == ("explicit", other_adapter, other_opt)
    assert files.sources == {"adapter": "checkpoint.adapter_path", "optimizer": "checkpoint.optimizer_path"}
    alone = cl.resolve_checkpoint(None, str(other_adapter), None)  # no checkpoint_path: no optimizer anywhere
    assert alone.layout == "explicit" and alone.optimizer_path is None


def test_adapter_without_any_optimizer(tmp_path):
    adapter = _adapter(tmp_path / "run" / "adapter")
    files = cl.resolve_checkpoint(str(adapter), None, None)
    assert files.layout == "adapter_only" and files.optimizer_path is None
    assert str(adapter / "optimizer.pt") in files.sources["optimizer"]
    assert str(tmp_path / "run" / "optimizer.pt") in files.sources["optimizer"]


def test_missing_or_unrecognised_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=r"^checkpoint directory not found: .*nope$"):
        cl.resolve_checkpoint(str(tmp_path / "nope"), None, None)
    _touch(tmp_path / "empty" / "README.md")
    with pytest.raises(CheckpointError, match=r"^checkpoint .*empty: no adapter found \(no adapter_config\.json"):
        cl.resolve_checkpoint(str(tmp_path / "empty"), None, None)
    with pytest.raises(ConfigError, match=r"^checkpoint\.checkpoint_path \(or checkpoint\.adapter_path\) must be set$"):
        cl.resolve_checkpoint(None, None, None)


def _verl(tmp_path: Path) -> Path:
    step = tmp_path / "global_step_3"
    _adapter(step / "actor" / "lora_adapter")
    for rank in (0, 1):
        _touch(step / "actor" / f"optim_world_size_2_rank_{rank}.pt")
        _touch(step / "actor" / f"model_world_size_2_rank_{rank}.pt")
    return step


@pytest.mark.parametrize("where", ["global_step", "actor", "lora_adapter"])
def test_verl_sharded_state_is_refused(tmp_path, where):
    step = _verl(tmp_path)
    path = {"global_step": step, "actor": step / "actor", "lora_adapter": step / "actor" / "lora_adapter"}[where]
    with pytest.raises(CheckpointError) as info:
        cl.resolve_checkpoint(str(path), None, None)
    message = str(info.value)
    assert message.startswith(str(step / "actor" / "optim_world_size_2_rank_0.pt"))
    assert "verl" in message and "FSDP-sharded" in message and "consolidation" in message


def test_deepspeed_state_is_refused(tmp_path):
    ckpt = _adapter(tmp_path / "checkpoint-5")  # HF Trainer + DeepSpeed: no optimizer.pt, ZeRO shards instead
    _touch(ckpt / "trainer_state.json", "{}")
    _touch(ckpt / "latest", "global_step5")
    shard = _touch(ckpt / "global_step5" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=rf"^{shard}: a DeepSpeed checkpoint .* not loadable without consolidation"):
        cl.resolve_checkpoint(str(ckpt), None, None)
    bare = tmp_path / "openrlhf_ckpt"
    _touch(bare / "latest", "global_step10")
    with pytest.raises(CheckpointError, match=rf"^{bare / 'latest'}: a DeepSpeed checkpoint"):
        cl.resolve_checkpoint(str(bare), None, None)
    adapter = _adapter(tmp_path / "a")
    with pytest.raises(CheckpointError, match=r"optim_world_size_2_rank_1\.pt: a verl checkpoint"):
        cl.resolve_checkpoint(None, str(adapter), str(_touch(tmp_path / "optim_world_size_2_rank_1.pt")))


# ------------------------------------------------------------------------------------------------
# base model
# ------------------------------------------------------------------------------------------------

def test_base_model_defaults_to_the_adapters(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    adapter = _adapter(tmp_path / "a", base="Qwen/Qwen2.5-1.5B")
    choice = cl.resolve_base_model_id(None, adapter)
    assert (choice.name, choice.warning) == ("Qwen/Qwen2.5-1.5B", None)
    assert "adapter_config.json base_model_name_or_path" in choice.source
    assert cl.resolve_base_model_id("Qwen/Qwen2.5-1.5B/", adapter).warning is None
    assert cl.resolve_base_model_id(None, None).name == EMBEDDED_MODEL_NAME  # make-checkpoint, demo
    # The embedded name and the cache directory it is converted to are the same base.
    embedded = _adapter(tmp_path / "e", base=str(embedded_model_dir()))
    embedded_model_dir().mkdir(parents=True)
    assert cl.resolve_base_model_id(EMBEDDED_MODEL_NAME, embedded).warning is None


def test_a_different_explicit_base_model_is_a_warning(tmp_path):
    adapter = _adapter(tmp_path / "a", base="Qwen/Qwen2.5-1.5B")
    choice = cl.resolve_base_model_id("Qwen/Qwen2.5-7B", adapter)
    assert choice.name == "Qwen/Qwen2.5-7B" and choice.source == "checkpoint.base_model"
    assert "'Qwen/Qwen2.5-7B' differs from the adapter's base model 'Qwen/Qwen2.5-1.5B'" in choice.warning
    _touch(tmp_path / "b" / "adapter_config.json", json.dumps({"peft_type": "LORA"}))
    with pytest.raises(CheckpointError, match=r"names no base_model_name_or_path: set checkpoint\.base_model$"):
        cl.resolve_base_model_id(None, tmp_path / "b")


# ------------------------------------------------------------------------------------------------
# learning rate
# ------------------------------------------------------------------------------------------------

def _groups(*lrs, initial=None, empty=()):
    return [{"params": [] if i in empty else [0], "lr": lr, **({"initial_lr": initial} if initial else {})}
            for i, lr in enumerate(lrs)]


def test_learning_rate_provenance():
    assert cl.resolve_learning_rate(3e-6, _groups(0.0, initial=1e-3)) == cl.LearningRate(3e-6, "config", 1e-3)
    saved = cl.resolve_learning_rate(None, _groups(5e-4, 5e-4, initial=1e-3))
    assert saved == cl.LearningRate(5e-4, cl.LR_FROM_OPTIMIZER, 1e-3) and "next step" in saved.source
    assert cl.resolve_learning_rate(None, _groups(5e-4, 0.0, empty=(1,))).value == 5e-4  # an empty group has no say
    with pytest.raises(ConfigError, match=r"^learning_rate: .*different learning rates \[0\.0001, 0\.0002\]"):
        cl.resolve_learning_rate(None, _groups(1e-4, 2e-4))
    with pytest.raises(ConfigError, match=r"^learning_rate: the optimizer's saved lr is 0\.0 \(a schedule that "
                                          r"ended: trainer_state\.json step 7 of max_steps 7\?\) — δH₁ would be "
                                          r"exactly 0; set learning_rate \(initial_lr was 0\.001\)$"):
        cl.resolve_learning_rate(None, _groups(0.0, 0.0, initial=1e-3),
                                 schedule="trainer_state.json step 7 of max_steps 7")
    with pytest.raises(ConfigError, match=r"saved lr is nan, not a positive number"):
        cl.resolve_learning_rate(None, _groups(float("nan")))


# ------------------------------------------------------------------------------------------------
# optimizer state with param_names saved by torch (map by name, prefix-normalised)
# ------------------------------------------------------------------------------------------------

def _lora(tiny_model_dir, seed=0):
    return create_lora_model(str(tiny_model_dir), r=4, alpha=8, device_map="cpu", seed=seed)


def _named_adamw(named, lr=1e-3, steps=2) -> torch.optim.AdamW:
    """torch.optim.AdamW over (name, parameter) pairs after a few steps on random gradients."""
    optimizer = torch.optim.AdamW(named, lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    for _, p in named:
        p.grad = None
    return optimizer


@pytest.mark.parametrize("prefix", ["peft", "inner_model"])
def test_param_names_saved_by_torch_map_by_name(tiny_model_dir, tmp_path, prefix):
    """AdamW over named parameters in REVERSED order, with PeftModel names (`base_model.model.…`) or the
    inner model's names (no prefix): the state follows each name."""
    model = _lora(tiny_model_dir)
    holder = model if prefix == "peft" else model.get_base_model()
    named = [(n, p) for n, p in holder.named_parameters() if p.requires_grad][::-1]
    assert named[0][0].startswith("base_model.model.") == (prefix == "peft")
    reference = _named_adamw(named, lr=2e-3)  # torch saves param_names for named parameters
    saved = reference.state_dict()
    assert saved["param_groups"][0]["param_names"] == [n for n, _ in named]
    torch.save(saved, tmp_path / "optimizer.pt")

    loaded = load_adam_optimizer_from_path(model, tmp_path / "optimizer.pt")
    ref_state = {n: reference.state[p] for n, p in named}
    prefix_of = "" if prefix == "peft" else "base_model.model."
    for name, p in trainable_named_parameters(model):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded.state[p][key], ref_state[name.removeprefix(prefix_of)][key]), (name, key)
    assert loaded.param_groups[0]["lr"] == 2e-3


def test_param_names_that_do_not_match_are_refused(tiny_model_dir, tmp_path):
    model = _lora(tiny_model_dir)
    named = trainable_named_parameters(model)
    saved = _named_adamw(named).state_dict()
    saved["param_groups"][0]["param_names"][2] = "base_model.model.no.such.lora_A.default.weight"
    torch.save(saved, tmp_path / "optimizer.pt")
    with pytest.raises(OptimizerStateError, match=r"1 saved parameter\(s\) are not trainable .*no\.such.*param_names"):
        load_adam_optimizer_from_path(model, tmp_path / "optimizer.pt")


# ------------------------------------------------------------------------------------------------
# non-finite adapter weights
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_non_finite_adapter_weights_are_named(tiny_model_dir, tmp_path, poison):
    from safetensors.torch import load_file, save_file

    model = _lora(tiny_model_dir)
    model.save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = sorted(k for k in tensors if "lora_A" in k)[1]
    tensors[key].view(-1)[[0, 5, 9]] = float(poison)
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointError) as info:
        load_peft_for_probe(str(tiny_model_dir), tmp_path / "adapter", device_map="cpu")
    what = "3 NaN" if poison == "nan" else "3 inf"
    assert str(info.value) == f"adapter {weights}: tensor {key!r} holds {what} values"


def test_empty_no_decay_group(tiny_model_dir, tmp_path):
    """A plain LoRA under the Trainer: every parameter decays, the no-decay group is empty."""
    model = _lora(tiny_model_dir)
    params = [p for _, p in trainable_named_parameters(model)]
    reference = torch.optim.AdamW([{"params": params, "weight_decay": 0.01}, {"params": [], "weight_decay": 0.0}],
                                  lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        reference.step()
    torch.save(reference.state_dict(), tmp_path / "optimizer.pt")
    loaded = load_adam_optimizer_from_path(model, tmp_path / "optimizer.pt", position_order="trainer")
    assert len(loaded.param_groups) == 1 and loaded.param_groups[0]["weight_decay"] == 0.01
    assert all(torch.equal(loaded.state[p]["exp_avg"], reference.state[p]["exp_avg"]) for p in params)
    assert cl.resolve_learning_rate(None, reference.state_dict()["param_groups"]).value == 1e-3
