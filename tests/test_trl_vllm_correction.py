"""TRL's vLLM importance-sampling correction (estimators/vllm_correction.py) against TRL's own code (trl 1.16.0).

- Per-token: for every `vllm_importance_sampling_mode` × loss_type (and with a KL term and an entropy bonus, which
  the ratio must leave alone), the gradient of the probe's objective — resolved from the config keys — with respect
  to every per-token log-prob equals the gradient of TRL's `_compute_loss` fed the ratio that TRL's own lines of
  `_generate_and_score_completions` form from the same old and sampler log-probs (tests/trl_reference.py), to 1e-6.
- Through the tiny model: the probe's U gradient (`recipe.update_gradients`) on a U batch carrying sampler_logqs
  equals autograd of TRL's loss over an independent, unpadded forward (checks the response-position alignment of
  sampler_logqs and the detached old log-probs); without sampler_logqs the gradient is bit-identical to the
  gradient without the correction.
- The keys: refused for other trainers and for bounds TRL's GRPOConfig refuses; the config hash of existing configs
  is unchanged.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.errors import ConfigError
from entropy_experiments.probe import recipe
from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts

pytest.importorskip("trl")

from tests.trl_reference import (
    assert_same_gradient,
    padded_independent_logps,
    probe_loss,
    random_loss_batch,
    trl_advantages,
    trl_loss_over_micro_batches,
    trl_vllm_importance_sampling_ratio,
)

B, G = 4, 4
MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
BOUNDS = [(None, 3.0), (0.5, 2.0), (0.7, None)]  # TRL's default, both, lower only


def _batch(seed: int):
    """`random_loss_batch` and sampler log-probs whose per-token gaps (±0.1 to ±2 nats) put token and sequence
    ratios on both sides of every bound (padding: 0, as TRL pads the vLLM log-probs)."""
    (logps, mask, rewards, lengths, ref, entropies), gen = random_loss_batch(seed, B, G)
    gap = 0.6 * torch.randn(logps.shape, generator=gen, dtype=torch.float64)
    sampler = (logps.detach() - gap) * mask
    return logps, mask, rewards, lengths, ref, entropies, sampler


def _options(loss_type, mode, clip_min, clip_max, **extra):
    keys = {"trainer": "trl", "loss_type": loss_type, "max_completion_length": 12,
            "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": mode,
            "vllm_importance_sampling_clip_min": clip_min, "vllm_importance_sampling_clip_max": clip_max, **extra}
    return config_from_dict({"batch_config": {"B_U": B, "G": G}, "objective": keys}).objective_options()


def _trl_ratio(logps, sampler, mask, mode, clip_min, clip_max):
    return trl_vllm_importance_sampling_ratio(logps.detach(), sampler, mask, mode=mode, clip_min=clip_min,
                                              clip_max=clip_max)


def _bounds_act(ratio, mask, mode, clip_min, clip_max):
    """The test batch must exercise the bound: some live ratios clipped or masked, some strictly inside."""
    live = ratio.expand_as(mask)[mask.bool()] if mode.startswith("token_") else ratio.flatten()
    inside = torch.ones_like(live, dtype=torch.bool)
    if clip_min is not None:
        inside &= live > clip_min
    if clip_max is not None:
        inside &= live < clip_max
    inside &= live != 0
    return bool(inside.any()) and bool((~inside).any())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_gradient_equals_trl_with_its_ratio(mode, loss_type):
    clip_min, clip_max = BOUNDS[(MODES.index(mode) + len(loss_type)) % len(BOUNDS)]
    logps, mask, rewards, lengths, _, _, sampler = _batch(seed=MODES.index(mode) * 10 + len(loss_type))
    M = 2 if loss_type in ("bnpo", "grpo") else 1
    options = _options(loss_type, mode, clip_min, clip_max, micro_batches=M)
    ratio = _trl_ratio(logps, sampler, mask, mode, clip_min, clip_max)
    assert _bounds_act(ratio, mask, mode, clip_min, clip_max), "the batch must put ratios on both sides of a bound"
    adv = trl_advantages(rewards.reshape(-1), G, "group")
    theirs = trl_loss_over_micro_batches(logps, mask, adv, num_micro_batches=M, loss_type=loss_type,
                                         max_completion_length=12, importance_sampling_ratio=ratio)
    ours = probe_loss(logps, rewards, lengths, options, sampler=sampler)
    assert_same_gradient(ours, theirs, [logps])
    plain = probe_loss(logps, rewards, lengths, options)  # the correction must change this batch's gradient
    g_plain, g_ours = (torch.autograd.grad(x, [logps], retain_graph=True)[0] for x in (plain, ours))
    assert (g_plain - g_ours).abs().max() > 1e-3 * g_plain.abs().max()


@pytest.mark.parametrize("mode", ["token_mask", "sequence_truncate"])
def test_ratio_leaves_kl_and_entropy_alone_as_trl(mode):
    """TRL multiplies only the policy term: the k3 KL (β) and the entropy bonus are added unweighted."""
    logps, mask, rewards, lengths, ref, entropies, sampler = _batch(seed=11)
    options = _options("dapo", mode, 0.5, 2.0, micro_batches=2, kl_coef=0.04, entropy_coef=0.01)
    ratio = _trl_ratio(logps, sampler, mask, mode, 0.5, 2.0)
    adv = trl_advantages(rewards.reshape(-1), G, "group")
    theirs = trl_loss_over_micro_batches(logps, mask, adv, num_micro_batches=2, loss_type="dapo", beta=0.04,
                                         ref_per_token_logps=ref, entropies=entropies, entropy_coef=0.01,
                                         max_completion_length=12, importance_sampling_ratio=ratio)
    ours = probe_loss(logps, rewards, lengths, options, sampler=sampler, ref=ref, entropies=entropies)
    assert_same_gradient(ours, theirs, [logps, entropies])


def test_nan_sampler_logprob_counts_as_no_gap_as_trl():
    """A token whose sampler log-prob is NaN gets d_t = 0 (TRL: ratio 1 at that token) in every mode."""
    logps, mask, rewards, lengths, _, _, sampler = _batch(seed=5)
    sampler[0, 0] = float("nan")
    sampler[5, 0] = float("nan")
    for mode in MODES:
        options = _options("dapo", mode, None, 3.0)
        ratio = _trl_ratio(logps, sampler, mask, mode, None, 3.0)
        adv = trl_advantages(rewards.reshape(-1), G, "group")
        theirs = trl_loss_over_micro_batches(logps, mask, adv, num_micro_batches=1, loss_type="dapo",
                                             importance_sampling_ratio=ratio)
        assert_same_gradient(probe_loss(logps, rewards, lengths, options, sampler=sampler), theirs, [logps])


def test_keys_refused_where_trl_or_the_probe_refuses():
    with pytest.raises(ConfigError, match=r"objective\.vllm_importance_sampling_correction.*verl"):
        config_from_dict({"objective": {"trainer": "verl", "vllm_importance_sampling_correction": True}})
    with pytest.raises(ConfigError, match=r"objective\.vllm_importance_sampling_correction.*trainer: trl"):
        config_from_dict({"objective": {"loss_type": "dapo", "vllm_importance_sampling_correction": True}})
    with pytest.raises(ConfigError, match=r"objective\.vllm_importance_sampling_clip_min"):
        _options("dapo", "token_mask", 3.0, 2.0)
    with pytest.raises(ConfigError, match=r"objective\.vllm_importance_sampling_clip_max"):
        _options("dapo", "token_truncate", None, None)
    with pytest.raises(ConfigError, match=r"objective\.vllm_importance_sampling_mode"):
        config_from_dict({"objective": {"trainer": "trl", "vllm_importance_sampling_correction": True,
                                        "vllm_importance_sampling_mode": "token_clip"}})
    masked_unbounded = _options("dapo", "sequence_mask", None, None).vllm_correction
    assert (masked_unbounded.clip_min, masked_unbounded.clip_max) == (None, None)  # TRL allows it: no masking
    off = config_from_dict({"objective": {"trainer": "trl"}})
    assert off.objective_options().vllm_correction is None


def test_the_correction_keys_enter_the_config_hash():
    """Each correction key is in the config (so in its hash); set off its default, it changes the hash."""
    cfg = config_from_dict({"objective": {"trainer": "trl"}})
    d = cfg.model_dump(mode="json")
    for key in ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
                "vllm_importance_sampling_clip_max"):
        assert key in d["objective"]
    changed = config_from_dict({"objective": {"trainer": "trl", "vllm_importance_sampling_clip_max": 2.0}})
    assert changed.config_hash() != cfg.config_hash()
    on = config_from_dict({"objective": {"trainer": "trl", "vllm_importance_sampling_correction": True}})
    assert on.config_hash() != cfg.config_hash()


# ----------------------------------------------------------------------------- through the tiny model

@pytest.fixture(scope="module")
def sampled_U(tiny_model_dir, tmp_path_factory):
    prompts = write_prompts(tmp_path_factory.mktemp("iscorr") / "p.jsonl", SHORT_PROMPTS)
    probe = make_probe(tiny_model_dir, prompts, {"batch_config": {"B_U": 4, "G": 3}})
    _, U = probe.sample(B_E=1, B_U=4, G=3)[:2]
    assert U.sampler_logqs is None
    return probe, U


def _with_sampler_logqs(U, logps, mask):
    """U carrying sampler log-probs log q_s = ℓ − gap at its response positions (0 elsewhere), gaps in ±{0.3, 2}."""
    pattern = torch.tensor([0.3, -2.0, -0.3, 2.0, 0.3, 0.3, -0.3], dtype=torch.float64)
    gaps = pattern[torch.arange(logps.numel()) % len(pattern)].reshape(logps.shape)
    sampler = ((logps.detach() - gaps) * mask).float()
    q = torch.zeros(U.sequences.shape, dtype=torch.float32)
    G = U.num_responses_per_prompt
    for n in range(U.num_sequences):
        b, g = divmod(n, G)
        start, T = U.prompt_lens[b], U.gen_lens[b][g]
        q[b, g, start:start + T] = sampler[n, :T]
    return dataclasses.replace(U, sampler_logqs=q), sampler.double()


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_u_gradient_through_the_model_equals_trl(sampled_U, mode):
    probe, U = sampled_U
    names = [n for n, p in probe.model.named_parameters() if p.requires_grad]
    params = [p for p in probe.model.parameters() if p.requires_grad]
    temperature = probe.config.generation.temperature
    logps, mask = padded_independent_logps(probe.model, U, temperature)
    U_s, sampler = _with_sampler_logqs(U, logps, mask)
    clip_min, clip_max = (0.5, 3.0) if mode == "token_truncate" else (None, 30.0)
    ratio = _trl_ratio(logps, sampler, mask, mode, clip_min, clip_max)
    adv = trl_advantages(torch.tensor(U.rewards).reshape(-1), U.num_responses_per_prompt, "group")
    theirs = trl_loss_over_micro_batches(logps, mask, adv, num_micro_batches=1, loss_type="dapo",
                                         importance_sampling_ratio=ratio)
    want = torch.autograd.grad(theirs, params)
    keys = {"trainer": "trl", "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": mode,
            "vllm_importance_sampling_clip_min": clip_min, "vllm_importance_sampling_clip_max": clip_max}
    cfg = config_from_dict({**probe.config.to_dict(), "estimator": {"microbatch_size": 1}, "objective": keys})
    got = recipe.update_gradients(cfg, probe.policy, U_s, [list(range(U.num_prompts))]).total
    plain = recipe.update_gradients(cfg, probe.policy, U, [list(range(U.num_prompts))]).total
    gap = max((got[n] - plain[n]).abs().max().item() / w.abs().max().item() for n, w in zip(names, want))
    assert gap > 1e-2, "the ratios must change this U's gradient, else the test could not catch them missing"
    for name, w in zip(names, want, strict=True):
        assert torch.allclose(got[name].double(), w.double(), rtol=1e-4, atol=1e-5 * w.abs().max().item()), name


def test_without_sampler_logqs_the_gradient_is_bit_identical(sampled_U):
    probe, U = sampled_U
    base = {**probe.config.to_dict(), "estimator": {"microbatch_size": 2}}
    off = config_from_dict({**base, "objective": {"trainer": "trl"}})
    on = config_from_dict({**base, "objective": {"trainer": "trl", "vllm_importance_sampling_correction": True,
                                                 "vllm_importance_sampling_mode": "token_mask",
                                                 "vllm_importance_sampling_clip_max": 0.5}})
    groups = [[0, 1], [2, 3]]
    a = recipe.update_gradients(off, probe.policy, U, groups)
    b = recipe.update_gradients(on, probe.policy, U, groups)
    assert a.loss == b.loss
    for name in a.total:
        assert torch.equal(a.total[name], b.total[name]), name
        for k in range(len(groups)):
            assert torch.equal(a.groups[k][name], b.groups[k][name]), (name, k)


# ----------------------------------------------------------------------------- the run's log (trainer_state.json)

def _trainer_state(path, rows):
    path.write_text(json.dumps({"global_step": len(rows), "log_history": rows}))
    return path


def test_trainer_log_warnings(tmp_path):
    """TRL logs sampling/importance_sampling_ratio/* whenever the correction acts; the probe warns where the run's
    log and the config disagree, and says nothing where they agree or nothing is logged."""
    import inspect

    from trl import GRPOTrainer

    from entropy_experiments.checkpoint.trainer_log import IS_METRIC, vllm_correction_warnings

    assert f'"{IS_METRIC}mean"' in inspect.getsource(GRPOTrainer._generate_and_score_completions)
    plain = [{"loss": 0.1, "learning_rate": 1e-5, "reward": 1.0, "step": s} for s in (1, 2)]
    corrected = [{**row, f"{IS_METRIC}mean": 0.98, f"{IS_METRIC}min": 0.4} for row in plain]
    vllm_run = _trainer_state(tmp_path / "vllm.json", [*corrected, {"train_runtime": 3.0, "step": 2}])
    hf_run = _trainer_state(tmp_path / "hf.json", plain)
    (off_warning,) = vllm_correction_warnings(vllm_run, enabled=False)
    assert "objective.vllm_importance_sampling_correction is false" in off_warning and "2 of 2" in off_warning
    (on_warning,) = vllm_correction_warnings(hf_run, enabled=True)
    assert "objective.vllm_importance_sampling_correction is true" in on_warning and "2 training" in on_warning
    assert vllm_correction_warnings(vllm_run, enabled=True) == []
    assert vllm_correction_warnings(hf_run, enabled=False) == []
    assert vllm_correction_warnings(tmp_path / "absent.json", enabled=True) == []
    assert vllm_correction_warnings(None, enabled=True) == []
    no_training = _trainer_state(tmp_path / "empty.json", [{"train_runtime": 3.0}])
    assert vllm_correction_warnings(no_training, enabled=True) == []
    (tmp_path / "bad.json").write_text("{not json")
    assert vllm_correction_warnings(tmp_path / "bad.json", enabled=False) == []
