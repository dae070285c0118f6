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
`import deepspeed` line of models/utils.py (no function called here uses it). The loss is `PolicyLoss` +
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
