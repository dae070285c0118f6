"""testing/oracle_hold.py: the perfect-information entropy controller of the enumerable world — its direction
against its defining properties, its preconditioner against torch's own AdamW step, and the exact entropy it
holds in a real GRPOTrainer run (measured by the world's ExactMeter, which owes nothing to it)."""

from __future__ import annotations

import math

import pytest
import torch

from entropy_experiments.testing.oracle_hold import adamw_preconditioner, held_direction


def _dot(a, b):
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))


def test_the_direction_raises_the_entropy_and_is_blind_to_the_reward():
    g = torch.Generator().manual_seed(0)
    grad_H = [torch.randn(5, 3, generator=g), torch.randn(4, generator=g)]
    grad_R = [torch.randn(h.shape, generator=g) + 0.5 * h for h in grad_H]  # correlated with ∇H, as in the world
    P = [torch.rand(5, 3, generator=g, dtype=torch.float64) + 0.1, torch.rand(4, generator=g, dtype=torch.float64) + 0.1]
    d = held_direction(grad_H, grad_R, P)
    assert _dot(d, d) == pytest.approx(1.0, rel=1e-12)
    assert abs(_dot(grad_R, d)) < 1e-12 and _dot(grad_H, d) > 0
    # d lies in the span of P∇H and P∇R: its residual after least squares on them is 0
    basis = torch.stack([torch.cat([(p * x.double()).flatten() for p, x in zip(P, v)]) for v in (grad_H, grad_R)], 1)
    flat = torch.cat([t.flatten() for t in d])
    coef = torch.linalg.lstsq(basis, flat[:, None]).solution
    assert torch.allclose(basis @ coef, flat[:, None], atol=1e-12)


def test_the_preconditioner_is_the_one_torch_adamw_just_divided_by():
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(3, 2, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.0, eps=1e-8)
    for _ in range(3):  # a few steps: the second moment and its bias correction are not trivial
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    P = adamw_preconditioner(opt, params)
    for p, b, pre in zip(params, before, P):
        m_hat = opt.state[p]["exp_avg"].double() / (1 - 0.9 ** int(opt.state[p]["step"]))
        assert torch.allclose((p.detach() - b).double(), -0.1 * m_hat * pre, atol=1e-6)


@pytest.mark.e2e
@pytest.mark.xdist_group("trl_callback")
def test_in_a_real_run_the_exact_entropy_stays_on_its_start(tmp_path):
    pytest.importorskip("trl")
    from entropy_experiments.testing.enumerable_world import world_model, world_trainer
    from entropy_experiments.testing.oracle_hold import OracleHold

    model_dir = world_model(tmp_path / "toy")
    free, free_meter = world_trainer(model_dir, tmp_path / "free", steps=3, lr=2e-2, seed=0)
    free.train()
    held, meter = world_trainer(model_dir, tmp_path / "held", steps=3, lr=2e-2, seed=0)
    oracle = OracleHold(held)
    held.add_callback(oracle)  # it acts at on_optimizer_step, before every callback's on_step_end (the meter's)
    held.train()
    assert free_meter.H[0] == meter.H[0] == pytest.approx(oracle.H0, rel=1e-12)
    assert max(abs(h - free_meter.H[0]) for h in free_meter.H[1:]) > 0.05  # uncontrolled, it moves
    assert all(abs(h - meter.H[0]) < 1e-4 for h in meter.H[1:]), meter.H
    assert len(oracle.moves) == 3 and all(math.isfinite(c) and c != 0 for c in oracle.moves)
