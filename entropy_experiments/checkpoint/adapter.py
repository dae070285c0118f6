"""LoRA adapters: loading base + adapter for the probe, and making a fresh one.

`load_peft_for_probe` loads base + adapter for the probe (eager attention, adapter trainable and
active, eval mode) and turns every way this can go wrong into a one-line `CheckpointError`: an adapter
made for another base, weights that did not land, NaN / inf weights. `create_lora_model` makes a fresh
adapter (make-checkpoint, tests).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .base_model import load_base_model, quiet_library_loading
from .dtype_device import resolve_device, resolve_dtype
from .layout import adapter_dir_of
from .messages import first_line

__all__ = ["create_lora_model", "load_peft_for_probe"]


def _set_activation_checkpointing(model: Any, enable: bool) -> None:
    """Turn gradient (activation) checkpointing on or off (non-reentrant when on).

    transformers 5 calls it `activation_checkpointing_*` and warns on `gradient_checkpointing_*`, the only
    names transformers 4 has: the first found is used. Enabling also makes embedding outputs require grad,
    which the frozen-base + LoRA case needs so that gradients reach the checkpointed blocks.
    """
    if enable:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    elif hasattr(model, "gradient_checkpointing_disable"):
        model.gradient_checkpointing_disable()


def _saved_adapter_keys(adapter_dir: Path) -> set[str] | None:
    """Tensor names stored in the adapter's weight file (None if there is no file we can read)."""
    st_file = adapter_dir / "adapter_model.safetensors"
    if st_file.is_file():
        from safetensors import safe_open

        with safe_open(str(st_file), framework="pt") as handle:
            return set(handle.keys())
    bin_file = adapter_dir / "adapter_model.bin"
    if bin_file.is_file():
        return set(torch.load(bin_file, map_location="cpu", weights_only=True).keys())
    return None


def check_adapter_matches_base(model: Any, adapter_dir: Path, base_id: str) -> None:
    """Every saved adapter tensor must have landed in the model and vice versa.

    peft only warns about adapter weights the base has no slot for (e.g. an adapter for a deeper
    model) and about LoRA slots left at their initial values; either means the adapter was made
    for a different base, and the probe would silently measure a different policy.
    """
    from peft.utils import get_peft_model_state_dict

    saved = _saved_adapter_keys(adapter_dir)
    if saved is None:
        raise CheckpointError(f"adapter {adapter_dir} has no adapter_model.safetensors / adapter_model.bin")
    expected = set(get_peft_model_state_dict(model, adapter_name="default").keys())
    unknown, missing = sorted(saved - expected), sorted(expected - saved)
    if unknown or missing:
        detail = (f"{len(unknown)} saved tensors have no place in the model (first: {unknown[0]})" if unknown
                  else f"{len(missing)} adapter tensors are missing from the file (first: {missing[0]})")
        raise CheckpointError(f"adapter {adapter_dir} does not match base model {base_id!r}: {detail}")


def check_adapter_finite(model: Any, adapter_dir: Path) -> None:
    """Every loaded adapter tensor must be finite: NaN / inf weights would only surface later as
    "non-finite logits", far from their cause. The message names the tensor as stored in the file."""
    from peft.utils import get_peft_model_state_dict

    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        weights = adapter_dir / "adapter_model.bin"
    for key, tensor in get_peft_model_state_dict(model, adapter_name="default").items():
        if not tensor.is_floating_point():
            continue
        n_nan, n_bad = int(torch.isnan(tensor).sum()), int((~torch.isfinite(tensor)).sum())
        if n_bad:
            what = (f"{n_nan} NaN" if n_nan == n_bad else f"{n_bad} inf" if n_nan == 0
                    else f"{n_nan} NaN and {n_bad - n_nan} inf")
            raise CheckpointError(f"adapter {weights}: tensor {key!r} holds {what} values")


def _keep_4bit_layers_in_train_mode(model: torch.nn.Module) -> None:
    """CPU QLoRA: stop bitsandbytes from repacking 4-bit weights for CPU inference.

    On CPU, a bnb `Linear4bit` in eval mode that sees an input without grad (any no-grad eval
    forward, e.g. teacher forcing) repacks its weight into an inference-only layout; every later
    forward then bypasses autograd and backward passes through the model break. Keeping these
    layers in train mode avoids the repack. That is numerically harmless because they hold no
    dropout and the adapter's LoRA dropout is 0 for the probe (dropout lives in the LoRA wrapper,
    not in the 4-bit base layer). A pre-hook re-asserts it so a later `model.eval()` cannot undo it.
    """
    import bitsandbytes as bnb  # only reached on the QLoRA path, after the import check

    def force_train(module: torch.nn.Module, _args: Any) -> None:
        module.training = True

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.training = True
            module.register_forward_pre_hook(force_train)


def _qlora_config(torch_dtype: torch.dtype) -> Any:
    """4-bit nf4 quantisation with `torch_dtype` as compute dtype; bitsandbytes must be installed."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise CheckpointError("checkpoint.use_qlora: true needs bitsandbytes, which is not installed: "
                              "pip install 'entropy_experiments[qlora]'")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch_dtype)


def _prepare_base(base: Any, *, use_qlora: bool, use_checkpointing: bool) -> Any:
    """k-bit preparation (QLoRA), activation checkpointing on or off, and the KV cache to match."""
    if use_qlora:
        from peft import prepare_model_for_kbit_training

        # prepare_model_for_kbit_training turns gradient checkpointing on by default: pass our choice.
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=use_checkpointing)
    _set_activation_checkpointing(base, use_checkpointing)
    # A KV cache is useless (and refused by transformers) while activations are recomputed.
    base.config.use_cache = not use_checkpointing
    return base


def _apply_adapter(base: Any, adapter_dir: Path, base_id: str) -> Any:
    """PeftModel.from_pretrained (trainable), with a base that does not fit the adapter as one line."""
    from peft import PeftModel

    try:
        with quiet_library_loading():
            return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
    except RuntimeError as exc:
        if "size mismatch" not in str(exc):
            raise  # e.g. out of memory: not a property of the checkpoint
        # torch lists every mismatch after a header line; the first one names a tensor and both shapes.
        first = next(ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln)
        raise CheckpointError(f"adapter {adapter_dir} does not match base model {base_id!r} "
                              f"(made for a different base?): {first}") from exc
    except (ValueError, KeyError) as exc:  # e.g. "Target modules {...} not found in the base model"
        raise CheckpointError(f"adapter {adapter_dir} cannot be applied to base model {base_id!r}: "
                              f"{first_line(exc)}") from exc


def load_peft_for_probe(
    base_id: str,
    adapter_path: str | Path,
    *,
    use_qlora: bool = False,
    dtype: str = "fp32",
    device_map: str = "auto",
    use_checkpointing: bool = False,
    trust_remote_code: bool = False,
):
    """Load base model + LoRA adapter ready for probe computations.

    Args:
        base_id: embedded name, local directory or hub id (see `resolve_base_model`).
        adapter_path: directory with adapter_config.json (or a `save_checkpoint` directory).
        use_qlora: load the base in 4-bit nf4 (needs the optional bitsandbytes extra).
        dtype: "fp32" | "bf16" | "fp16" for the base weights (QLoRA: the compute dtype).
        device_map: "auto" | "cpu" | "cuda" | "cuda:N".
        use_checkpointing: enable gradient checkpointing (off by default: the probe needs exact,
            re-entrant-free autograd and caches for generation).

    Returns:
        A `PeftModel` in eval mode, eager attention, `config.use_cache=True` (unless checkpointing),
        adapter "default" active and trainable (LoRA parameters require grad).
    """
    torch_dtype = resolve_dtype(dtype)
    device = resolve_device(device_map)
    adapter_dir = adapter_dir_of(adapter_path)
    quant_config = _qlora_config(torch_dtype) if use_qlora else None

    base = load_base_model(base_id, torch_dtype=torch_dtype, device=device,
                           trust_remote_code=trust_remote_code, quantization_config=quant_config)
    base = _prepare_base(base, use_qlora=use_qlora, use_checkpointing=use_checkpointing)
    model = _apply_adapter(base, adapter_dir, base_id)
    check_adapter_matches_base(model, adapter_dir, base_id)
    check_adapter_finite(model, adapter_dir)

    model.set_adapter("default")
    model.eval()
    if use_qlora and device == "cpu":
        _keep_4bit_layers_in_train_mode(model)
    return model


def create_lora_model(
    base_id: str,
    *,
    r: int = 8,
    alpha: int = 16,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    dropout: float = 0.0,
    dtype: str = "fp32",
    device_map: str = "auto",
    seed: int = 0,
    trust_remote_code: bool = False,
):
    """A fresh LoRA adapter on `base_id` (peft's default init: lora_B = 0, so it starts as the base).

    Returns a `PeftModel` (task CAUSAL_LM) in eval mode with trainable LoRA parameters; `seed`
    fixes lora_A's initialisation without disturbing the caller's global RNG.
    """
    from peft import LoraConfig, get_peft_model

    base = load_base_model(base_id, torch_dtype=resolve_dtype(dtype), device=resolve_device(device_map),
                            trust_remote_code=trust_remote_code)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=dropout,
                        bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            with quiet_library_loading():
                model = get_peft_model(base, config)
        except ValueError as exc:  # target modules not present in this architecture
            raise CheckpointError(f"LoRA target_modules {list(target_modules)} do not fit base model "
                                  f"{base_id!r}: {first_line(exc)}") from exc
    return model.eval()
