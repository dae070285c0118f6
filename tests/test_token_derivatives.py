"""D_v H_t by finite differences (estimators/token_derivatives.py) against autograd and against the exact pass.

- the pure differences on the entropy of softmax(a + η·b), whose derivative in η autograd gives exactly: the
  central difference's error falls as η², the forward difference's as η, as their Taylor terms say;
- which passes `token_pass_choice` takes;
- on the tiny model, the probe's default token attribution (the ΔH passes' difference) against the same run's
  exact forward-mode attribution (`output.token_attribution_method: jvp`) on the same E and U, and the default
  makes no pass along v for it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from entropy_experiments.estimators.token_derivatives import (
    TokenPassChoice,
    central_token_derivatives,
    forward_token_derivatives,
    token_derivatives,
    token_pass_choice,
)
from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts


def _entropies(a: torch.Tensor, b: torch.Tensor, eta: float) -> torch.Tensor:
    logq = torch.log_softmax(a + eta * b, -1)
    return -(logq.exp() * logq).sum(-1)


def _rows(a, b, eta) -> list[torch.Tensor]:
    return [_entropies(x, y, eta) for x, y in zip(a, b)]


@pytest.fixture(scope="module")
def logits():
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(T, 11, generator=gen, dtype=torch.float64) for T in (3, 5, 1)]
    b = [torch.randn(T, 11, generator=gen, dtype=torch.float64) * 40 for T in (3, 5, 1)]
    exact = [torch.func.jvp(lambda e, x=x, y=y: _entropies(x, y, e), (torch.tensor(0.0, dtype=torch.float64),),
                            (torch.tensor(1.0, dtype=torch.float64),))[1] for x, y in zip(a, b)]
    return a, b, exact


def _error(rows, exact) -> float:
    return max(float((r - e).abs().max()) for r, e in zip(rows, exact))


def test_central_and_forward_differences_converge_at_their_orders(logits):
    a, b, exact = logits
    base = _rows(a, b, 0.0)
    central, forward = {}, {}
    for eta in (1e-3, 5e-4):
        central[eta] = _error(central_token_derivatives(_rows(a, b, eta), _rows(a, b, -eta), eta), exact)
        forward[eta] = _error(forward_token_derivatives(_rows(a, b, eta), base, eta), exact)
    assert central[1e-3] / central[5e-4] == pytest.approx(4.0, rel=0.05)  # (η²/6)·D³H
    assert forward[1e-3] / forward[5e-4] == pytest.approx(2.0, rel=0.05)  # (η/2)·D²H
    assert central[5e-4] < 0.1 * forward[5e-4]  # the even terms cancel
    assert [len(r) for r in central_token_derivatives(base, base, 1e-3)] == [3, 5, 1]


def test_token_derivatives_follows_the_choice(logits):
    a, b, _ = logits
    passes = {eta: _rows(a, b, eta) for eta in (1e-4, -1e-4, 1e-3)}
    base = _rows(a, b, 0.0)
    central = token_derivatives(TokenPassChoice("central", 1e-4), passes, base)
    forward = token_derivatives(TokenPassChoice("forward", 1e-3), passes, base)
    for got, want in zip(central, central_token_derivatives(passes[1e-4], passes[-1e-4], 1e-4)):
        assert torch.equal(got, want)
    for got, want in zip(forward, forward_token_derivatives(passes[1e-3], base, 1e-3)):
        assert torch.equal(got, want)


def test_bad_passes_are_refused(logits):
    a, b, _ = logits
    rows = _rows(a, b, 0.0)
    with pytest.raises(ValueError, match="η > 0"):
        central_token_derivatives(rows, rows, 0.0)
    with pytest.raises(ValueError, match="different lengths"):
        forward_token_derivatives(rows, rows[:2], 1e-3)


@pytest.mark.parametrize(("etas", "choice"), [
    ([1e-5], TokenPassChoice("forward", 1e-5)),                              # +η only: no pair to check it
    ([1e-5, -1e-3, 1e-3], TokenPassChoice("central", 1e-3, 1e-5)),           # the default: checked by 1e-5
    ([-1e-5, 1e-5], TokenPassChoice("forward", 1e-5)),                       # a pair with nothing to check it
    ([-1e-6, -1e-5, 1e-6, 1e-5, 3e-3, -3e-3], TokenPassChoice("central", 1e-5, -1e-6)),  # 3e-3: past TOKEN_ETA_MAX
    ([3e-3, -3e-3, 1e-4], None),                                             # 1e-4 past the forward's limit: jvp
    ([3e-3, -3e-3, 1e-6], TokenPassChoice("forward", 1e-6, 3e-3)),           # its error from the ±3e-3 pair
    ([1e-3, 1e-4, -1e-3], TokenPassChoice("central", 1e-3, 1e-4)),
    ([0.005, -1e-3, 1e-3], TokenPassChoice("central", 1e-3, 0.005)),
    ([-1e-5], None),
    ([], None),
])
def test_token_pass_choice(etas, choice):
    assert token_pass_choice(etas) == choice
    if choice is not None:
        assert set(choice.etas()) <= set(etas)


@pytest.fixture(scope="module")
def two_attributions(tiny_model_dir, tmp_path_factory):
    """The same E and U through the probe twice, the default token attribution and the exact one, with the number
    of forward-mode passes along v each made."""
    from entropy_experiments.probe import tangent

    data = write_prompts(tmp_path_factory.mktemp("token_fd") / "prompts.jsonl", SHORT_PROMPTS)
    sizes = {"batch_config": {"B_E": 8, "B_U": 4, "G": 2}, "second_order": {"enabled": False},
             "predictors": {"enabled": False}, "importance": {"eta_list": [1e-5], "symmetric": False}}
    probe = make_probe(tiny_model_dir, data, sizes)
    exact_config = probe.config.model_copy(update={"output": probe.config.output.model_copy(
        update={"token_attribution_method": "jvp"})})
    captured, calls = {}, []
    real = tangent.directional_rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tangent, "directional_rows", lambda *a, **k: calls.append("jvp") or real(*a, **k))
        default = probe.run(on_batches=lambda E, U: captured.update(E=E, U=U))
        passes = {"default": len(calls)}
        exact = probe.with_config(exact_config).run(batches=(captured["E"], captured["U"]))
        passes["exact"] = len(calls) - passes["default"]
    return default, exact, passes


def test_default_token_attribution_matches_the_exact_one(two_attributions):
    default, exact, _ = two_attributions
    got, want = default.results["attribution"]["E_tokens"], exact.results["attribution"]["E_tokens"]
    assert (got["dH_method"], got["dH_eta"]) == ("forward_difference", 1e-5)
    assert (want["dH_method"], want["dH_eta"]) == ("jvp", None)
    assert default.results["deltaH1"] == exact.results["deltaH1"]
    a, b = np.asarray(default.e_tokens["dH"]), np.asarray(exact.e_tokens["dH"])
    np.testing.assert_allclose(default.e_tokens["H"], exact.e_tokens["H"], rtol=1e-6)
    rms = np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2))
    assert rms < 5e-2, rms  # measured on this model: docs/attribution.md "How dH is computed"
    assert got["direct_only"] == pytest.approx(want["direct_only"], rel=5e-2)
    print(f"\nforward difference at 1e-5 against the jvp: RMS error {rms:.2e} of RMS dH")


def test_default_makes_no_pass_along_v_for_the_attribution(two_attributions):
    _, _, passes = two_attributions
    assert passes == {"default": 0, "exact": 1}
