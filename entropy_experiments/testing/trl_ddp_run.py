"""A tiny TRL `GRPOTrainer` under several processes (DDP, gloo on CPU), for tests/test_trl_ddp.py and the bench.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m entropy_experiments.testing.trl_ddp_run \\
        --out DIR --model-dir DIR --scenarios plain probed autopilot diverge

(`accelerate launch --num_processes 2 --cpu -m entropy_experiments.testing.trl_ddp_run …` runs the same.) Each
scenario trains a fresh trainer in the same process group and writes `OUT/<scenario>/rank<R>.pt`:

- plain      the adapter parameters after training, no callback;
- probed     the same with `EntropyProbeCallback(predict="trainer_step")` and `Reference`: the parameters, the
             callback's rows, the reference's rows, and each step's union E with the reference's own draw of it;
- probe_U    the same with `EntropyProbeCallback` in its default mode (the probe's own U): parameters, rows;
- autopilot  `EntropyAutopilot`'s rows on this rank (its multipliers);
- diverge    an autopilot whose decision is one ulp off on the last rank: the error each rank stopped with;
- bench      seconds per training step without the callback, probe seconds per probed step with it.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from entropy_experiments.data.batch import Batch
from entropy_experiments.integrations.autopilot import EntropyAutopilot
from entropy_experiments.integrations.live_state import untouched
from entropy_experiments.integrations.ranks import current
from entropy_experiments.integrations.trainer_step import check_trainer_step, predict_on_E
from entropy_experiments.integrations.trl_callback import EntropyProbeCallback
from entropy_experiments.probe.parallel import SINGLE, DistContext, DistributedError, rank_seed
from entropy_experiments.probe.sampling import BatchDraw, SamplingSpec, draw_plan, sample_batch
from entropy_experiments.testing.trl_run import tiny_grpo_trainer

PROBE = {"B_E": 6, "seed": 7, "microbatch_size": 2}


def one_process_union(config, policy, examples: list, world_size: int) -> Batch:
    """E as one process draws it for `world_size` ranks: each rank's contiguous share of the plan with that
    rank's seed stream (`parallel.rank_seed`), drawn here one share after the other, in plan order."""
    plan = draw_plan(config, len(examples), SINGLE)
    spec = SamplingSpec.choose(policy.engine, reference=not config.sampler.batched,
                               chat_template_kwargs=config.batch_config.chat_template_kwargs)
    parts = []
    for rank in range(world_size):
        share = DistContext(rank=rank, world_size=world_size).prompt_slice(len(plan.E_prompt_indices))
        draw = BatchDraw([plan.E_prompt_indices[i] for i in share], plan.E_responses_per_prompt,
                         rank_seed(config.seed + 1, rank), what="E")
        parts.append(sample_batch(spec, examples, draw) if share else None)
    return Batch.concat(parts, policy.engine.pad_token_id)


class Reference(TrainerCallback):
    """The one-process computation (`parallel.SINGLE`) of each probed step on the same union E, drawn again
    here (`one_process_union`), with the same live parameters, gradients and optimizer state."""

    def __init__(self, probe: EntropyProbeCallback):
        self.probe, self.pending, self.rows, self.draws = probe, None, [], []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        probed = self.probe.pending
        if probed is None or probed.step != state.global_step + 1:
            return
        config = self.probe.config.model_copy(update={"seed": self.probe.step_seed(probed.step)})
        policy = self.probe.policy
        with untouched(policy.trainable.model):
            E = one_process_union(config, policy, self.probe.examples, self.probe.dist.world_size)
            self.pending = predict_on_E(config, policy, E, probed.step, time.perf_counter(), SINGLE)
        self.draws.append({"step": probed.step, "probe": probed.E.to_dict(), "reference": E.to_dict()})

    def on_step_end(self, args, state, control, **kwargs):
        if self.pending is None:
            return
        with untouched(self.probe.policy.trainable.model):
            self.rows.append(check_trainer_step(self.probe.config, self.probe.policy, self.pending, SINGLE))
        self.pending = None


class OffByOneUlp(EntropyAutopilot):
    """An autopilot whose decision on the last rank is one ulp above the others' (a forced divergence)."""

    def decision(self) -> dict:
        values = super().decision()
        if self.dist.rank == self.dist.world_size - 1:
            values["lr_multiplier"] = math.nextafter(values["lr_multiplier"], math.inf)
        return values


def trainer_for(out: Path, model_dir: str, steps: int):
    return tiny_grpo_trainer(out, steps=steps, model_dir=model_dir, learning_rate=2e-2, max_completion_length=6,
                             save_strategy="no")


def adapter(trainer) -> dict:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_scenario(name: str, out: Path, model_dir: str, steps: int, B_E: int) -> dict:
    """Train one scenario's trainer (module docstring) → what this rank saves."""
    trainer = trainer_for(out, model_dir, steps)
    options = {**PROBE, "B_E": B_E}
    if name == "plain":
        trainer.train()
        return {"params": adapter(trainer)}
    if name == "probed":
        probe = EntropyProbeCallback(trainer, every=1, predict="trainer_step", **options)
        reference = Reference(probe)
        trainer.add_callback(probe)
        trainer.add_callback(reference)
        trainer.train()
        return {"params": adapter(trainer), "rows": probe.rows, "reference": reference.rows,
                "draws": reference.draws}
    if name == "probe_U":
        probe = EntropyProbeCallback(trainer, every=1, B_U=2, **options)
        trainer.add_callback(probe)
        trainer.train()
        return {"params": adapter(trainer), "rows": probe.rows}
    if name in ("autopilot", "diverge"):
        pilot = (EntropyAutopilot if name == "autopilot" else OffByOneUlp)(trainer, target=0.0, every=1, **options)
        trainer.add_callback(pilot)
        try:
            trainer.train()
        except DistributedError as exc:
            return {"rows": pilot.rows, "error": str(exc)}
        return {"rows": pilot.rows, "params": adapter(trainer)}
    if name == "bench":
        return bench(trainer, trainer_for(out / "probed", model_dir, steps), steps, options)
    raise SystemExit(f"trl_ddp_run: unknown scenario {name!r}")


def bench(plain, probed, steps: int, options: dict) -> dict:
    """Seconds per training step of `plain`, and the callback's probe seconds per probed step in `probed`."""
    t0 = time.perf_counter()
    plain.train()
    step = (time.perf_counter() - t0) / steps
    probe = EntropyProbeCallback(probed, every=1, predict="trainer_step", **options)
    probed.add_callback(probe)
    probed.train()
    return {"step_s": step, "probe_s": probe.probe_seconds / steps, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--scenarios", nargs="+", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--B-E", dest="B_E", type=int, default=PROBE["B_E"])
    args = parser.parse_args(argv)
    for name in args.scenarios:
        out = Path(args.out) / name
        saved = run_scenario(name, out, args.model_dir, args.steps, args.B_E)
        dist = current()
        out.mkdir(parents=True, exist_ok=True)
        torch.save({**saved, "world_size": dist.world_size}, out / f"rank{dist.rank}.pt")
        # the trainer and its callbacks form a reference cycle: its DDP reducer (which holds the process group)
        # would otherwise live until the interpreter's exit, where gloo's teardown can abort the rank
        del saved
        gc.collect()
    if torch.distributed.is_initialized():  # a group left to the interpreter's exit can abort a rank in gloo
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
