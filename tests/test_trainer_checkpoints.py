"""A checkpoint written by a REAL `transformers.Trainer` (LoRA + norms in modules_to_save, linear schedule,
weight decay): its optimizer state loads in the Trainer's order (decay group, then no-decay), its saved lr
is the next step's (0.0 at the end of the schedule, refused before sampling), and a run records the
checkpoint's layout, files, base model and lr source in results.json.

The reference for which saved id is which parameter is the Trainer's own in-memory optimizer.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from entropy_experiments import checkpoint as cl
from entropy_experiments.checkpoint.adapter import load_peft_for_probe
from entropy_experiments.checkpoint.optimizer_state import (
    load_adam_optimizer_from_path,
    trainable_named_parameters,
)
from entropy_experiments.errors import CheckpointError, ConfigError, OptimizerStateError
from tests.probe_helpers import SHORT_PROMPTS, write_prompts
from tests.run_helpers import base_config, logging_restored

pytestmark = pytest.mark.e2e  # runs whole probes (scripts/test.sh -m "not e2e" skips them)

# ------------------------------------------------------------------------------------------------
# a checkpoint written by a real transformers.Trainer
# ------------------------------------------------------------------------------------------------

def _run_trainer(base_dir: Path, out: Path, modules_to_save) -> list[str]:
    """Two Trainer steps (linear schedule, lr 1e-3, weight decay 0.01) saving checkpoint-1 and -2; returns
    the parameter names of the saved optimizer ids 0..N-1 (from the Trainer's own optimizer)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            modules_to_save=modules_to_save, task_type="CAUSAL_LM"))
    rows = [tokenizer(t, max_length=16, truncation=True, padding="max_length")["input_ids"] for t in SHORT_PROMPTS]
    data = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r), "attention_mask": torch.ones(len(r), dtype=torch.long)}
            for r in rows]
    args = TrainingArguments(output_dir=str(out), max_steps=2, save_steps=1, use_cpu=True, report_to=[],
                             per_device_train_batch_size=2, learning_rate=1e-3, lr_scheduler_type="linear",
                             weight_decay=0.01, optim="adamw_torch_fused", disable_tqdm=True,
                             logging_strategy="no", seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    with torch.random.fork_rng():
        trainer.train()
    names_of = {id(p): n for n, p in model.named_parameters()}
    return [names_of[id(p)] for group in trainer.optimizer.param_groups for p in group["params"]]


@pytest.fixture(scope="module")
def trainer_ckpt(tiny_model_dir, tmp_path_factory):
    """(output dir, saved-id names): LoRA on q/v plus the norms as modules_to_save, so that the
    no-decay norms interleave with the decay LoRA weights in named_parameters() order."""
    out = tmp_path_factory.mktemp("hf_trainer")
    return out, _run_trainer(tiny_model_dir, out, modules_to_save=["norm"])


def test_trainer_checkpoint_has_two_groups_and_lr_zero_at_the_end(trainer_ckpt):
    out, saved_names = trainer_ckpt
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "checkpoint-2"]
    saved = torch.load(out / "checkpoint-2" / "optimizer.pt", weights_only=True)
    groups = saved["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and all(g["fused"] for g in groups)
    assert all("norm" not in n for n in saved_names[:len(groups[0]["params"])])
    assert all("norm" in n for n in saved_names[len(groups[0]["params"]):]) and len(groups[1]["params"]) == 5
    assert [g["lr"] for g in groups] == [0.0, 0.0] and [g["initial_lr"] for g in groups] == [1e-3, 1e-3]


def test_trainer_state_loads_in_trainer_order(trainer_ckpt, tiny_model_dir, caplog):
    out, saved_names = trainer_ckpt
    ckpt = out / "checkpoint-2"
    files = cl.resolve_checkpoint(str(ckpt), None, None)
    assert files.layout == "trainer" and files.position_order == "trainer"
    model = load_peft_for_probe(str(tiny_model_dir), files.adapter_dir, device_map="cpu")
    with caplog.at_level(logging.INFO, logger="entropy_experiments"):
        loaded = load_adam_optimizer_from_path(model, files.optimizer_path, position_order=files.position_order)
    assert "mapped by position (Trainer order: decay then no-decay)" in caplog.text

    saved = torch.load(files.optimizer_path, weights_only=True)
    state_of = {name: saved["state"][i] for i, name in enumerate(saved_names)}
    named = trainable_named_parameters(model)
    assert sorted(n for n, _ in named) == sorted(saved_names)
    for name, p in named:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded.state[p][key], state_of[name][key]), (name, key)
        group = next(g for g in loaded.param_groups if any(q is p for q in g["params"]))
        assert group["weight_decay"] == (0.0 if "norm" in name else 0.01), name
        assert group["fused"] is True and group["initial_lr"] == 1e-3
    assert [id(p) for g in loaded.param_groups for p in g["params"]] == [id(p) for _, p in named]
    with pytest.raises(OptimizerStateError, match=r"mapped by position \(model order\).* shape"):
        load_adam_optimizer_from_path(model, files.optimizer_path, position_order="model")

    stepped = copy.deepcopy(loaded)  # fused=True steps on CPU (torch 2.13)
    for group in stepped.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    stepped.step()


def test_trainer_lr_provenance(trainer_ckpt, tiny_model_dir):
    out, _ = trainer_ckpt
    for step, lr in ((1, 5e-4), (2, 0.0)):
        files = cl.resolve_checkpoint(str(out / f"checkpoint-{step}"), None, None)
        groups = torch.load(files.optimizer_path, weights_only=True)["param_groups"]
        hint = cl.schedule_hint(files.trainer_state_path)
        assert hint == f"trainer_state.json step {step} of max_steps 2"
        if lr:
            assert cl.resolve_learning_rate(None, groups, schedule=hint) == \
                cl.LearningRate(lr, cl.LR_FROM_OPTIMIZER, 1e-3)
        else:
            with pytest.raises(ConfigError, match=r"saved lr is 0\.0 \(a schedule that ended: trainer_state\.json "
                                                  r"step 2 of max_steps 2\?\).*initial_lr was 0\.001"):
                cl.resolve_learning_rate(None, groups, schedule=hint)


def test_fused_flag_dropped_where_torch_refuses_it(trainer_ckpt, tiny_model_dir, monkeypatch, caplog):
    out, _ = trainer_ckpt

    class NoFusedAdamW(torch.optim.AdamW):
        def __init__(self, params, *args, fused=None, **kwargs):
            if fused:
                raise RuntimeError("`fused=True` requires all the params to be of supported devices (test)")
            super().__init__(params, *args, fused=fused, **kwargs)

    model = load_peft_for_probe(str(tiny_model_dir), out / "checkpoint-1", device_map="cpu")
    monkeypatch.setattr(torch.optim, "AdamW", NoFusedAdamW)
    with caplog.at_level(logging.INFO, logger="entropy_experiments"):
        loaded = load_adam_optimizer_from_path(model, out / "checkpoint-1" / "optimizer.pt", position_order="trainer")
    assert all(g["fused"] is False for g in loaded.param_groups)
    assert "was saved with fused=True, which torch" in caplog.text


# ------------------------------------------------------------------------------------------------
# through the CLI: lr 0 fails before sampling; a Trainer checkpoint runs and results.json says how
# ------------------------------------------------------------------------------------------------

def _cli(argv: list[str]) -> tuple[int, str]:
    from entropy_experiments import cli

    err = io.StringIO()
    with logging_restored(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    return code, err.getvalue()


def test_cli_refuses_a_learning_rate_of_zero_before_sampling(trainer_ckpt, tiny_model_dir, tmp_path):
    out, _ = trainer_ckpt
    data = write_prompts(tmp_path / "prompts.jsonl", SHORT_PROMPTS)
    config = base_config(tiny_model_dir, data, checkpoint={"checkpoint_path": str(out / "checkpoint-2")})
    del config["checkpoint"]["base_model"]  # from adapter_config.json
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    code, err = _cli(["run", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run")])
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err[-2000:]
    assert errors[0].startswith("error: learning_rate: the optimizer's saved lr is 0.0")
    assert "step 2 of max_steps 2" in errors[0] and "Traceback" not in err
    assert "Phase 0" not in err and not (tmp_path / "run" / "E_batch.pt").exists()


def test_cli_runs_a_trainer_checkpoint_and_records_it(trainer_ckpt, tiny_model_dir, tmp_path):
    out, _ = trainer_ckpt
    copy_of_base = Path(shutil.copytree(tiny_model_dir, tmp_path / "same_weights_elsewhere"))
    data = write_prompts(tmp_path / "prompts.jsonl", SHORT_PROMPTS)
    config = base_config(tiny_model_dir, data, checkpoint={"checkpoint_path": str(out / "checkpoint-2"),
                                                           "base_model": str(copy_of_base)},
                         learning_rate=1e-3, importance={"enabled": False})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    code, err = _cli(["run", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run")])
    assert code == 0, err[-3000:]
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    info = res["checkpoint"]
    assert info["layout"] == "trainer" and info["files"]["adapter"] == str(out / "checkpoint-2")
    assert info["files"]["trainer_state"] == str(out / "checkpoint-2" / "trainer_state.json")
    assert (info["base_model"], info["base_model_source"]) == (str(copy_of_base), "checkpoint.base_model")
    assert (info["learning_rate_source"], info["initial_lr"], res["learning_rate"]) == ("config", 1e-3, 1e-3)
    assert any("differs from the adapter's base model" in w for w in res["warnings"])
    assert "checkpoint layout: trainer" in err and "mapped by position (Trainer order" in err


def test_probe_load_of_an_adapter_without_optimizer(trainer_ckpt, tiny_model_dir, tmp_path):
    """base_model null → the adapter's; no optimizer.pt anywhere → the error names where it looked, or
    (allow_fresh_optimizer) a FRESH OPTIMIZER warning and an lr source that says so."""
    from entropy_experiments.config import config_from_dict
    from tests.probe_helpers import load_probe

    out, _ = trainer_ckpt
    adapter = tmp_path / "run" / "adapter"
    adapter.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(out / "checkpoint-1" / name, adapter / name)
    config = base_config(tiny_model_dir, write_prompts(tmp_path / "p.jsonl", SHORT_PROMPTS),
                         checkpoint={"checkpoint_path": str(adapter)})
    del config["checkpoint"]["base_model"]
    with pytest.raises(OptimizerStateError, match=rf"^optimizer state file not found: looked for {adapter}/optimizer"
                                                  r"\.pt and .*run/optimizer\.pt; set checkpoint\.optimizer_path$"):
        load_probe(config_from_dict(config))
    config["checkpoint"]["allow_fresh_optimizer"] = True
    probe, warnings = load_probe(config_from_dict(config))
    info = probe.policy.checkpoint_info
    assert (info["layout"], info["base_model"]) == ("adapter_only", str(tiny_model_dir))
    assert info["base_model_source"] == f"{adapter / 'adapter_config.json'} base_model_name_or_path"
    assert info["learning_rate_source"].startswith("the fresh optimizer's default")
    assert any(w.startswith("FRESH OPTIMIZER: optimizer state file not found: looked for") for w in warnings)


def test_trainer_groups_that_do_not_fit_the_decay_split(trainer_ckpt, tiny_model_dir, tmp_path):
    out, _ = trainer_ckpt
    saved = torch.load(out / "checkpoint-1" / "optimizer.pt", weights_only=True)
    merged = {**saved["param_groups"][0], "params": [i for g in saved["param_groups"] for i in g["params"]]}
    torch.save({"state": saved["state"], "param_groups": [merged]}, tmp_path / "optimizer.pt")
    model = load_peft_for_probe(str(tiny_model_dir), out / "checkpoint-1", device_map="cpu")
    with pytest.raises(OptimizerStateError, match=r"saved param groups have sizes \[13\], but a Hugging Face "
                                                  r"Trainer's decay / no-decay groups .* sizes \[8, 5\]"):
        load_adam_optimizer_from_path(model, tmp_path / "optimizer.pt", position_order="trainer")


def test_a_base_model_from_adapter_config_that_cannot_load_says_where_it_came_from(trainer_ckpt, tiny_model_dir,
                                                                                    tmp_path):
    from entropy_experiments.config import config_from_dict
    from tests.probe_helpers import load_probe

    out, _ = trainer_ckpt
    ckpt = Path(shutil.copytree(out / "checkpoint-1", tmp_path / "checkpoint-1"))
    adapter_config = json.loads((ckpt / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = "no-such-org/not-a-model-0000"
    (ckpt / "adapter_config.json").write_text(json.dumps(adapter_config))
    config = base_config(tiny_model_dir, write_prompts(tmp_path / "p.jsonl", SHORT_PROMPTS),
                         checkpoint={"checkpoint_path": str(ckpt)})
    del config["checkpoint"]["base_model"]
    with pytest.raises(CheckpointError) as info:
        load_probe(config_from_dict(config))
    message = str(info.value)
    assert message.startswith("base model 'no-such-org/not-a-model-0000' is not a local directory")
    assert message.endswith(f"(the base model came from {ckpt / 'adapter_config.json'} base_model_name_or_path; "
                            "set checkpoint.base_model to load another)")
