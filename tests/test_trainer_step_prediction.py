"""The step the trainer is about to take, predicted before it (integrations/next_step.py, trainer_step.py).

- `next_adamw_step` against the step torch.optim.AdamW really takes: θ_after − θ_before = lr·v_next, with weight
  decay, clipping, bias correction, amsgrad, several param groups (own lr, own decay), and the first step.
- On the enumerable toy policy (tests/realised_toy.py): δH_next = X̂·Δθ_next ± SE_E from a fresh E is within its
  SE of the exact directional derivative of H along the step torch then takes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from entropy_experiments.estimators.jackknife import se_E
from entropy_experiments.integrations.next_step import next_adamw_step
from tests import realised_toy as toy

TOL = 1e-6


def _model(seed: int, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(dtype)


def _backward(model, seed: int, max_grad_norm: float | None) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 5, generator=gen, dtype=next(model.parameters()).dtype)
    model.zero_grad()
    (model(x) ** 2).sum().mul(3.0).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)


def _groups(model, lrs, decays):
    layers = [model[0], model[2]]
    return [{"params": list(m.parameters()), "lr": lr, "weight_decay": wd} for m, lr, wd in zip(layers, lrs, decays)]


def _max_step_error(model, optimizer, steps: int, max_grad_norm: float | None, *, frozen_bias: bool = False) -> list:
    named = {n: p for n, p in model.named_parameters()}
    order = [id(p) for g in optimizer.param_groups for p in g["params"]]
    named = dict(sorted(named.items(), key=lambda kv: order.index(id(kv[1]))))
    errors = []
    for k in range(steps):
        _backward(model, 100 + k, max_grad_norm)
        if frozen_bias:
            model[2].bias.grad = None
        before = {n: p.detach().clone() for n, p in named.items()}
        predicted = next_adamw_step(optimizer, named)
        optimizer.step()
        err = max(float((p.detach() - before[n] - predicted.step[n]).abs().max()) for n, p in named.items())
        moved = max(float((p.detach() - before[n]).abs().max()) for n, p in named.items())
        errors.append((err, moved))
        for group in optimizer.param_groups:  # a scheduler: the next step's lr differs
            group["lr"] *= 0.7
    return errors


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_next_step_is_the_step_adamw_takes(amsgrad, max_grad_norm):
    model = _model(0)
    optimizer = torch.optim.AdamW(_groups(model, (3e-2, 1e-2), (0.1, 0.0)), betas=(0.8, 0.95), eps=1e-6,
                                  amsgrad=amsgrad, foreach=False)
    errors = _max_step_error(model, optimizer, steps=4, max_grad_norm=max_grad_norm)
    for err, moved in errors:  # the first step (empty state) included
        assert moved > 1e-4  # the step really moved the parameters
        assert err < TOL, errors
    print("max |Δθ − lr·v_next| =", max(e for e, _ in errors))


@pytest.mark.parametrize("implementation", [{"foreach": True}, {"fused": True}])
def test_next_step_of_the_foreach_and_fused_implementations_and_a_parameter_without_grad(implementation):
    """foreach and fused (transformers' default optim, adamw_torch_fused) round in their own order."""
    model = _model(1)
    optimizer = torch.optim.AdamW(_groups(model, (5e-3, 2e-2), (0.01, 0.3)), **implementation)
    errors = _max_step_error(model, optimizer, steps=3, max_grad_norm=0.5, frozen_bias=True)
    assert all(err < TOL for err, _ in errors), errors
    assert optimizer.state.get(model[2].bias) in (None, {})  # torch never stepped it; the prediction was 0


def test_next_step_reads_the_optimizer_without_writing_it():
    model = _model(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    _max_step_error(model, optimizer, steps=1, max_grad_norm=None)
    _backward(model, 7, None)
    before = {k: {f: v.clone() for f, v in s.items()} for k, s in optimizer.state.items()}
    groups = [dict(g, params=None) for g in optimizer.param_groups]
    next_adamw_step(optimizer, dict(model.named_parameters()))
    assert [dict(g, params=None) for g in optimizer.param_groups] == groups
    for key, fields in before.items():
        for f, v in fields.items():
            assert torch.equal(optimizer.state[key][f], v)


# ------------------------------------------------------------------ the toy: δH_next against the exact derivative
def _toy_step(seed: int):
    """θ after two AdamW steps of the toy (two param groups, own lr and decay), the gradient of a third reward in
    .grad: (θ, the predicted step, θ after torch's real step)."""
    gen = torch.Generator().manual_seed(seed)
    A = (0.1 * torch.randn(toy.P, toy.V, generator=gen, dtype=torch.float64)).requires_grad_()
    B = (2.0 * torch.randn(toy.L - 1, toy.V, toy.V, generator=gen, dtype=torch.float64)).requires_grad_()
    opt = torch.optim.AdamW([{"params": [A], "lr": 0.05, "weight_decay": 0.01},
                             {"params": [B], "lr": 0.02, "weight_decay": 0.1}])
    first = torch.as_tensor(toy.TOK[:, 0])
    for k in range(3):
        reward = torch.rand(toy.P, toy.V, generator=gen, dtype=torch.float64)[:, first]
        opt.zero_grad()
        (-(reward * toy.token_tables((A, B))[0].sum(-1).exp()).sum()).backward()
        torch.nn.utils.clip_grad_norm_([A, B], 0.5)
        if k < 2:
            opt.step()
    theta = (A.detach().clone(), B.detach().clone())
    predicted = next_adamw_step(opt, {"A": A, "B": B})
    opt.step()
    after = (A.detach().clone(), B.detach().clone())
    return theta, predicted, after


def test_delta_h_next_is_within_its_se_of_the_exact_derivative_along_the_real_step():
    theta, predicted, after = _toy_step(3)
    target = (theta[0] + predicted.step["A"], theta[1] + predicted.step["B"])
    assert max(float((t - a).abs().max()) for t, a in zip(target, after)) < 1e-12
    exact = toy.exact_directional_derivative(theta, after)
    z = []
    for seed in range(16):
        E = toy.draw_E(theta, 64, seed=1000 + seed)
        side = toy.cross_scored(E, theta, theta)
        a, r = toy.displacement_pieces(E, theta, target)
        value, se = se_E(torch.as_tensor(a), torch.as_tensor(r), torch.as_tensor(side.h_own),
                         torch.as_tensor(side.T), side.units, normalize="per_token", learning_rate=1.0)
        z.append((value - exact) / se)
    z = np.asarray(z)
    rms = float(np.sqrt(np.mean(z ** 2)))
    print(f"exact D_Δθ H = {exact:.4e}; z over 16 E: rms {rms:.2f}, max |z| {np.abs(z).max():.2f}")
    assert abs(exact) > 1e-4
    assert toy.RMS_16[0] < rms < toy.RMS_16[1] and np.abs(z).max() < toy.MAX_Z
