"""Per-row directional derivatives from backward hooks against per-sample autograd (brute force)."""

from __future__ import annotations

import torch
from torch import nn

from entropy_experiments.estimators.row_directional import RowDirectionalDerivatives, linear_directions


class _TwoLayer(nn.Module):
    """A small net with a frozen middle layer, rows that must not mix, and a trainable bias."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 3, bias=False)
        self.frozen = nn.Linear(3, 3)
        self.b = nn.Linear(3, 4, bias=True)
        self.frozen.requires_grad_(False)

    def forward(self, x):  # x: [R, L, 5] → [R, L, 4]
        return self.b(torch.tanh(self.frozen(self.a(x))))


def _named_v(model, gen):
    return {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in model.named_parameters()
            if p.requires_grad}


def test_hook_dots_equal_per_row_gradient_dots():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = _TwoLayer().double()
    x = torch.randn(3, 7, 5, dtype=torch.float64)
    v = _named_v(model, gen)
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def row_losses(out):  # a different nonlinear loss per row
        return (out ** 2).sum(dim=(1, 2)) + out[:, :, 0].sin().sum(dim=1)

    reference = []
    for r in range(3):
        loss_r = row_losses(model(x))[r]
        grads = torch.autograd.grad(loss_r, params)
        reference.append(sum((g * v[n]).sum() for n, g in zip(names, grads)))
    reference = torch.stack(reference)

    directions = linear_directions(model, v)
    assert directions is not None
    with RowDirectionalDerivatives(directions) as rows:
        out = model(x)
        rows.reset(3)
        torch.autograd.grad(row_losses(out).sum(), params, retain_graph=True)
        first = rows.values.clone()
        rows.reset(3)  # a second backward through the same graph accumulates afresh
        torch.autograd.grad(2.0 * row_losses(out).sum(), params)
        second = rows.values
    assert torch.allclose(first, reference, rtol=1e-12, atol=1e-12)
    assert torch.allclose(second, 2 * reference, rtol=1e-12, atol=1e-12)
    # hooks are removed on exit: a later backward leaves the values alone
    torch.autograd.grad(row_losses(model(x)).sum(), params)
    assert torch.equal(second, rows.values)


def test_non_linear_parameters_are_not_supported():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    v = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    assert linear_directions(model, v) is None
    # a direction that misses a trainable parameter is refused too (a gradient path would be lost)
    lin = nn.Linear(3, 2)
    assert linear_directions(lin, {"weight": torch.zeros(2, 3)}) is None
