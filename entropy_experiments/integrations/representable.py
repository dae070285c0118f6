"""What the trainer-step prediction can represent: refused at construction, each in one line naming the setting.

The prediction is the exact step torch's AdamW (or Adam with decoupled or no weight decay) makes from the
gradients in `.grad` at `on_pre_optimizer_step`. It cannot be that step when (DeepSpeed, FSDP and the other
launch modes the callbacks cannot run under are refused by `ranks.launch_refusal`)

    fp16            the gradients are still multiplied by the loss scaler there (unscaled inside its step)
    the optimizer   is another algorithm (Adafactor, 8-bit or fused-apex AdamW, SGD, …), or Adam with coupled
                    (L2) weight decay, whose decay goes through the moments

A step the trainer took that differs from the prediction (another callback editing `.grad` or the lr after
this one) is flagged in the row instead (`step_ok`, see `step_agrees`).
"""

from __future__ import annotations

from typing import Any

import torch

from entropy_experiments.errors import ConfigError

KEY = "EntropyProbeCallback"
TORCH_ADAMW = ("adamw_torch", "adamw_torch_fused")


def unwrapped(optimizer: Any) -> Any:
    """The torch optimizer under accelerate's `AcceleratedOptimizer` wrapper (itself where there is none)."""
    while getattr(optimizer, "optimizer", None) is not None:  # accelerate's wrapper is an Optimizer subclass too
        optimizer = optimizer.optimizer
    return optimizer


def check_optimizer(optimizer: Any) -> None:
    """ConfigError unless `optimizer` is torch's AdamW, or Adam without coupled weight decay."""
    inner = unwrapped(optimizer)
    if isinstance(inner, torch.optim.AdamW):
        return
    if type(inner) is torch.optim.Adam:
        coupled = [g["weight_decay"] for g in inner.param_groups
                   if g.get("weight_decay", 0) and not g.get("decoupled_weight_decay", False)]
        if not coupled:
            return
        raise ConfigError(f"{KEY}: torch.optim.Adam with weight_decay={coupled[0]!r} (L2, through the moments) "
                          "is not supported: use torch.optim.AdamW or Adam(decoupled_weight_decay=True)")
    raise ConfigError(f"{KEY}: the optimizer is {type(inner).__module__}.{type(inner).__name__}: the prediction "
                      "is the step of torch's AdamW (or Adam) only")


def check_representable(trainer: Any) -> None:
    """ConfigError (one line) for a trainer whose next step the AdamW prediction cannot be."""
    args = trainer.args
    if getattr(args, "fp16", False):
        raise ConfigError(f"{KEY}: GRPOConfig.fp16=True is not supported: at on_pre_optimizer_step the "
                          "gradients are still scaled by the loss scaler (use bf16=True)")
    optim = str(getattr(args.optim, "value", args.optim))
    if getattr(trainer, "optimizer", None) is not None:
        check_optimizer(trainer.optimizer)
    elif optim not in TORCH_ADAMW:
        raise ConfigError(f"{KEY}: GRPOConfig.optim={optim!r} is not supported: the prediction is the step of "
                          f"torch's AdamW ({' or '.join(TORCH_ADAMW)})")


def step_agrees(step_error: float, largest_step: float, largest_param: float) -> bool:
    """The step taken equals the predicted one to float rounding: within 1e-3 of the largest predicted
    coordinate plus fp32 rounding of the largest parameter (a far larger error means something else changed
    the gradients or the lr after the prediction)."""
    return step_error <= 1e-3 * largest_step + 1e-6 * max(largest_param, 1.0)
