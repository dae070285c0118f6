"""`objective.trainer: verl` / `openrlhf` against those frameworks' OWN loss code (verl 0.9.1, OpenRLHF 0.11.2).

Neither framework installs beside the probe, so scripts/make_framework_loss_references.py ran their loss
functions once, in a virtual environment of their own, on fixed tensors, and saved the loss and its gradient
with respect to every per-token log-prob (and entropy) in tests/fixtures/framework_losses/. Here the probe's
objective, resolved through the preset from the framework's own settings, must give the same gradient (1e-6
relative): equal ∂L/∂ℓ means an equal U gradient, since ∂ℓ/∂θ is the model's. The VALUES differ by design
(the frameworks' surrogate −exp(ℓ − sg ℓ)·A is −A at ratio 1, ours is −A·ℓ): the frameworks' value is ours
with the policy term evaluated at ℓ = 1.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.errors import ConfigError
from entropy_experiments.estimators import objectives

FIXTURES = Path(__file__).parent / "fixtures" / "framework_losses"
# verl's kl_loss_type / OpenRLHF's --algo.kl.estimator → objective.kl_estimator (docs/objectives.md); the "+"
# types and OpenRLHF's unbiased_gradient back-propagate k2's gradient, whatever their value.
VERL_KL = {"low_var_kl": "low_var_kl", "k3": "low_var_kl", "k1": "k1", "k2": "k2", "k3+": "k2", "low_var_kl+": "k2"}
OPENRLHF_KL = {"k3": "low_var_kl", "k1": "k1", "k2": "k2"}


def _reference(framework: str) -> dict:
    return torch.load(FIXTURES / f"{framework}.pt", weights_only=True)


def _our_loss(batch, options, logps=None, rewards=None):
    """Our L_U over the fixture's batch (padded [B·G, W] tensors, rewards and lengths [B, G])."""
    lengths = batch["lengths"]
    logps = batch["logps"] if logps is None else logps
    terms = objectives.batch_terms(batch["rewards"] if rewards is None else rewards, lengths, options)
    B, G = lengths.shape
    total = 0.0
    for p in range(B):
        for g in range(G):
            n, T = p * G + g, int(lengths[p, g])
            total = total + objectives.sequence_loss(logps[n, :T], terms[p][g], options,
                                                     ref_logps=batch["ref_logps"][n, :T],
                                                     entropies=batch["entropies"][n, :T])
    return total


def _gradients(batch, loss_fn):
    logps = batch["logps"].clone().requires_grad_(True)
    entropies = batch["entropies"].clone().requires_grad_(True)
    loss = loss_fn({**batch, "logps": logps, "entropies": entropies})
    grads = torch.autograd.grad(loss, [logps, entropies], allow_unused=True)
    return [torch.zeros_like(logps) if g is None else g for g in grads]


def _ratio_one_value(batch, options):
    """The frameworks' loss value at ratio 1: our loss with its (linear) policy term taken at ℓ = 1."""
    policy_only = replace(options, kl_coef=0.0, entropy_coef=0.0)
    at_one = torch.where(batch["mask"] > 0, 1.0, 0.0).double()
    return float(_our_loss(batch, options) - _our_loss(batch, policy_only) + _our_loss(batch, policy_only, at_one))


def _assert_close(ours, theirs, keep=None):
    scale = theirs.abs().max().item()
    assert scale > 0
    if keep is not None:
        ours, theirs = ours[keep], theirs[keep]
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6 * scale), (ours - theirs).abs().max()


def _check_case(batch, case, options, masked_token=None):
    g_logps, g_entropies = _gradients(batch, lambda b: _our_loss(b, options))
    keep = None
    if masked_token is not None:
        keep = torch.ones_like(g_logps, dtype=torch.bool)
        keep[masked_token] = False
    _assert_close(g_logps, case["grad_logps"], keep)
    if options.needs_entropy:
        _assert_close(g_entropies, case["grad_entropies"])
    return g_logps


# ----------------------------------------------------------------------------- verl

VERL = _reference("verl")


def _verl_options(case) -> objectives.ObjectiveOptions:
    # the default mode through the preset itself, the others by verl's name
    explicit = {"trainer": "verl", "loss_type": None if case["loss_agg_mode"] == "token-mean" else case["loss_agg_mode"],
                "scale_rewards": "group" if case["norm_adv_by_std_in_grpo"] else "none",
                "max_completion_length": case["loss_scale_factor"],
                "kl_coef": case["kl_loss_coef"] if case["use_kl_loss"] else None,
                "kl_estimator": VERL_KL[case["kl_loss_type"]] if case["use_kl_loss"] else None,
                "entropy_coef": case["entropy_coeff"] or None}
    width = VERL["batch"]["mask"].shape[1]   # verl's loss_scale_factor None: the padded response width
    return objectives.resolve(explicit, default_completion_length=width)


@pytest.mark.parametrize("name", sorted(VERL["cases"]))
def test_gradient_and_value_equal_verls_ppo_loss(name):
    case, batch = VERL["cases"][name], VERL["batch"]
    options = _verl_options(case)
    assert torch.allclose(objectives.advantages(batch["rewards"], options.scale_rewards, options.advantage_eps)
                          .reshape(-1), case["advantages"], rtol=1e-12, atol=1e-12)
    _check_case(batch, case, options)
    if case["kl_loss_type"].endswith("+"):
        return   # the straight-through KL: the value of the type before "+", k2's gradient (compared above)
    # verl's seq-mean-token-mean divides each sequence by T + 1e-8: values agree to ~1e-9 there
    assert _ratio_one_value(batch, options) == pytest.approx(float(case["loss"]), rel=1e-8, abs=1e-8)


def test_verl_preset_is_verls_default_actor():
    """`objective.trainer: verl` = what verl's FSDPActorConfig() and GRPO advantage default to."""
    defaults = VERL["defaults"]
    options = config_from_dict({"objective": {"trainer": "verl"}}).objective_options()
    assert VERL["version"] == "0.9.1"
    assert options.loss_type == objectives.canonical_loss_type(defaults["loss_agg_mode"])
    assert options.kl_coef == 0.0 and defaults["use_kl_loss"] is False
    assert options.kl_estimator == VERL_KL[defaults["kl_loss_type"]]
    assert options.entropy_coef == defaults["entropy_coeff"]
    assert options.max_grad_norm == defaults["grad_clip"]
    assert options.advantage_eps == defaults["grpo_epsilon"]
    assert (options.scale_rewards == "group") == defaults["norm_adv_by_std_in_grpo"]


# ----------------------------------------------------------------------------- OpenRLHF

OPENRLHF = _reference("openrlhf")
CLAMPED_TOKEN = (0, 1)   # ℓ − ref = 12: OpenRLHF clamps k1 and k2 to ±10 there (zero gradient), verl and we do not


def _openrlhf_options(case) -> objectives.ObjectiveOptions:
    kl = case["kl_estimator"]
    estimator = None if kl is None else ("k2" if case["unbiased_gradient"] else OPENRLHF_KL[kl])
    # OpenRLHF's default --actor.loss_agg_mode token-mean through the preset itself
    explicit = {"trainer": "openrlhf", "loss_type": None if case["token_level_loss"] else "seq-mean-token-mean",
                "kl_coef": case["kl_coef"] or None, "kl_estimator": estimator,
                "entropy_coef": case["entropy_coef"] or None}
    return objectives.resolve(explicit, default_completion_length=OPENRLHF["batch"]["mask"].shape[1])


@pytest.mark.parametrize("name", sorted(n for n in OPENRLHF["cases"] if not n.startswith("seq-mean-token-mean/kl")))
def test_gradient_and_value_equal_openrlhfs_policy_loss(name):
    case, batch = OPENRLHF["cases"][name], OPENRLHF["batch"]
    options = _openrlhf_options(case)
    assert torch.allclose(objectives.advantages(batch["rewards"], "group", options.advantage_eps).reshape(-1),
                          case["advantages"], rtol=1e-12, atol=1e-12)
    clamped = case["kl_estimator"] in ("k1", "k2") and not case["unbiased_gradient"]
    g_logps = _check_case(batch, case, options, masked_token=CLAMPED_TOKEN if clamped else None)
    if clamped:   # the one difference: OpenRLHF's clamp of k1 / k2 at ±10 leaves only the policy term's gradient
        policy_only = replace(options, kl_coef=0.0)
        g_policy, _ = _gradients(batch, lambda b: _our_loss(b, policy_only))
        theirs = float(case["grad_logps"][CLAMPED_TOKEN])
        assert theirs == pytest.approx(float(g_policy[CLAMPED_TOKEN]), rel=1e-6)
        assert abs(float(g_logps[CLAMPED_TOKEN]) - theirs) > 1e-4
        return
    if case["unbiased_gradient"]:
        return   # the straight-through KL: k3's value, k2's gradient (compared above)
    # OpenRLHF's KL is computed in float32 (compute_approx_kl): its value to float32's precision
    assert _ratio_one_value(batch, options) == pytest.approx(float(case["loss"]), rel=1e-6, abs=1e-9)


def test_openrlhf_seq_mean_with_kl_loss_is_refused_and_is_two_aggregations():
    """--actor.loss_agg_mode seq-mean-token-mean with --algo.kl.use_loss: OpenRLHF's KL and entropy terms stay
    token means over the step (aggregate_loss's default) while the policy term is per sequence. The probe refuses
    it; the reference is exactly our grpo policy term plus our dapo KL and entropy terms."""
    case, batch = OPENRLHF["cases"]["seq-mean-token-mean/kl-k3-entropy"], OPENRLHF["batch"]
    with pytest.raises(ConfigError, match=r"objective\.kl_coef"):
        _openrlhf_options(case)
    policy = objectives.resolve({"trainer": "openrlhf", "loss_type": "grpo"}, default_completion_length=12)
    kl_entropy = objectives.resolve({"trainer": "openrlhf", "kl_coef": case["kl_coef"], "kl_estimator": "low_var_kl",
                                     "entropy_coef": case["entropy_coef"]}, default_completion_length=12)
    no_advantage = torch.zeros_like(batch["rewards"])
    g_logps, g_entropies = _gradients(batch, lambda b: _our_loss(b, policy)
                                      + _our_loss(b, kl_entropy, rewards=no_advantage))
    _assert_close(g_logps, case["grad_logps"])
    _assert_close(g_entropies, case["grad_entropies"])


def test_openrlhf_preset_and_kl_in_reward_refusal():
    """The preset is OpenRLHF's GRPO setting (group_norm, token-mean over the step, k1 when use_loss is on);
    its default KL-in-reward is refused with the key named."""
    config = config_from_dict({"objective": {"trainer": "openrlhf"}})
    options = config.objective_options()
    assert (options.loss_type, options.scale_rewards, options.advantage_eps) == ("dapo", "group", 1e-9)
    assert (options.kl_coef, options.kl_estimator, options.max_grad_norm) == (0.0, "k1", 1.0)
    with pytest.raises(ConfigError, match=r"objective\.kl_in_reward_coef"):
        config_from_dict({"objective": {"trainer": "openrlhf", "kl_in_reward_coef": 0.01}})
