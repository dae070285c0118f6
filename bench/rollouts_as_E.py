"""Could the trainer's own rollouts serve as E? δ̂ of the trainer's next step on them against a fresh E.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rollouts_as_E.py [--seeds 0,1,2,3] [--steps 6] [--lr 2e-2]

In the enumerable world (`testing/enumerable_world.py`: a real TRL GRPOTrainer, 8 prompts × 8 completions per
step) the exact first-order change of the step about to be taken is δ = ⟨∇H, Δθ_next⟩, with ∇H by autograd
through the enumerated entropy. Right before each `optimizer.step()`, δ̂ ± SE_E is computed on the 64
completions the trainer has just trained on and on a fresh E of 64 drawn by the probe; each is graded by
z = (δ̂ − δ)/SE_E. A calibrated estimate has rms z ≈ 1 and 95 % of |z| < 2.

The rollouts cost no sampling, but they made the step's gradient: X̂ on them shares Δθ_next's noise, which
the jackknife SE (a sum over E's own units) cannot see. This prints how much that matters.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def exact_entropy_gradient(model, tokenizer, named: dict) -> dict:
    """∇H of the world's exact per-token entropy (every response enumerated), by parameter name."""
    from entropy_experiments.testing.enumerable_world import exact_sums

    with torch.enable_grad():
        num, den, _ = exact_sums(model, tokenizer)
        grads = torch.autograd.grad(num / den, list(named.values()), allow_unused=True)
    missing = [n for n, g in zip(named, grads) if g is None]
    if missing:  # a step along a parameter H does not see would be dropped from δ silently
        raise SystemExit(f"rollouts_as_E: the exact entropy has no gradient for {missing[:3]}")
    return dict(zip(named, grads))


def rollouts_batch(inputs: dict, G: int):
    """The trainer's completions as a `Batch` (prompts left-padded, G consecutive completions per prompt)."""
    from entropy_experiments.data.batch import Batch

    prompt, prompt_mask = inputs["prompt_ids"].cpu(), inputs["prompt_mask"].cpu()
    completion, completion_mask = inputs["completion_ids"].cpu(), inputs["completion_mask"].cpu()
    B = prompt.shape[0] // G
    lengths = completion_mask.sum(1).reshape(B, G).tolist()
    return Batch(sequences=torch.cat([prompt, completion], 1).reshape(B, G, -1),
                 attention_masks=torch.cat([prompt_mask, completion_mask], 1).reshape(B, G, -1),
                 prompt_lens=[prompt.shape[1]] * B, gen_lens=[[int(t) for t in row] for row in lengths],
                 advantages=torch.zeros(B, G), rewards=[[0.0] * G for _ in range(B)], prompt_ids=list(range(B)),
                 prompts=[""] * B, responses_text=[[""] * G for _ in range(B)], sampler_logqs=None)


class Grader(TrainerCallback):
    """Before each optimizer step: z of δ̂ on the trainer's rollouts and on a fresh E against the exact δ."""

    def __init__(self, trainer, probe, out: list):
        self.trainer, self.probe, self.out, self.inputs = trainer, probe, out, None
        a = trainer.args
        if (a.temperature, a.top_p, a.top_k or 0, a.min_p or 0) != (1.0, 1.0, 0, 0):
            # the rollouts are scored as draws of the policy itself (no sampler weights)
            raise SystemExit("rollouts_as_E: the trainer must sample the policy as it is (temperature 1, no top_p, "
                             f"top_k or min_p); got {a.temperature}, {a.top_p}, {a.top_k}, {a.min_p}")
        compute_loss = trainer.compute_loss

        def recording(model, inputs, *args, **kwargs):  # the completions this step trains on
            self.inputs = inputs
            return compute_loss(model, inputs, *args, **kwargs)
        trainer.compute_loss = recording

    def on_train_begin(self, args, state, control, **kwargs):
        self.probe.on_train_begin(args, state, control, **kwargs)  # the live policy, never a probed step

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        from entropy_experiments.integrations.live_state import untouched
        from entropy_experiments.integrations.trainer_step import predict_on_E, sample_E
        from entropy_experiments.integrations.trl_step_probe import named_params

        probe, step = self.probe, state.global_step + 1
        config = probe.config.model_copy(update={"seed": probe.step_seed(step)})
        with untouched(probe.policy.trainable.model):
            own = predict_on_E(config, probe.policy, rollouts_batch(self.inputs, self.trainer.num_generations),
                               step, time.perf_counter(), probe.dist)
            fresh = predict_on_E(config, probe.policy, sample_E(config, probe.policy, probe.examples, probe.dist),
                                 step, time.perf_counter(), probe.dist)
        named = named_params(probe.policy)
        grad = exact_entropy_gradient(probe.policy.trainable.model, self.trainer.processing_class, named)
        exact = sum(float((grad[n].double() * d.double()).sum()) for n, d in own.next_step.step.items())
        z = ((own.delta_h_next - exact) / own.se_E, (fresh.delta_h_next - exact) / fresh.se_E)
        self.out.append((own.delta_h_next - exact, fresh.delta_h_next - exact, *z))
        print(f"step {step}: exact δ {exact:+.4f}; rollouts {own.delta_h_next:+.4f} ± {own.se_E:.4f} (z {z[0]:+.2f}); "
              f"fresh E {fresh.delta_h_next:+.4f} ± {fresh.se_E:.4f} (z {z[1]:+.2f})", flush=True)


def summary(name: str, errors: list[float], z: list[float]) -> str:
    n = len(z)
    return (f"{name}: mean error {statistics.mean(errors):+.4f} ± {statistics.stdev(errors) / math.sqrt(n):.4f}, "
            f"rms z {math.sqrt(statistics.mean(x * x for x in z)):.2f}, {sum(abs(x) < 2 for x in z)}/{n} within 2 SE")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=2e-2)
    args = parser.parse_args()
    from entropy_experiments.integrations.trl_callback import EntropyProbeCallback
    from entropy_experiments.testing.enumerable_world import world_model, world_trainer

    rows: list = []
    for seed in (int(s) for s in args.seeds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            trainer, _ = world_trainer(world_model(Path(tmp) / "model"), Path(tmp) / "out", steps=args.steps,
                                       lr=args.lr, seed=seed)
            # the probe's config, prompts and (from on_train_begin) live policy; B_E = the trainer's 64 completions
            probe = EntropyProbeCallback(trainer, predict="trainer_step", B_E=64)
            trainer.add_callback(Grader(trainer, probe, rows))
            trainer.train()
    own, fresh, z_own, z_fresh = zip(*rows)
    print(summary("the trainer's rollouts", list(own), list(z_own)))
    print(summary("a fresh E", list(fresh), list(z_fresh)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
