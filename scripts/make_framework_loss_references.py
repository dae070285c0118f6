"""Write the loss references tests/test_framework_objectives.py compares the probe's trainer objectives with:
verl's and OpenRLHF's OWN loss code run on small fixed tensors (tests/fixtures/framework_losses/<framework>.pt).

Run ONCE, in a virtual environment that has the framework (never the project's own):

    /path/to/verl-venv/bin/python scripts/make_framework_loss_references.py verl
    /path/to/venv-with-torch/bin/python scripts/make_framework_loss_references.py openrlhf --source DIR

verl (0.9.1): the actor's loss function `verl.workers.utils.losses.ppo_loss` (the registered policy loss
"vanilla", `agg_loss`, `kl_penalty`, the entropy term) on each micro-batch, with the global token count and
batch size verl's FSDP engine hands it; the micro-batch losses are summed, as the engine's per-micro-batch
`backward()` does. Advantages come from verl's `compute_grpo_outcome_advantage`; the actor's defaults from
its own `FSDPActorConfig`.

OpenRLHF (0.11.2) cannot be installed without CUDA (flash-attn, deepspeed): DIR is the `purelib` folder of its
unzipped wheel (`pip download --no-deps openrlhf==0.11.2`), from which only `openrlhf/models/loss.py`,
`openrlhf/models/utils.py` and `openrlhf/utils/loss_utils.py` are loaded, with an empty stand-in for the
`import deepspeed` line of openrlhf/models/utils.py (no function called here uses it). The loss is `PolicyLoss` +
`compute_approx_kl` as a KL loss + the entropy term, composed as `PPOActor.training_step` does, normalised by
`iter_grad_accum_global_norm` and scaled by DeepSpeed's 1/gradient-accumulation-steps.

Every case stores the loss (summed over the optimizer step's micro-batches) and its gradient with respect to
the per-token log-probs (and entropies), computed by autograd in float64 (OpenRLHF's KL is float32 by design).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "framework_losses"
B, G, WIDTH, MICRO_BATCHES = 4, 4, 12, 2


def fixed_batch() -> dict[str, torch.Tensor]:
    """B·G padded responses of lengths 1..8 in a width-12 window (so the padded width is not the longest
    response), rewards with one constant group, a reference whose difference reaches the KL clamps."""
    gen = torch.Generator().manual_seed(20240607)
    lengths = torch.randint(1, 9, (B, G), generator=gen)
    lengths[0, 0] = 8
    mask = (torch.arange(WIDTH)[None, :] < lengths.reshape(-1, 1)).to(torch.float64)
    logps = -3 * torch.rand(B * G, WIDTH, generator=gen, dtype=torch.float64) * mask
    ref = (logps + 0.3 * torch.randn(logps.shape, generator=gen, dtype=torch.float64)) * mask
    ref[0, 0] = logps[0, 0] + 3.5      # low_var_kl clamps its value at 10: zero gradient
    ref[0, 1] = logps[0, 1] - 12.0     # k3 with ℓ − ref > 11: clamped too
    rewards = torch.randint(0, 4, (B, G), generator=gen).double()
    rewards[1] = 2.0
    entropies = 2 * torch.rand(logps.shape, generator=gen, dtype=torch.float64) * mask
    return {"lengths": lengths, "mask": mask, "logps": logps, "ref_logps": ref, "rewards": rewards,
            "entropies": entropies}


def micro_batch_slices() -> list[slice]:
    per = B * G // MICRO_BATCHES
    return [slice(k * per, (k + 1) * per) for k in range(MICRO_BATCHES)]


def loss_and_gradients(batch: dict[str, torch.Tensor], micro_loss) -> dict[str, torch.Tensor]:
    """Σ over micro-batches of micro_loss(logps, entropies, rows) and its gradients w.r.t. logps / entropies."""
    logps = batch["logps"].clone().requires_grad_(True)
    entropies = batch["entropies"].clone().requires_grad_(True)
    total = sum(micro_loss(logps, entropies, rows) for rows in micro_batch_slices())
    g_logps, g_entropies = torch.autograd.grad(total, [logps, entropies], allow_unused=True)
    return {"loss": total.detach(), "grad_logps": g_logps,
            "grad_entropies": torch.zeros_like(entropies) if g_entropies is None else g_entropies}


# ----------------------------------------------------------------------------- verl

VERL_CASES = [
    # name, actor config changes, norm_adv_by_std_in_grpo
    ("token-mean", {}, True),
    ("seq-mean-token-mean", {"loss_agg_mode": "seq-mean-token-mean"}, True),
    ("seq-mean-token-sum", {"loss_agg_mode": "seq-mean-token-sum"}, False),
    ("seq-mean-token-sum-norm", {"loss_agg_mode": "seq-mean-token-sum-norm"}, True),
    ("seq-mean-token-sum-norm/scale7", {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 7}, True),
    ("token-mean/clip", {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28}, True),
    ("token-mean/kl-low_var_kl", {"use_kl_loss": True, "kl_loss_coef": 0.04}, True),
    ("token-mean/kl-k1", {"use_kl_loss": True, "kl_loss_coef": 0.04, "kl_loss_type": "k1"}, True),
    ("token-mean/kl-k2", {"use_kl_loss": True, "kl_loss_coef": 0.04, "kl_loss_type": "k2"}, True),
    ("token-mean/kl-k3+", {"use_kl_loss": True, "kl_loss_coef": 0.04, "kl_loss_type": "k3+"}, True),
    ("seq-mean-token-mean/kl-entropy", {"loss_agg_mode": "seq-mean-token-mean", "use_kl_loss": True,
                                        "kl_loss_coef": 0.04, "entropy_coeff": 0.01}, True),
    ("token-mean/entropy", {"entropy_coeff": 0.01}, False),
]


def verl_advantages(rewards: torch.Tensor, mask: torch.Tensor, norm_by_std: bool) -> torch.Tensor:
    """verl's GRPO advantages [B·G, WIDTH] from outcome rewards placed on each response's last token."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    last = mask.sum(dim=1).long() - 1
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(B * G), last] = rewards.reshape(-1)
    index = np.repeat(np.arange(B), G)
    advantages, _ = compute_grpo_outcome_advantage(token_rewards, mask, index, norm_adv_by_std_in_grpo=norm_by_std)
    return advantages


def verl_actor_config(**changes):
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=B * G // MICRO_BATCHES,
                           use_dynamic_bsz=False, rollout_n=G, **changes)


def verl_micro_loss(config, batch, advantages):
    """verl's ppo_loss on one micro-batch, fed as the FSDP engine feeds it (flat log-probs, global counts)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    mask, n_tokens = batch["mask"], int(batch["mask"].sum())

    def flat(values, rows):
        # each sequence is [1 prompt token, T response tokens]; the model's output at position p predicts p + 1
        lengths = mask[rows].sum(dim=1).long()
        parts = [torch.cat([values[rows][i, :t], values.new_zeros(1)]) for i, t in enumerate(lengths)]
        return torch.cat(parts)

    def micro_loss(logps, entropies, rows):
        n = rows.stop - rows.start
        data = TensorDict({
            "prompts": torch.ones(n, 1, dtype=torch.long), "responses": torch.ones(n, WIDTH, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(n, 1), mask[rows]], dim=1).long(),
            "response_mask": mask[rows], "old_log_probs": batch["logps"][rows], "advantages": advantages[rows],
            "ref_log_prob": batch["ref_logps"][rows]}, batch_size=[n])
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=n_tokens, global_batch_size=B * G)
        output = {"log_probs": flat(logps, rows), "entropy": flat(entropies, rows)}
        loss, _ = ppo_loss(config, output, data)
        return loss

    return micro_loss


def verl_defaults() -> dict[str, object]:
    """The actor defaults (verl's own config class) and the GRPO advantage ε, for the preset test."""
    import inspect

    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    config = verl_actor_config()
    grpo = inspect.signature(compute_grpo_outcome_advantage).parameters
    return {"loss_agg_mode": config.loss_agg_mode, "use_kl_loss": config.use_kl_loss,
            "kl_loss_type": config.kl_loss_type, "kl_loss_coef": config.kl_loss_coef,
            "entropy_coeff": float(config.entropy_coeff), "clip_ratio": config.clip_ratio,
            "grad_clip": float(config.grad_clip),
            "grpo_epsilon": grpo["epsilon"].default, "norm_adv_by_std_in_grpo": grpo["norm_adv_by_std_in_grpo"].default}


def make_verl() -> dict[str, object]:
    import verl

    batch = fixed_batch()
    cases = {}
    for name, changes, norm_by_std in VERL_CASES:
        advantages = verl_advantages(batch["rewards"], batch["mask"], norm_by_std)
        config = verl_actor_config(**changes)
        cases[name] = {"loss_agg_mode": config.loss_agg_mode, "norm_adv_by_std_in_grpo": norm_by_std,
                       "loss_scale_factor": config.loss_scale_factor, "use_kl_loss": config.use_kl_loss,
                       "kl_loss_type": config.kl_loss_type, "kl_loss_coef": config.kl_loss_coef,
                       "entropy_coeff": float(config.entropy_coeff), "advantages": advantages[:, 0].clone(),
                       **loss_and_gradients(batch, verl_micro_loss(config, batch, advantages))}
    return {"version": verl.__version__, "batch": batch, "micro_batches": MICRO_BATCHES, "cases": cases,
            "defaults": verl_defaults()}



# ----------------------------------------------------------------------------- OpenRLHF

OPENRLHF_CASES = [
    # name, PolicyLoss keywords, KL loss (estimator, coefficient, unbiased_gradient) or None, entropy_coef
    ("token-mean", {}, None, None),
    ("seq-mean-token-mean", {"token_level_loss": False}, None, None),
    ("token-mean/clip", {"clip_eps_low": 0.1, "clip_eps_high": 0.28, "dual_clip": 3.0}, None, None),
    ("token-mean/kl-k3", {}, ("k3", 0.04, False), None),
    ("token-mean/kl-k1", {}, ("k1", 0.04, False), None),
    ("token-mean/kl-k2", {}, ("k2", 0.04, False), None),
    ("token-mean/kl-k3-unbiased", {}, ("k3", 0.04, True), None),
    ("token-mean/entropy", {}, None, 0.01),
    ("seq-mean-token-mean/kl-k3-entropy", {"token_level_loss": False}, ("k3", 0.04, False), 0.01),
]


def load_openrlhf(source: Path) -> dict[str, types.ModuleType]:
    """openrlhf.models.loss / .utils and openrlhf.utils.loss_utils from the unzipped wheel, without running the
    packages' __init__ (which import the CUDA-only model code); `deepspeed` is an empty stand-in module."""
    sys.modules.setdefault("deepspeed", types.ModuleType("deepspeed"))
    for package in ("openrlhf", "openrlhf.models", "openrlhf.utils"):
        module = types.ModuleType(package)
        module.__path__ = [str(source / package.replace(".", "/"))]
        sys.modules[package] = module
    loaded = {}
    for name in ("openrlhf.models.utils", "openrlhf.models.loss", "openrlhf.utils.loss_utils"):
        spec = importlib.util.spec_from_file_location(name, source / (name.replace(".", "/") + ".py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        loaded[name.rsplit(".", 1)[-1]] = module
    return loaded


def openrlhf_micro_loss(modules, batch, advantages, policy_keywords, kl, entropy_coef):
    """PPOActor.training_step's loss on one micro-batch, with the step's normalisers, times DeepSpeed's 1/gas."""
    loss_module, utils, loss_utils = modules["loss"], modules["utils"], modules["loss_utils"]
    policy_loss = loss_module.PolicyLoss(**policy_keywords)
    mask = batch["mask"]
    infos = [info for _, info in loss_utils.iter_grad_accum_global_norm(
        micro_batch_slices(), types.SimpleNamespace(), MICRO_BATCHES, lambda rows: mask[rows])]

    def micro_loss(logps, entropies, rows):
        info = infos[rows.start // (B * G // MICRO_BATCHES)]
        loss, *_ = policy_loss(logps[rows], batch["logps"][rows], advantages[rows], action_mask=mask[rows], **info)
        if kl is not None:
            estimator, coef, unbiased = kl
            per_token = utils.compute_approx_kl(logps[rows], batch["ref_logps"][rows], log_probs_old=batch["logps"][rows],
                                                kl_estimator=estimator, unbiased_gradient=unbiased)
            loss = loss + loss_module.aggregate_loss(per_token, mask[rows], **info) * coef
        if entropy_coef is not None:
            loss = loss - loss_module.aggregate_loss(entropies[rows], mask[rows], **info) * entropy_coef
        return loss / MICRO_BATCHES   # DeepSpeed scales each micro-batch's backward by 1/gas

    return micro_loss


def make_openrlhf(source: Path | None) -> dict[str, object]:
    if source is None:
        raise SystemExit("openrlhf needs --source: the purelib folder of the unzipped openrlhf wheel")
    modules = load_openrlhf(source)
    batch = fixed_batch()
    # group_norm advantages (experience_maker.py, not importable without ray): (r − mean_g) / (std_g + 1e-9),
    # returned for the record; the test forms its own and checks them against this formula's values.
    rewards = batch["rewards"]
    advantages = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-9)
    per_token = advantages.reshape(-1, 1) * batch["mask"]
    cases = {}
    for name, policy_keywords, kl, entropy_coef in OPENRLHF_CASES:
        micro_loss = openrlhf_micro_loss(modules, batch, per_token, policy_keywords, kl, entropy_coef)
        cases[name] = {"token_level_loss": policy_keywords.get("token_level_loss", True),
                       "kl_estimator": None if kl is None else kl[0], "kl_coef": 0.0 if kl is None else kl[1],
                       "unbiased_gradient": kl is not None and kl[2], "entropy_coef": entropy_coef or 0.0,
                       "advantages": advantages.reshape(-1).clone(), **loss_and_gradients(batch, micro_loss)}
    return {"version": "0.11.2", "batch": batch, "micro_batches": MICRO_BATCHES, "cases": cases}

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("framework", choices=["verl", "openrlhf"])
    parser.add_argument("--source", type=Path, help="openrlhf: the purelib folder of the unzipped wheel")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    reference = make_verl() if args.framework == "verl" else make_openrlhf(args.source)
    OUT.mkdir(parents=True, exist_ok=True)
    torch.save(reference, OUT / f"{args.framework}.pt")
    for name, case in reference["cases"].items():
        print(f"{args.framework} {name}: loss {float(case['loss']):.6g}")


if __name__ == "__main__":
    main()
