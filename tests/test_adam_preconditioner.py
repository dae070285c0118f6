"""AdamW direction maths against REAL torch.optim.AdamW steps, hand formulas and autograd."""

from __future__ import annotations

import copy

import pytest
import torch

from entropy_experiments.errors import ConfigError, OptimizerStateError
from entropy_experiments.estimators.update_direction import (
    UPDATE_DIRECTIONS,
    AdamHyper,
    AdamStateError,
    adam_state_by_name,
    adamw_step_direction,
    clip_coefficient,
    hyper_by_name,
    leave_one_out_gradients,
    named_dot,
    named_norm,
    preconditioned_gradient_direction,
    sgd_direction,
    update_direction,
)

SHAPES = {"a.lora_A": (4, 6), "a.lora_B": (6, 4), "b.lora_A": (3, 5), "b.lora_B": (5,)}
NAMES = list(SHAPES)


def _params(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return {
        n: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype) * 0.5) for n, s in SHAPES.items()
    }


def _random_grads(dtype: torch.dtype, seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen, dtype=dtype) * scale for n, s in SHAPES.items()}


def _optimizer(params, *, weight_decay: float, amsgrad: bool, two_groups: bool) -> torch.optim.AdamW:
    ps = [params[n] for n in NAMES]
    if two_groups:  # different betas / eps / decay per group
        groups = [
            {"params": ps[:2]},
            {"params": ps[2:], "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 3 * weight_decay + 0.02},
        ]
    else:
        groups = [{"params": ps}]
    return torch.optim.AdamW(
        groups, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, amsgrad=amsgrad
    )


def _train(opt, params, n_steps: int, dtype) -> None:
    for k in range(n_steps):
        for n, g in _random_grads(dtype, 100 + k, scale=0.1 * (k + 1)).items():
            params[n].grad = g
        opt.step()


def _real_step_displacement(opt, params, grads, lr: float, max_grad_norm: float | None):
    """θ before / after one real AdamW step (lr = η) on deep copies; the originals stay untouched."""
    # One deepcopy of (params, optimizer) keeps the optimizer's param and state links intact.
    params2, opt2 = copy.deepcopy((params, opt))
    for group in opt2.param_groups:
        group["lr"] = lr
    before = {n: p.detach().clone() for n, p in params2.items()}
    for n, p in params2.items():
        p.grad = grads[n].clone()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([params2[n] for n in NAMES], max_grad_norm)
    opt2.step()
    return before, {n: p.detach().clone() for n, p in params2.items()}


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
@pytest.mark.parametrize("n_steps", [0, 3])
@pytest.mark.parametrize("two_groups", [False, True])
def test_adamw_direction_matches_real_step_fp64(weight_decay, amsgrad, max_grad_norm, n_steps, two_groups):
    """fp64 real step: (θ_after − θ_before)/η == v to 1e-6 relative, for η = 1e-3 and 1e-6 alike."""
    dtype = torch.float64
    params = _params(dtype)
    opt = _optimizer(params, weight_decay=weight_decay, amsgrad=amsgrad, two_groups=two_groups)
    _train(opt, params, n_steps, dtype)
    grads = _random_grads(dtype, 7)
    if max_grad_norm is not None:  # make sure the clip is active
        assert clip_coefficient(grads, max_grad_norm)[1] < 1.0

    hyper = hyper_by_name(opt, NAMES)
    state = adam_state_by_name(opt, NAMES)
    v = adamw_step_direction(params, grads, state, hyper, max_grad_norm=max_grad_norm, dtype=dtype)
    for lr in (1e-3, 1e-6):
        before, after = _real_step_displacement(opt, params, grads, lr, max_grad_norm)
        for n in NAMES:
            torch.testing.assert_close((after[n] - before[n]) / lr, v[n], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_adamw_direction_fp32_reproduces_real_fp32_step(weight_decay, amsgrad, max_grad_norm):
    """fp32 params: θ + η·v (formed in fp32, as the param-override path does) lands on the real
    fp32 step within a few ulps of θ; and fp32 v agrees with the fp64 computation."""
    dtype = torch.float32
    params = _params(dtype, seed=1)
    opt = _optimizer(params, weight_decay=weight_decay, amsgrad=amsgrad, two_groups=True)
    _train(opt, params, 4, dtype)
    grads = _random_grads(dtype, 9)
    hyper, state = hyper_by_name(opt, NAMES), adam_state_by_name(opt, NAMES)
    v = adamw_step_direction(params, grads, state, hyper, max_grad_norm=max_grad_norm)
    v64 = adamw_step_direction(params, grads, state, hyper, max_grad_norm=max_grad_norm, dtype=torch.float64)
    lr = 1e-3
    before, after = _real_step_displacement(opt, params, grads, lr, max_grad_norm)
    ulp = torch.finfo(dtype).eps
    for n in NAMES:
        assert v[n].dtype == torch.float32
        torch.testing.assert_close(v[n].double(), v64[n], rtol=1e-5, atol=1e-6)
        predicted = before[n] + lr * v[n]
        tol = 4 * ulp * after[n].abs() + 1e-12
        assert torch.all((predicted - after[n]).abs() <= tol), n


def test_fresh_state_is_zero_with_step_zero():
    params = _params(torch.float32)
    opt = _optimizer(params, weight_decay=0.0, amsgrad=True, two_groups=False)
    state = adam_state_by_name(opt, NAMES)
    for n in NAMES:
        assert state[n]["step"] == 0
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert state[n][key].shape == SHAPES[n] and not state[n][key].any()
    # A bare state dict needs the params to know the shapes.
    with pytest.raises(AdamStateError):
        adam_state_by_name(opt.state_dict(), NAMES)
    bare = adam_state_by_name(opt.state_dict(), NAMES, params=params)
    assert bare[NAMES[0]]["exp_avg"].shape == SHAPES[NAMES[0]]


def test_state_is_cloned_and_hyper_comes_from_saved_groups():
    params = _params(torch.float32)
    opt = _optimizer(params, weight_decay=0.05, amsgrad=False, two_groups=True)
    _train(opt, params, 2, torch.float32)
    # Simulate a reload: a fresh optimizer with DEFAULT hyperparameters loads the saved state.
    reloaded = torch.optim.AdamW(
        [{"params": [params[n] for n in NAMES[:2]]}, {"params": [params[n] for n in NAMES[2:]]}]
    )
    reloaded.load_state_dict(copy.deepcopy(opt.state_dict()))
    hyper = hyper_by_name(reloaded, NAMES)
    assert hyper["a.lora_A"] == AdamHyper(
        lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, amsgrad=False
    )
    assert hyper["b.lora_B"].beta1 == 0.8 and hyper["b.lora_B"].eps == 1e-6
    assert hyper["b.lora_B"].weight_decay == pytest.approx(0.17)

    state = adam_state_by_name(reloaded, NAMES)
    assert state["a.lora_A"]["step"] == 2
    snapshot = state["a.lora_A"]["exp_avg"].clone()
    _train(reloaded, params, 1, torch.float32)  # stepping must not leak into the snapshot
    torch.testing.assert_close(state["a.lora_A"]["exp_avg"], snapshot, rtol=0, atol=0)


def test_hyper_refuses_unsupported_setups():
    params = _params(torch.float32)
    opt = torch.optim.AdamW([params[n] for n in NAMES], maximize=True)
    with pytest.raises(ValueError, match="maximize"):
        hyper_by_name(opt, NAMES)
    adam_l2 = torch.optim.Adam([params[n] for n in NAMES], weight_decay=0.1)
    with pytest.raises(OptimizerStateError, match="decoupled"):
        hyper_by_name(adam_l2, NAMES)
    # Plain Adam without decay is the same step as AdamW: accepted.
    assert hyper_by_name(torch.optim.Adam([params[n] for n in NAMES]), NAMES)["a.lora_A"].weight_decay == 0.0
    with pytest.raises(ValueError, match="3 trainable"):
        hyper_by_name(torch.optim.AdamW([params[n] for n in NAMES]), NAMES[:3])
    saved = torch.optim.AdamW([params[n] for n in NAMES]).state_dict()
    del saved["param_groups"][0]["weight_decay"]
    with pytest.raises(ValueError, match="weight_decay"):
        hyper_by_name(saved, NAMES)


def test_named_optimizer_checks_names():
    params = _params(torch.float32)
    opt = torch.optim.AdamW(list(params.items()))
    assert set(hyper_by_name(opt, NAMES)) == set(NAMES)
    with pytest.raises(ValueError, match="name parameter 0"):
        hyper_by_name(opt, ["x"] + NAMES[1:])


def test_clip_coefficient_matches_torch():
    grads = _random_grads(torch.float32, 3)
    for max_norm in (0.1, 1e3):
        ps = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES.values()]
        for p, g in zip(ps, grads.values()):
            p.grad = g.clone()
        total = torch.nn.utils.clip_grad_norm_(ps, max_norm)
        norm, coef = clip_coefficient(grads, max_norm)
        assert norm == pytest.approx(float(total), rel=1e-6)
        assert coef == pytest.approx(min(1.0, max_norm / (float(total) + 1e-6)), rel=1e-6)
        for p, g in zip(ps, grads.values()):
            torch.testing.assert_close(p.grad, g * coef)
    assert clip_coefficient(grads, None)[1] == 1.0


def _trained_state(dtype=torch.float64):
    params = _params(dtype)
    opt = _optimizer(params, weight_decay=0.01, amsgrad=False, two_groups=True)
    _train(opt, params, 3, dtype)
    return params, hyper_by_name(opt, NAMES), adam_state_by_name(opt, NAMES)


def test_preconditioned_and_sgd_by_hand():
    _, hyper, state = _trained_state()
    grads = _random_grads(torch.float64, 11)
    v = preconditioned_gradient_direction(grads, state, hyper, dtype=torch.float64)
    for n in NAMES:
        h, s, t = hyper[n], state[n]["exp_avg_sq"], state[n]["step"]
        expected = -grads[n] / (torch.sqrt(s / (1 - h.beta2**t)) + h.eps)
        torch.testing.assert_close(v[n], expected, rtol=1e-12, atol=0)
        torch.testing.assert_close(sgd_direction(grads, dtype=torch.float64)[n], -grads[n])
    fresh = {n: {**state[n], "step": 0} for n in NAMES}
    with pytest.raises(ValueError, match=r"needs a trained optimizer state \(step ≥ 1\)"):
        preconditioned_gradient_direction(grads, fresh, hyper)


def test_update_direction_dispatch():
    params, hyper, state = _trained_state()
    grads = _random_grads(torch.float64, 12)
    assert set(UPDATE_DIRECTIONS) == {"adamw_step", "preconditioned_gradient", "sgd"}
    kw = {"max_grad_norm": 0.3, "dtype": torch.float64}
    pairs = {
        "adamw_step": adamw_step_direction(params, grads, state, hyper, **kw),
        "preconditioned_gradient": preconditioned_gradient_direction(
            grads, state, hyper, dtype=torch.float64
        ),
        "sgd": sgd_direction(grads, dtype=torch.float64),
    }
    for kind, expected in pairs.items():
        got = update_direction(kind, params, grads, state, hyper, **kw)
        for n in NAMES:
            torch.testing.assert_close(got[n], expected[n], rtol=0, atol=0)
    with pytest.raises(ConfigError, match="did you mean 'sgd'"):
        update_direction("sgdd", params, grads, state, hyper)


def test_none_grad_means_no_step():
    params, hyper, state = _trained_state()
    grads: dict = _random_grads(torch.float64, 13)
    grads["b.lora_B"] = None
    v = adamw_step_direction(params, grads, state, hyper, dtype=torch.float64)
    assert not v["b.lora_B"].any()


def test_shape_mismatch_is_refused():
    params, hyper, state = _trained_state()
    state["a.lora_A"]["exp_avg"] = state["a.lora_A"]["exp_avg"].T
    with pytest.raises(OptimizerStateError, match="shape"):
        adamw_step_direction(params, _random_grads(torch.float64, 1), state, hyper)


def test_leave_one_out_matches_autograd_on_mean_loss():
    """g₍₋k₎ must be the gradient of the prompt-MEAN loss over the prompts outside group k."""
    gen = torch.Generator().manual_seed(5)
    b_u, d = 7, 4
    x = torch.randn(b_u, d, generator=gen, dtype=torch.float64)
    y = torch.randn(b_u, generator=gen, dtype=torch.float64)
    w = torch.randn(d, generator=gen, dtype=torch.float64, requires_grad=True)
    c = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)

    def prompt_losses():  # one nonlinear loss per prompt
        return (x @ w + c.sum() - y) ** 2 + torch.tanh(x[:, :3] @ c)

    groups = [[0, 1, 2], [3], [4, 5, 6]]
    group_grads = []
    for idx in groups:  # each g_k carries the 1/B_U factor of the full mean loss
        gw, gc = torch.autograd.grad(prompt_losses()[idx].sum() / b_u, (w, c))
        group_grads.append({"w": gw, "c": gc})
    loo = leave_one_out_gradients(group_grads, [len(g) for g in groups])
    for k, idx in enumerate(groups):
        keep = [p for p in range(b_u) if p not in idx]
        rw, rc = torch.autograd.grad(prompt_losses()[keep].mean(), (w, c))
        torch.testing.assert_close(loo[k]["w"], rw, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(loo[k]["c"], rc, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError):
        leave_one_out_gradients(group_grads[:1], [3])


def test_named_dot_and_norm_vs_flat_vectors():
    a = _random_grads(torch.float32, 21)
    b = _random_grads(torch.float32, 22)
    flat_a = torch.cat([a[n].double().reshape(-1) for n in NAMES])
    flat_b = torch.cat([b[n].double().reshape(-1) for n in NAMES])
    assert named_dot(a, b) == pytest.approx(float(flat_a @ flat_b), rel=1e-12)
    assert named_norm(a) == pytest.approx(float(flat_a.norm()), rel=1e-12)
    with pytest.raises(ValueError):
        named_dot(a, {n: b[n] for n in NAMES[:2]})
