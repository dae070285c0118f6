"""objective.use_bias_correction_kl (TRL's GRPOConfig switch) as a config key: its resolution per trainer, the
refusals, the config hash and the offline warning. The gradient itself is checked against TRL's own
`_compute_loss` in tests/test_trl_objectives.py."""

from __future__ import annotations

import pytest

from entropy_experiments.config import config_from_dict
from entropy_experiments.errors import ConfigError


def _config(**objective):
    """A config with the given objective keys (the second order by jvp, three η at ±η, the predictors on)."""
    return config_from_dict({"objective": objective, "generation": {"gen_batch_size": 8},
                             "second_order": {"method": "jvp", "eta_list": [3e-4, 1e-3]},
                             "importance": {"eta_list": [1e-6, 3e-6, 1e-5], "symmetric": True},
                             "predictors": {"enabled": True}})


@pytest.mark.parametrize("objective, resolved", [
    ({}, False),
    ({"trainer": "trl"}, True),
    ({"trainer": "trl", "use_bias_correction_kl": False}, False),
    ({"trainer": "verl", "kl_coef": 0.001}, False),
    ({"trainer": "openrlhf", "kl_coef": 0.01}, False),
    ({"trainer": "verl", "kl_coef": 0.001, "use_bias_correction_kl": False}, False),
])
def test_null_is_the_trainers_default(objective, resolved):
    assert _config(**objective).objective_options().use_bias_correction_kl is resolved


@pytest.mark.parametrize("trainer", [None, "verl", "openrlhf"])
def test_an_explicit_true_is_refused_for_other_trainers(trainer):
    keys = {"kl_coef": 0.01, "use_bias_correction_kl": True} | ({"trainer": trainer} if trainer else {})
    with pytest.raises(ConfigError, match=r"objective\.use_bias_correction_kl: true is TRL's .* only trainer trl"):
        _config(**keys)


def test_the_switch_enters_the_hash_as_written():
    """The hash is over the config as written: null (the trainer's default), true and false hash apart, also where
    the switch does not act (β = 0); a stated null hashes like the key left out."""
    for objective in ({"trainer": "trl"}, {"trainer": "trl", "kl_coef": 0.04}):
        hashes = {_config(**objective, use_bias_correction_kl=value).config_hash() for value in (None, True, False)}
        assert len(hashes) == 3
        assert _config(**objective).config_hash() == _config(**objective, use_bias_correction_kl=None).config_hash()


def test_an_unset_switch_is_the_trainers_default_and_is_not_warned_about():
    """An unset switch is the trainer's default (TRL: true), recorded in results.json: no warning, β or not."""
    def warned(**objective):
        return [w for w in _config(**objective).objective_warnings("trainer") if "use_bias_correction_kl" in w]

    for objective in ({"trainer": "trl", "kl_coef": 0.04}, {"trainer": "trl"},
                      {"trainer": "trl", "kl_coef": 0.04, "use_bias_correction_kl": True},
                      {"trainer": "trl", "kl_coef": 0.04, "use_bias_correction_kl": False}):
        assert not warned(**objective), objective
    assert _config(trainer="trl", kl_coef=0.04).objective_options().use_bias_correction_kl is True


@pytest.mark.parametrize("switch", [True, False])
def test_the_trainer_view_passes_grpoconfigs_switch(switch):
    """The callback's objective is resolved from the GRPOConfig's own use_bias_correction_kl."""
    trl = pytest.importorskip("trl")
    from entropy_experiments.integrations.trl_trainer_view import objective_keys, probe_config

    args = trl.GRPOConfig(output_dir="unused", report_to=[], use_cpu=True, bf16=False, beta=0.04,
                          use_bias_correction_kl=switch)
    assert objective_keys(args)["use_bias_correction_kl"] is switch
    options = probe_config(args, B_E=4, B_U=2, G=None, seed=0, microbatch_size=2).objective_options()
    assert options.use_bias_correction_kl is switch and options.weights_kl is switch


# ----------------------------------------------------------------------------- through the tiny model

@pytest.fixture(scope="module")
def sampled_U(tiny_model_dir, tmp_path_factory):
    from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts

    prompts = write_prompts(tmp_path_factory.mktemp("klbias") / "p.jsonl", SHORT_PROMPTS)
    probe = make_probe(tiny_model_dir, prompts, {"batch_config": {"B_U": 4, "G": 3}})
    return probe, probe.sample(B_E=1, B_U=4, G=3)[1]


@pytest.mark.parametrize("switch", [None, False])
def test_u_gradient_through_the_model_equals_trl(sampled_U, switch):
    """The probe's U gradient (trainer trl, β = 0.04) equals autograd of TRL's `_compute_loss` over an independent
    forward, the reference log-probs from the same network with the adapter disabled (TRL's PEFT reference)."""
    pytest.importorskip("trl")
    import torch

    from entropy_experiments.probe import recipe
    from tests.trl_reference import padded_independent_logps, trl_advantages, trl_loss_over_micro_batches

    probe, U = sampled_U
    model, temperature = probe.model, probe.config.generation.temperature
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    logps, mask = padded_independent_logps(model, U, temperature)
    with torch.no_grad(), model.disable_adapter():
        ref, _ = padded_independent_logps(model, U, temperature)
    adv = trl_advantages(torch.tensor(U.rewards).reshape(-1), U.num_responses_per_prompt, "group")
    trls = switch is None or switch  # null: TRL's default, true
    want, other = (torch.autograd.grad(trl_loss_over_micro_batches(
        logps, mask, adv, num_micro_batches=1, loss_type="dapo", beta=0.04, ref_per_token_logps=ref,
        use_bias_correction_kl=bias), params, retain_graph=True) for bias in (trls, not trls))
    cfg = config_from_dict({**probe.config.to_dict(), "estimator": {"microbatch_size": 2},
                            "objective": {"trainer": "trl", "kl_coef": 0.04, "use_bias_correction_kl": switch}})
    got = recipe.update_gradients(cfg, probe.policy, U, [[0, 1], [2, 3]]).total
    gap = max((w - o).abs().max().item() / w.abs().max().item() for w, o in zip(want, other))
    assert gap > 1e-3, f"the switch must change this U's gradient ({gap:.2e}), else the test could not catch it"
    for name, w in zip(names, want, strict=True):
        assert torch.allclose(got[name].double(), w.double(), rtol=1e-4, atol=1e-5 * w.abs().max().item()), name
