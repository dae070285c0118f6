"""A real trl.GRPOTrainer run (entropy_experiments/testing/trl_run.py): what its checkpoints hold.

These facts are what a loader of HF Trainer / TRL checkpoints relies on (trl 1.16.0, transformers
5.23.0, torch 2.13.0, CPU): the adapter at the top of `checkpoint-N/`, an `optimizer.pt` of the fused
torch AdamW with two param groups (LoRA weights in the first, the empty no-decay group second), ids
in the order of the model's trainable named_parameters, no `param_names`, and the saved lr being the
next step's (0.0 after the last step of a linear schedule).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("trl")

from entropy_experiments.testing.trl_run import run_tiny_grpo

pytestmark = pytest.mark.e2e  # runs whole probes (scripts/test.sh -m "not e2e" skips them)

LR = 1e-3
BETAS, EPS = (0.9, 0.999), 1e-8


@pytest.fixture(scope="module")
def grpo_out(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("trl_grpo")
    last = run_tiny_grpo(out, steps=2, model_dir=tiny_model_dir, learning_rate=LR)
    assert last == out / "checkpoint-2"
    return out


def _optimizer(ckpt):
    return torch.load(ckpt / "optimizer.pt", weights_only=True, map_location="cpu")


def test_checkpoint_layout(grpo_out, tiny_model_dir):
    for step in (1, 2):
        ckpt = grpo_out / f"checkpoint-{step}"
        names = {p.name for p in ckpt.iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "scheduler.pt",
                "rng_state.pth", "trainer_state.json", "training_args.bin", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja", "README.md"} == names
    config = json.loads((grpo_out / "checkpoint-2" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(tiny_model_dir)


def test_adapter_keys(grpo_out):
    from safetensors.torch import load_file

    tensors = load_file(grpo_out / "checkpoint-2" / "adapter_model.safetensors")
    expected = {f"base_model.model.model.layers.{i}.self_attn.{m}_proj.lora_{ab}.weight"
                for i in (0, 1) for m in "qv" for ab in "AB"}
    assert set(tensors) == expected  # no ".default" adapter name in the file's keys
    assert all(t.dtype == torch.float32 for t in tensors.values())


def test_optimizer_param_groups(grpo_out):
    for step, lr in ((1, LR / 2), (2, 0.0)):
        state = _optimizer(grpo_out / f"checkpoint-{step}")
        assert set(state) == {"state", "param_groups"}
        groups = state["param_groups"]
        assert [g["params"] for g in groups] == [list(range(8)), []]  # decay group, empty no-decay group
        for g in groups:
            assert "param_names" not in g
            assert g["fused"] is True and g["foreach"] is None
            assert g["lr"] == pytest.approx(lr, abs=1e-12) and g["initial_lr"] == LR
            assert g["weight_decay"] == 0.0 and tuple(g["betas"]) == BETAS and g["eps"] == EPS
            assert g["amsgrad"] is False and g["maximize"] is False and g["decoupled_weight_decay"] is True
        assert sorted(state["state"]) == list(range(8))
        for entry in state["state"].values():
            assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}
            assert entry["step"].dtype == torch.float32 and entry["step"].item() == step


def test_scheduler_and_trainer_state(grpo_out):
    scheduler = torch.load(grpo_out / "checkpoint-2" / "scheduler.pt", weights_only=True)
    assert scheduler["base_lrs"] == [LR, LR] and scheduler["_last_lr"] == [0.0, 0.0]
    assert scheduler["last_epoch"] == 2
    trainer_state = json.loads((grpo_out / "checkpoint-2" / "trainer_state.json").read_text())
    assert trainer_state["global_step"] == 2 and trainer_state["max_steps"] == 2
    assert [row["learning_rate"] for row in trainer_state["log_history"] if "learning_rate" in row] == [LR, LR / 2]
    assert trainer_state["train_batch_size"] == 4


def test_optimizer_ids_follow_trainable_named_parameters(grpo_out, tiny_model_dir):
    """Id k is the k-th trainable parameter of the PeftModel: step 2's AdamW update, recomputed from the
    moments saved in checkpoint-2 with the lr saved in checkpoint-1, is the adapter change 1 → 2."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, grpo_out / "checkpoint-2", is_trainable=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(names) == 8 and all(".default." in n for n in names)
    before = load_file(grpo_out / "checkpoint-1" / "adapter_model.safetensors")
    after = load_file(grpo_out / "checkpoint-2" / "adapter_model.safetensors")
    lr = _optimizer(grpo_out / "checkpoint-1")["param_groups"][0]["lr"]
    state = _optimizer(grpo_out / "checkpoint-2")["state"]
    for k, name in enumerate(names):
        key = name.replace(".default", "")
        m_hat = state[k]["exp_avg"].double() / (1 - BETAS[0] ** 2)
        v_hat = state[k]["exp_avg_sq"].double() / (1 - BETAS[1] ** 2)
        update = -lr * m_hat / (v_hat.sqrt() + EPS)
        assert update.abs().max() > 1e-5, name
        torch.testing.assert_close((after[key] - before[key]).double(), update, rtol=1e-3, atol=2e-8)
