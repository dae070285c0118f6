"""Our trainer objectives against TRL's own loss code (trl 1.16.0 `GRPOTrainer._compute_loss`).

For every loss_type × scale_rewards, the gradient of objectives.py's L_U with respect to every
per-token log-prob (and entropy) equals the gradient of the loss TRL's trainer would back-propagate
over one optimizer step (its micro-batches summed), with TRL's own advantages, to 1e-6 relative.
Since the U gradient is (∂L/∂ℓ)·(∂ℓ/∂θ) and ∂ℓ/∂θ is the model's, equal ∂L/∂ℓ means equal U gradients.
(The loss VALUES differ by design: TRL's surrogate is −exp(ℓ − sg ℓ)·A, whose value at ratio 1 is −A,
ours is −A·ℓ; only the gradient is the trainer's step.)
"""

from __future__ import annotations

import pytest
import torch

from entropy_experiments.estimators import objectives

pytest.importorskip("trl")

from tests.trl_reference import (
    assert_same_gradient,
    probe_loss,
    random_loss_batch,
    trl_advantages,
    trl_loss_over_micro_batches,
)

B, G = 4, 4


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
@pytest.mark.parametrize("scale", ["none", "group", "batch"])
def test_gradient_equals_trl_loss_code(loss_type, scale):
    logps, mask, rewards, lengths, _, _ = random_loss_batch(B=B, G=G, seed=hash((loss_type, scale)) % 1000)[0]
    M = 2 if loss_type == "bnpo" else 1
    options = objectives.ObjectiveOptions(loss_type=loss_type, scale_rewards=scale, micro_batches=M,
                                          max_completion_length=12)
    adv = trl_advantages(rewards.reshape(-1), G, scale)
    # TRL's nanstd forms Bessel's count/(count − 1) in float32: ~3e-8 relative from our float64 advantages.
    assert torch.allclose(objectives.advantages(rewards, scale, 1e-4).reshape(-1), adv.double(), rtol=1e-7,
                          atol=1e-7)
    theirs = trl_loss_over_micro_batches(logps, mask, adv, num_micro_batches=M, loss_type=loss_type,
                                         max_completion_length=12)
    ours = probe_loss(logps, rewards, lengths, options)
    assert_same_gradient(ours, theirs, [logps])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("loss_type,M", [("dapo", 1), ("grpo", 2), ("bnpo", 2), ("dr_grpo", 1)])
def test_kl_and_entropy_bonus_equal_trl(loss_type, M, bias):
    """β > 0 (k3 to the reference, with and without TRL's use_bias_correction_kl) and an entropy bonus (TRL:
    token mean per micro-batch)."""
    logps, mask, rewards, lengths, ref, entropies = random_loss_batch(B=B, G=G, seed=7)[0]
    options = objectives.ObjectiveOptions(loss_type=loss_type, scale_rewards="group", micro_batches=M,
                                          kl_coef=0.04, entropy_coef=0.01, entropy_aggregation="token_mean",
                                          max_completion_length=12, use_bias_correction_kl=bias)
    adv = trl_advantages(rewards.reshape(-1), G, "group")
    theirs = trl_loss_over_micro_batches(logps, mask, adv, num_micro_batches=M, loss_type=loss_type, beta=0.04,
                                         ref_per_token_logps=ref, entropies=entropies, entropy_coef=0.01,
                                         max_completion_length=12, use_bias_correction_kl=bias)
    ours = probe_loss(logps, rewards, lengths, options, ref=ref, entropies=entropies)
    assert_same_gradient(ours, theirs, [logps, entropies])


def _trl_options(loss_type, M, **keys):
    """The objective `objective.trainer: trl` resolves to, with `keys` set as a user would."""
    from entropy_experiments.config import config_from_dict

    objective = {"trainer": "trl", "loss_type": loss_type, "micro_batches": M, "max_completion_length": 12, **keys}
    return config_from_dict({"batch_config": {"B_U": B, "G": G}, "objective": objective}).objective_options()


@pytest.mark.parametrize("bias", [None, True, False])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_use_bias_correction_kl_equals_trl(loss_type, bias):
    """trainer trl with β > 0: use_bias_correction_kl unset (TRL's default, true), true or false gives the gradient
    of TRL's `_compute_loss` with that GRPOConfig switch, for every loss type the probe mirrors."""
    logps, mask, rewards, lengths, ref, _ = random_loss_batch(B=B, G=G, seed=hash((loss_type, "bias")) % 1000)[0]
    M = 2 if loss_type == "bnpo" else 1
    options = _trl_options(loss_type, M, kl_coef=0.04, use_bias_correction_kl=bias)
    trls = True if bias is None else bias
    assert options.use_bias_correction_kl is trls and options.weights_kl is trls
    adv = trl_advantages(rewards.reshape(-1), G, "group")
    theirs = trl_loss_over_micro_batches(logps, mask, adv, num_micro_batches=M, loss_type=loss_type, beta=0.04,
                                         ref_per_token_logps=ref, max_completion_length=12,
                                         use_bias_correction_kl=trls)
    ours = probe_loss(logps, rewards, lengths, options, ref=ref)
    assert_same_gradient(ours, theirs, [logps])
    # the switch matters for this batch: the other setting's TRL gradient differs by far more than the 1e-6 tolerance
    other = trl_loss_over_micro_batches(logps, mask, adv, num_micro_batches=M, loss_type=loss_type, beta=0.04,
                                        ref_per_token_logps=ref, max_completion_length=12,
                                        use_bias_correction_kl=not trls)
    g_ours, g_other = (torch.autograd.grad(x, [logps], retain_graph=True)[0] for x in (ours, other))
    assert (g_ours - g_other).abs().max() > 1e-4 * g_ours.abs().max()


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_use_bias_correction_kl_without_kl_changes_nothing(loss_type):
    """β = 0: the switch does not act — the gradient is bit-identical either way, and TRL's."""
    logps, mask, rewards, lengths, _, _ = random_loss_batch(B=B, G=G, seed=5)[0]
    on, off = (_trl_options(loss_type, 1, use_bias_correction_kl=b) for b in (True, False))
    assert not on.weights_kl and not on.needs_reference
    g_on, g_off = (torch.autograd.grad(probe_loss(logps, rewards, lengths, o), [logps])[0] for o in (on, off))
    assert torch.equal(g_on, g_off)
    adv = trl_advantages(rewards.reshape(-1), G, "group")
    theirs = trl_loss_over_micro_batches(logps, mask, adv, num_micro_batches=1, loss_type=loss_type,
                                         max_completion_length=12)
    assert_same_gradient(probe_loss(logps, rewards, lengths, on), theirs, [logps])


def test_trl_preset_is_trls_default_objective():
    """`objective.trainer: trl` = what a GRPOConfig() with no arguments trains with."""
    from trl import GRPOConfig

    from entropy_experiments.config import config_from_dict

    defaults = GRPOConfig(output_dir="unused", report_to=[], use_cpu=True, bf16=False)
    # TRL generates max_completion_length tokens: the probe's generation.max_new_tokens plays that part
    options = config_from_dict({"objective": {"trainer": "trl"},
                                "generation": {"max_new_tokens": defaults.max_completion_length}}).objective_options()
    assert options.loss_type == defaults.loss_type
    assert options.scale_rewards == defaults.scale_rewards
    assert options.kl_coef == defaults.beta
    assert options.entropy_coef == defaults.entropy_coef
    assert options.max_completion_length == defaults.max_completion_length
    assert options.max_grad_norm == defaults.max_grad_norm
    assert options.use_bias_correction_kl == defaults.use_bias_correction_kl


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.1])
@pytest.mark.parametrize("loss_type,M,coef,beta", [("dapo", 1, 0.01, 0.0), ("grpo", 2, 0.0, 0.04),
                                                   ("bnpo", 2, 0.03, 0.04), ("dr_grpo", 1, 0.02, 0.0)])
def test_top_entropy_quantile_equals_trl(quantile, loss_type, M, coef, beta):
    """TRL's 80/20 mask (top_entropy_quantile < 1), computed per micro-batch by TRL's own get_high_entropy_mask,
    on the policy term and the entropy bonus (not the KL): the probe's gradient is TRL's, for ∂ℓ and ∂H."""
    logps, mask, rewards, lengths, ref, entropies = random_loss_batch(B=B, G=G, seed=11)[0]
    options = _trl_options(loss_type, M, top_entropy_quantile=quantile, entropy_coef=coef, kl_coef=beta)
    adv = trl_advantages(rewards.reshape(-1), G, "group")
    theirs = trl_loss_over_micro_batches(logps, mask, adv, num_micro_batches=M, loss_type=loss_type, beta=beta,
                                         ref_per_token_logps=ref, entropies=entropies, entropy_coef=coef,
                                         max_completion_length=12,
                                         entropy_controls={"top_entropy_quantile": quantile})
    ours = probe_loss(logps, rewards, lengths, options, ref=ref, entropies=entropies)
    wrt = [logps, entropies] if coef else [logps]
    assert_same_gradient(ours, theirs, wrt)
    # the mask acts: without it, TRL's gradient is another
    unmasked = probe_loss(logps, rewards, lengths, _trl_options(loss_type, M, entropy_coef=coef, kl_coef=beta),
                          ref=ref, entropies=entropies)
    g_ours, g_plain = (torch.autograd.grad(x, [logps], retain_graph=True)[0] for x in (ours, unmasked))
    assert (g_ours - g_plain).abs().max() > 1e-3 * g_ours.abs().max()


@pytest.mark.parametrize("last_entropy,applies", [(0.15, True), (0.2, True), (0.9, False), (float("inf"), False)])
def test_adaptive_entropy_coefficient_equals_trl(last_entropy, applies):
    """use_adaptive_entropy: TRL applies the saved coefficient only when the last window's entropy ≤ entropy_target;
    the probe's coefficient (entropy_terms.adaptive_entropy_coef) gives TRL's gradient in both cases."""
    from entropy_experiments.estimators.entropy_terms import adaptive_entropy_coef

    logps, mask, rewards, lengths, _, entropies = random_loss_batch(B=B, G=G, seed=13)[0]
    coef = adaptive_entropy_coef(0.035, last_entropy, 0.2)
    assert (coef == 0.035) is applies and (coef == 0.0) is (not applies)
    options = _trl_options("dapo", 1, entropy_coef=coef)
    adv = trl_advantages(rewards.reshape(-1), G, "group")
    theirs = trl_loss_over_micro_batches(logps, mask, adv, num_micro_batches=1, loss_type="dapo",
                                         entropies=entropies, entropy_coef=0.035, max_completion_length=12,
                                         entropy_controls={"use_adaptive_entropy": True,
                                                           "last_world_entropy": last_entropy})
    ours = probe_loss(logps, rewards, lengths, options, entropies=entropies)
    if applies:
        assert_same_gradient(ours, theirs, [logps, entropies])
    else:
        assert_same_gradient(ours, theirs, [logps])
        assert torch.autograd.grad(theirs, [entropies], retain_graph=True)[0].abs().max() == 0


def test_high_entropy_mask_at_float64_is_trls_at_float32():
    """The probe scores entropies in float64; TRL's model gives float32 ones and keeps a token when it is ≥ the float32
    quantile. The token AT the threshold (odd count, q 0.5: the median is a token) whose float32 rounding goes UP must
    still be kept, as TRL keeps it — compared at float64 it would fall below its own rounded value."""
    from types import SimpleNamespace

    from trl import GRPOTrainer

    from entropy_experiments.estimators.entropy_terms import high_entropy_masks
    from tests.trl_reference import OneProcessAccelerator

    middle = next(x for x in (0.5 + k * 1e-9 for k in range(1, 100)) if float(torch.tensor(x).float()) > x)
    values = torch.tensor([0.1, 0.9, middle, 0.3, 0.7], dtype=torch.float64)
    ours = high_entropy_masks((values,), micro_batches=1, quantile=0.5)[0]
    stand_in = SimpleNamespace(accelerator=OneProcessAccelerator())
    theirs = GRPOTrainer.get_high_entropy_mask(stand_in, values.float()[None], torch.ones(1, 5), 0.5)[0]
    assert theirs.tolist() == [False, True, True, False, True]
    assert ours.tolist() == theirs.double().tolist()
