"""What a probe inside a training loop must hand back exactly as it found it.

The probe samples (random numbers), switches the model to eval mode (no dropout while scoring) and runs
backward passes; the trainer's next step must not notice. `untouched(model)` snapshots, and restores on exit
(also on error):

- the random streams the trainer draws from: Python's `random`, NumPy's global generator, torch's CPU
  generator and every CUDA device's;
- each module's train/eval flag;
- every parameter's `.grad` (the tensor object, or None) and `requires_grad`;
- transformers' input-require-grads hooks and gradient-checkpointing flags (paused for the probe's passes,
  then put back).

Parameter values and the optimizer are not snapshotted here: the probe reads the optimizer's state without
writing it, and the one place that moves parameters (scoring at the pre-step adapter, `trl_step_probe.py`)
restores them from its own exact copy.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn


@dataclass
class LiveSnapshot:
    """The trainer-visible state of one model and the process's random streams at one moment."""

    python_rng: Any
    numpy_rng: Any
    torch_rng: Tensor
    cuda_rngs: list[Tensor]
    training: list[tuple[nn.Module, bool]]
    grads: list[tuple[nn.Parameter, Tensor | None, bool]]


def snapshot(model: nn.Module) -> LiveSnapshot:
    """The random streams, train/eval flags and gradient buffers of `model` now."""
    cuda = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return LiveSnapshot(python_rng=random.getstate(), numpy_rng=np.random.get_state(),
                        torch_rng=torch.get_rng_state(), cuda_rngs=cuda,
                        training=[(m, m.training) for m in model.modules()],
                        grads=[(p, p.grad, p.requires_grad) for p in model.parameters()])


def restore(snap: LiveSnapshot) -> None:
    """Put everything `snapshot` recorded back (the same gradient tensor objects, not copies)."""
    random.setstate(snap.python_rng)
    np.random.set_state(snap.numpy_rng)
    torch.set_rng_state(snap.torch_rng)
    for i, state in enumerate(snap.cuda_rngs):
        torch.cuda.set_rng_state(state, i)
    for module, flag in snap.training:
        module.training = flag
    for param, grad, requires_grad in snap.grads:
        param.requires_grad_(requires_grad)
        param.grad = grad


INPUT_GRAD_HOOK = "make_inputs_require_grads"  # transformers' enable_input_require_grads hook function


@contextmanager
def input_grad_hooks_paused(model: nn.Module):
    """transformers' `enable_input_require_grads` hooks (TRL sets them under PEFT + gradient checkpointing, the
    Trainer may add a second) taken off the embeddings for the block: they call `requires_grad_` on the
    embeddings' output, which forward-mode AD (the probe's jvp passes) refuses. Each module's forward hooks are
    put back afterwards exactly as they were (same hooks, same order)."""
    saved = []
    for module in model.modules():
        hooks = module._forward_hooks  # torch's registry of forward hooks (an ordered dict id -> hook)
        if any(getattr(h, "__name__", "") == INPUT_GRAD_HOOK for h in hooks.values()):
            saved.append((module, list(hooks.items())))
            for key in [k for k, h in hooks.items() if getattr(h, "__name__", "") == INPUT_GRAD_HOOK]:
                del hooks[key]
    try:
        yield
    finally:
        for module, items in saved:
            module._forward_hooks.clear()
            module._forward_hooks.update(items)


@contextmanager
def checkpointing_paused(model: nn.Module):
    """Gradient checkpointing (the `gradient_checkpointing` flag of transformers' layers) off for the block, on
    again after: the probe's passes then round exactly as on a model loaded from a checkpoint (measured: X̂ of a
    checkpointed live model differs by ~1e-6 relative), and nothing is recomputed."""
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for module in flagged:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module in flagged:
            module.gradient_checkpointing = True


@contextmanager
def untouched(model: nn.Module):
    """Run the block with `model` in eval mode, its input-grad hooks and gradient checkpointing paused; restore
    the snapshot afterwards (also on error)."""
    snap = snapshot(model)
    try:
        model.eval()
        with input_grad_hooks_paused(model), checkpointing_paused(model):
            yield snap
    finally:
        restore(snap)


def copy_of(params: dict[str, nn.Parameter]) -> dict[str, Tensor]:
    """An exact detached copy of named parameter values."""
    return {name: p.detach().clone() for name, p in params.items()}


@contextmanager
def parameters_set_to(params: dict[str, nn.Parameter], values: dict[str, Tensor]):
    """The block runs with `params` holding `values`; their own values are restored bit for bit after."""
    saved = copy_of(params)
    try:
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(values[name])
        yield
    finally:
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(saved[name])
