"""The trainer objectives (objectives.py) against written-out float64 loops and autograd.

- advantages (none / group / batch) against explicit per-prompt loops;
- every loss_type's loss, with KL and entropy terms, against the docs/objectives.md formula written out as
  loops over prompts, responses and tokens (independent of objectives.py), whole batch and per
  microbatch;
- the U gradient of the probe (`recipe.update_gradients`) against autograd of that written-out loss through an
  independent, unpadded forward of the tiny model, for microbatched and whole-batch backward passes;
- the leave-one-group-out scales against the objective recomputed without the group.
"""

from __future__ import annotations

import math

import pytest
import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.errors import ConfigError
from entropy_experiments.estimators import objectives
from entropy_experiments.probe import recipe
from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts

LOSS_TYPES = ["dr_grpo_per_prompt", "grpo", "bnpo", "dapo", "dr_grpo", "luspo"]


# ----------------------------------------------------------------------------- written-out references

def ref_advantages(rewards: list[list[float]], scale: str, eps: float) -> list[list[float]]:
    out = []
    everything = [r for row in rewards for r in row]
    mean_all = sum(everything) / len(everything)
    std_all = math.sqrt(sum((r - mean_all) ** 2 for r in everything) / (len(everything) - 1))
    for row in rewards:
        mean = sum(row) / len(row)
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (len(row) - 1))
        denom = {"none": 1.0, "group": std + eps, "batch": std_all + eps}[scale]
        out.append([(r - mean) / denom for r in row])
    return out


def ref_loss(logps, rewards, *, loss_type, scale="none", eps=1e-4, micro_batches=1, L_const=None,
             beta=0.0, ref=None, entropies=None, c=0.0, entropy_agg="loss"):
    """docs/objectives.md, literally: loops in float64 over prompts p, responses g, tokens t."""
    A = ref_advantages(rewards, scale, eps)
    B, G = len(logps), len(logps[0])
    flat = [(p, g) for p in range(B) for g in range(G)]
    per_mb = len(flat) // micro_batches
    mb_tokens = {}
    for m in range(micro_batches):
        members = flat[m * per_mb:(m + 1) * per_mb]
        n_tok = sum(len(logps[p][g]) for p, g in members)
        mb_tokens.update({pg: n_tok for pg in members})
    all_tokens = sum(len(logps[p][g]) for p, g in flat)

    def per_token(p, g, t):
        value = -A[p][g] * logps[p][g][t]
        if beta:
            d = ref[p][g][t] - logps[p][g][t]
            value = value + beta * (torch.exp(d) - d - 1)
        return value

    def weight(p, g):
        T = len(logps[p][g])
        L_max = max(len(logps[p][h]) for h in range(G))
        return {"dr_grpo_per_prompt": 1 / (B * G * L_max), "grpo": 1 / (B * G * T),
                "bnpo": 1 / (micro_batches * mb_tokens[(p, g)]), "dapo": 1 / all_tokens,
                "dr_grpo": 1 / (B * G * (L_const or 0) or float("nan")), "luspo": 1 / (B * G)}[loss_type]

    total = torch.zeros((), dtype=torch.float64)
    for p, g in flat:
        for t in range(len(logps[p][g])):
            total = total + weight(p, g) * per_token(p, g, t)
            if c:
                u = weight(p, g) if entropy_agg == "loss" else 1 / (micro_batches * mb_tokens[(p, g)])
                total = total - c * u * entropies[p][g][t]
    return total


def _options(**kw) -> objectives.ObjectiveOptions:
    return objectives.ObjectiveOptions(**kw)


def _ours(logps, rewards, options, ref=None, entropies=None, prompt_chunks=None):
    lengths = torch.tensor([[len(x) for x in row] for row in logps])
    terms = objectives.batch_terms(torch.tensor(rewards, dtype=torch.float64), lengths, options)
    chunks = prompt_chunks or [list(range(len(logps)))]
    total = 0.0
    for chunk in chunks:  # microbatches of prompts add up to the batch loss
        for p in chunk:
            for g, term in enumerate(terms[p]):
                total = total + objectives.sequence_loss(
                    logps[p][g], term, options, ref_logps=None if ref is None else ref[p][g],
                    entropies=None if entropies is None else entropies[p][g])
    return total


def _random_batch(seed, B=4, G=3, with_ties=True):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (B, G), generator=gen)
    logps = [[-torch.rand(int(lengths[p, g]), generator=gen, dtype=torch.float64) * 3 for g in range(G)]
             for p in range(B)]
    rewards = torch.randint(0, 3, (B, G), generator=gen).double().tolist()
    if with_ties:
        rewards[0] = [1.0] * G  # a constant group: zero advantages in every scaling
    return logps, rewards


# ----------------------------------------------------------------------------- pure tests

@pytest.mark.parametrize("scale", ["none", "group", "batch"])
def test_advantages_match_loops(scale):
    _, rewards = _random_batch(1)
    ours = objectives.advantages(torch.tensor(rewards), scale, 1e-4)
    assert torch.allclose(ours, torch.tensor(ref_advantages(rewards, scale, 1e-4), dtype=torch.float64),
                          rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(ours[0]) == 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("scale", ["none", "group", "batch"])
def test_loss_matches_written_out_formula(loss_type, scale):
    logps, rewards = _random_batch(2)
    options = _options(loss_type=loss_type, scale_rewards=scale, micro_batches=2 if loss_type == "bnpo" else 1,
                       max_completion_length=9)
    expected = ref_loss(logps, rewards, loss_type=loss_type, scale=scale, micro_batches=options.micro_batches,
                        L_const=9)
    whole = _ours(logps, rewards, options)
    microbatched = _ours(logps, rewards, options, prompt_chunks=[[0], [1, 2], [3]])
    assert float(whole) == pytest.approx(float(expected), rel=1e-12, abs=1e-15)
    assert float(microbatched) == pytest.approx(float(expected), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("loss_type,entropy_agg", [("dapo", "token_mean"), ("grpo", "loss"), ("bnpo", "token_mean")])
def test_kl_and_entropy_terms_match_written_out_formula(loss_type, entropy_agg):
    logps, rewards = _random_batch(3)
    gen = torch.Generator().manual_seed(4)
    ref = [[x + 0.3 * torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in row] for row in logps]
    ent = [[torch.rand(x.shape, generator=gen, dtype=torch.float64) for x in row] for row in logps]
    options = _options(loss_type=loss_type, scale_rewards="group", kl_coef=0.04, entropy_coef=0.01,
                       entropy_aggregation=entropy_agg, micro_batches=2 if loss_type == "bnpo" else 1)
    expected = ref_loss(logps, rewards, loss_type=loss_type, scale="group", beta=0.04, ref=ref, entropies=ent,
                        c=0.01, entropy_agg=entropy_agg, micro_batches=options.micro_batches)
    assert float(_ours(logps, rewards, options, ref=ref, entropies=ent)) == pytest.approx(float(expected), rel=1e-12)


def test_zero_advantage_prompts_contribute_only_through_kl_or_entropy():
    row = [objectives.SequenceTerms(0.0, 0.1, 0.1)] * 3
    assert not objectives.contributes(row, _options())
    assert objectives.contributes(row, _options(kl_coef=0.1))
    assert objectives.contributes(row, _options(entropy_coef=0.1))


@pytest.mark.parametrize("loss_type", ["dr_grpo_per_prompt", "grpo", "dapo", "dr_grpo", "luspo"])
def test_leave_one_out_scales_recompute_the_objective_without_the_group(loss_type):
    """c_k·(g − g_k) = the gradient of the objective of the batch without group k (advantages fixed)."""
    logps, rewards = _random_batch(5, B=6, G=2)
    leaves = [[x.clone().requires_grad_(True) for x in row] for row in logps]
    options = _options(loss_type=loss_type, max_completion_length=9)
    groups = [[0, 1], [2, 3], [4, 5]]
    lengths = torch.tensor([[len(x) for x in row] for row in logps])
    adv = objectives.advantages(torch.tensor(rewards), "none")
    scales = objectives.leave_one_out_scales(lengths, groups, options)
    full = _ours(leaves, rewards, options)
    g_full = torch.autograd.grad(full, [x for row in leaves for x in row])
    for k, group in enumerate(groups):
        keep = [p for p in range(6) if p not in group]
        sub = [[leaves[p][g] for g in range(2)] for p in keep]
        # the reduced batch keeps the whole batch's advantages: rewards that reproduce them exactly
        sub_rewards = [adv[p].tolist() for p in keep]
        reduced = _ours(sub, sub_rewards, options)
        g_sub = torch.autograd.grad(reduced, [x for row in sub for x in row])
        flat_keep = [p * 2 + g for p in keep for g in range(2)]
        for j, idx in enumerate(flat_keep):
            assert torch.allclose(g_sub[j], scales[k] * g_full[idx], rtol=1e-12, atol=1e-15)


def test_presets_explicit_keys_and_refusals():
    cfg = config_from_dict({"objective": {"trainer": "trl", "loss_type": "grpo"}})
    options = cfg.objective_options()
    assert (options.loss_type, options.scale_rewards, options.max_grad_norm) == ("grpo", "group", 1.0)
    verl = config_from_dict({"objective": {"trainer": "verl", "loss_type": "seq-mean-token-sum-norm"}})
    assert verl.objective_options().loss_type == "dr_grpo"
    assert verl.objective_options().max_completion_length == verl.generation.max_new_tokens
    assert config_from_dict({}).objective_options() == objectives.ObjectiveOptions()
    for bad, key in [({"num_iterations": 0}, "objective.num_iterations"),  # > 1: refused per checkpoint (rollouts.py)
                     ({"vllm_importance_sampling_correction": True}, "objective.vllm_importance_sampling_correction"),
                     ({"loss_type": "ppo"}, "objective.loss_type"), ({"micro_batches": 5}, "objective.micro_batches")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            config_from_dict({"objective": bad})


# ----------------------------------------------------------------------------- through the model

@pytest.fixture(scope="module")
def sampled_U(tiny_model_dir, tmp_path_factory):
    prompts = write_prompts(tmp_path_factory.mktemp("objdata") / "p.jsonl", SHORT_PROMPTS)
    probe = make_probe(tiny_model_dir, prompts, {"batch_config": {"B_U": 4, "G": 3}})
    _, U = probe.sample(B_E=1, B_U=4, G=3)[:2]
    return probe, U


def _independent_logps(model, U, temperature):
    """Trainer log-probs and entropies of every U response by an unpadded forward per sequence."""
    logps, ents = [], []
    for b in range(U.num_prompts):
        row_l, row_h = [], []
        for g in range(U.num_responses_per_prompt):
            T, end = U.gen_lens[b][g], U.prompt_lens[b] + U.gen_lens[b][g]
            ids = U.sequences[b, g][:end][U.attention_masks[b, g][:end].bool()]  # prompt + response, no padding
            logits = model(input_ids=ids[None]).logits[0].double() / temperature
            logp = torch.log_softmax(logits[-T - 1:-1], dim=-1)
            row_l.append(logp.gather(-1, ids[-T:, None]).squeeze(-1))
            row_h.append(-(logp.exp() * logp).sum(-1))
        logps.append(row_l)
        ents.append(row_h)
    return logps, ents


@pytest.mark.parametrize("loss_type,scale,extra", [
    ("dr_grpo_per_prompt", "none", {}), ("dapo", "group", {}), ("grpo", "batch", {}),
    ("bnpo", "group", {"micro_batches": 2}), ("luspo", "none", {}),
    ("dapo", "group", {"kl_coef": 0.05, "entropy_coef": 0.02, "entropy_aggregation": "token_mean"})])
def test_u_gradient_matches_autograd_of_written_out_loss(sampled_U, loss_type, scale, extra):
    probe, U = sampled_U
    names = [n for n, p in probe.model.named_parameters() if p.requires_grad]
    params = [p for p in probe.model.parameters() if p.requires_grad]
    temperature = probe.config.generation.temperature
    logps, ents = _independent_logps(probe.model, U, temperature)
    ref = None
    if extra.get("kl_coef"):
        with torch.no_grad(), probe.model.disable_adapter():
            ref, _ = _independent_logps(probe.model, U, temperature)
    expected = ref_loss(logps, U.rewards, loss_type=loss_type, scale=scale, micro_batches=extra.get("micro_batches", 1),
                        beta=extra.get("kl_coef", 0.0), ref=ref, entropies=ents, c=extra.get("entropy_coef", 0.0),
                        entropy_agg=extra.get("entropy_aggregation", "loss"))
    want = torch.autograd.grad(expected, params)
    assert max(w.abs().max().item() for w in want) > 0, "the test batch must give a non-zero gradient"
    for microbatch in (1, 64):  # one prompt per backward, and the whole U in one backward
        cfg = config_from_dict({**probe.config.to_dict(), "estimator": {"microbatch_size": microbatch},
                                "objective": {"loss_type": loss_type, "scale_rewards": scale, **extra}})
        got = recipe.update_gradients(cfg, probe.policy, U, [list(range(U.num_prompts))]).total
        for name, w in zip(names, want):
            scale_ = w.abs().max().item()
            assert torch.allclose(got[name].double(), w.double(), rtol=1e-4, atol=1e-5 * scale_), (name, microbatch)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.6), (1.3, 0.9)])
def test_trainer_logprobs_are_tempered_without_nucleus(temperature, top_p):
    """The objective scores tokens as trainers do: log softmax(z/τ), no top-p (≠ the sampling q when top_p < 1)."""
    from entropy_experiments.policy.sampling_policy import TokenStatsRequest, policy_token_stats

    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(40, 50, generator=gen)
    tokens = torch.argmax(logits, dim=-1)  # inside every nucleus
    stats = policy_token_stats(logits, tokens, TokenStatsRequest(temperature, top_p, fp64=True, chunk_size=7))
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    assert torch.allclose(stats["logp_train"], logp.gather(-1, tokens[:, None]).squeeze(-1), rtol=1e-12, atol=1e-12)
    assert torch.allclose(stats["entropy_train"], -(logp.exp() * logp).sum(-1), rtol=1e-12, atol=1e-12)
    if top_p < 1.0:
        assert not torch.allclose(stats["logp_train"], stats["logq"])
    else:
        assert torch.equal(stats["logp_train"], stats["logq"])


def test_u_gradient_divides_the_logits_by_the_temperature(sampled_U):
    """At τ ≠ 1 the U gradient is that of the loss on log softmax(logits/τ) (TRL's), not on the raw logits."""
    probe, U = sampled_U
    tau = 0.6
    names = [n for n, p in probe.model.named_parameters() if p.requires_grad]
    params = [p for p in probe.model.parameters() if p.requires_grad]
    want = torch.autograd.grad(ref_loss(_independent_logps(probe.model, U, tau)[0], U.rewards, loss_type="dapo",
                                        scale="group"), params)
    at_one = torch.autograd.grad(ref_loss(_independent_logps(probe.model, U, 1.0)[0], U.rewards, loss_type="dapo",
                                          scale="group"), params)
    cfg = config_from_dict({**probe.config.to_dict(), "generation": {**probe.config.to_dict()["generation"],
                                                                     "temperature": tau},
                            "objective": {"loss_type": "dapo", "scale_rewards": "group"}})
    tempered = probe.with_config(cfg)  # a policy engine that scores at τ
    got = recipe.update_gradients(cfg, tempered.policy, U, [list(range(U.num_prompts))]).total
    gap = max((w - a).abs().max().item() / w.abs().max().item() for w, a in zip(want, at_one, strict=True))
    assert gap > 1e-2, "τ must matter on this batch, else the test could not catch a missing /τ"
    for name, w in zip(names, want, strict=True):
        assert torch.allclose(got[name].double(), w.double(), rtol=1e-4, atol=1e-5 * w.abs().max().item()), name


def _padded(rows: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    flat = [t for row in rows for t in row]
    width = max(len(t) for t in flat)
    padded = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in flat])
    lengths = torch.tensor([len(t) for t in flat])
    return padded, (torch.arange(width)[None, :] < lengths[:, None]).double()


@pytest.mark.parametrize("loss_type,M", [("dapo", 2), ("grpo", 1)])
def test_u_gradient_with_trl_entropy_mask_is_trls(sampled_U, loss_type, M):
    """objective.trainer trl, top_entropy_quantile 0.5 and an entropy bonus: the probe's U gradient (its no-grad
    statistics pass, then the masked backward) equals autograd of TRL's own `_compute_loss` (tests/trl_reference.py)
    over an independent unpadded forward of the tiny model."""
    pytest.importorskip("trl")
    from tests.trl_reference import trl_advantages, trl_loss_over_micro_batches

    probe, U = sampled_U
    names = [n for n, p in probe.model.named_parameters() if p.requires_grad]
    params = [p for p in probe.model.parameters() if p.requires_grad]
    logps, ents = _independent_logps(probe.model, U, probe.config.generation.temperature)
    (lp, mask), (h, _) = _padded(logps), _padded(ents)
    rewards = torch.tensor(U.rewards, dtype=torch.float64)
    adv = trl_advantages(rewards.reshape(-1), U.num_responses_per_prompt, "group")
    # TRL's entropies are its model's float32 ones: at float64 TRL's own `>=` against its float32 threshold would
    # drop the threshold token (n = 67 tokens: the 0.5-quantile IS a token) whenever its float32 rounding went up
    theirs = trl_loss_over_micro_batches(lp, mask, adv, num_micro_batches=M, loss_type=loss_type, entropies=h.float(),
                                         entropy_coef=0.02, max_completion_length=lp.shape[1],
                                         entropy_controls={"top_entropy_quantile": 0.5})
    want = torch.autograd.grad(theirs, params)
    assert max(w.abs().max().item() for w in want) > 0
    cfg = config_from_dict({**probe.config.to_dict(), "estimator": {"microbatch_size": 3},
                            "objective": {"trainer": "trl", "loss_type": loss_type, "micro_batches": M,
                                          "top_entropy_quantile": 0.5, "entropy_coef": 0.02}})
    got = recipe.update_gradients(cfg, probe.policy, U, [list(range(U.num_prompts))]).total
    for name, w in zip(names, want):
        assert torch.allclose(got[name].double(), w.double(), rtol=1e-4, atol=1e-5 * w.abs().max().item()), name


def test_adaptive_entropy_state_missing_or_malformed_is_one_line(tmp_path):
    """use_adaptive_entropy without TRL's entropy_ctrl_state.json in the checkpoint, or with another file there:
    one line naming the key and the file (exit 2 at the CLI), never a traceback."""
    objective = {"trainer": "trl", "use_adaptive_entropy": True}
    for content, words in ((None, "does not exist"), ("[1, 2]", "not TRL's entropy controller state"),
                           ('{"entropy_coef": 0.1}', "last_world_entropy")):
        if content is not None:
            (tmp_path / "entropy_ctrl_state.json").write_text(content)
        with pytest.raises(ConfigError) as exc:
            config_from_dict({"checkpoint": {"checkpoint_path": str(tmp_path)}, "objective": objective})
        line = str(exc.value)
        assert "\n" not in line and words in line and "entropy_ctrl_state.json" in line, line
    (tmp_path / "entropy_ctrl_state.json").write_text('{"entropy_coef": 0.1, "last_world_entropy": 0.05}')
    options = config_from_dict({"checkpoint": {"checkpoint_path": str(tmp_path)},
                                "objective": objective}).objective_options()
    assert options.entropy_coef == 0.1  # 0.05 ≤ TRL's default entropy_target 0.2: the saved coefficient applies
