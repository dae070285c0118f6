"""The autopilot's entropy push (integrations/entropy_push.py) against autograd and torch's own AdamW.

A small softmax model; H_A, H_B the mean entropies of its predictions on two input sets (E₁ and E₂ stand-ins),
their gradients by autograd. The trainer's gradient is a loss's backward.
- After `apply_push`, `.grad` is the autograd gradient of (loss − c·H_B), and the step torch's AdamW takes from
  it is the chosen push's Δθ(κ) (to float rounding).
- The chosen κ makes the predicted change ∇H_A·Δθ(κ) reach the wanted one; with a small lr the real change of
  H_A along the pushed step is that prediction to first order (and raises the entropy the loss lowers).
- `push_weight` keeps κ = 0 where the step already reaches the wanted change and stops at max_push where none does.
"""

from __future__ import annotations

import pytest
import torch

from entropy_experiments.integrations.entropy_push import apply_push, choose_push, push_weight
from entropy_experiments.integrations.next_step import NextStep


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5)).double()


def _inputs(seed: int, n: int = 32) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _entropy(model, x) -> torch.Tensor:
    logp = torch.log_softmax(3.0 * model(x), -1)
    return -(logp.exp() * logp).sum(-1).mean()


def _loss(model) -> torch.Tensor:  # sharpens the predictions: lowers the entropy
    return -(torch.log_softmax(3.0 * model(_inputs(9)), -1)[:, 0]).mean()


def _grad_of(model, value: torch.Tensor) -> dict:
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, torch.autograd.grad(value, list(model.parameters()))))


def _setup(lr: float):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, foreach=False)
    for _ in range(2):  # some AdamW state
        optimizer.zero_grad()
        _loss(model).backward()
        optimizer.step()
    optimizer.zero_grad()
    _loss(model).backward()
    named = dict(model.named_parameters())
    X_A, X_B = _grad_of(model, _entropy(model, _inputs(1))), _grad_of(model, _entropy(model, _inputs(2)))
    return model, optimizer, named, X_A, X_B


def _dot(a: dict, b: dict) -> float:
    return float(sum((a[n].double() * b[n].double()).sum() for n in a))


def test_the_pushed_gradient_is_autograds_and_torch_takes_the_pushed_step():
    model, optimizer, named, X_A, X_B = _setup(lr=1e-2)
    unpushed = choose_push(optimizer, named, X_B, X_A, wanted=-1.0, multiplier=1.0, max_push=5.0)
    wanted = _dot(X_A, unpushed.step.step) + 0.02  # a rise the trainer's step does not give
    push = choose_push(optimizer, named, X_B, X_A, wanted=wanted, multiplier=1.0, max_push=5.0)
    assert unpushed.weight == 0.0 and 0.0 < push.weight < 5.0
    assert _dot(X_A, push.step.step) == pytest.approx(wanted, abs=1e-6)
    reference = _grad_of(model, _loss(model) - push.c * _entropy(model, _inputs(2)))
    apply_push(named, X_B, push.c)
    assert max(float((named[n].grad - reference[n]).abs().max()) for n in named) < 1e-12
    before = {n: p.detach().clone() for n, p in named.items()}
    optimizer.step()
    error = max(float((p.detach() - before[n] - push.step.step[n]).abs().max()) for n, p in named.items())
    assert error < 1e-12


def test_a_small_pushed_step_changes_the_entropy_as_predicted():
    model, optimizer, named, X_A, X_B = _setup(lr=1e-6)
    H_before = float(_entropy(model, _inputs(1)).detach())
    unpushed = choose_push(optimizer, named, X_B, X_A, wanted=-1.0, multiplier=1.0, max_push=50.0)
    predicted_unpushed = _dot(X_A, unpushed.step.step)
    assert predicted_unpushed < 0  # the loss lowers the entropy
    wanted = -predicted_unpushed  # turn the fall into an equal rise
    push = choose_push(optimizer, named, X_B, X_A, wanted=wanted, multiplier=1.0, max_push=50.0)
    apply_push(named, X_B, push.c)
    optimizer.step()
    realised = float(_entropy(model, _inputs(1)).detach()) - H_before
    print(f"unpushed {predicted_unpushed:+.3e}; κ {push.weight:.3f}: predicted {wanted:+.3e}, realised {realised:+.3e}")
    assert realised > 0
    assert realised == pytest.approx(wanted, rel=0.01)


def test_push_weight_at_its_ends():
    steps = {}

    def step_of(weight: float) -> NextStep:  # the predicted change grows with κ up to 0.3 and saturates there
        steps[weight] = NextStep({"w": torch.tensor([min(0.1 + 0.1 * weight, 0.3)])}, (1.0,))
        return steps[weight]

    X = {"w": torch.tensor([1.0])}
    assert push_weight(step_of, X, wanted=0.05, multiplier=1.0, max_push=4.0)[0] == 0.0
    assert push_weight(step_of, X, wanted=0.5, multiplier=1.0, max_push=4.0)[0] == 4.0
    weight, step = push_weight(step_of, X, wanted=0.25, multiplier=1.0, max_push=4.0)
    assert weight == pytest.approx(1.5, abs=1e-6) and float(step.step["w"]) >= 0.25
    weight, _ = push_weight(step_of, X, wanted=0.25, multiplier=2.0, max_push=4.0)  # m·X·Δθ: half the step
    assert weight == pytest.approx(0.25, abs=1e-6)
