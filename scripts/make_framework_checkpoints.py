"""Write the tiny verl / DeepSpeed checkpoints the tests read, with the libraries' own code, and what their
optimizers held in memory (tests/fixtures/framework_checkpoints/<framework>/).

Run ONCE, in a virtual environment that has the framework installed (never the project's own):

    /path/to/verl-venv/bin/python scripts/make_framework_checkpoints.py verl
    /path/to/ds-venv/bin/python scripts/make_framework_checkpoints.py deepspeed

with this repository on PYTHONPATH (for the tiny model of entropy_experiments/testing/tiny_model.py). Each run
trains a 1-layer Qwen2 with a LoRA adapter for STEPS optimizer steps on 2 CPU processes (gloo), saves a
checkpoint after every step through the framework's checkpoint code, and writes beside the checkpoints
`reference.pt`: for every saved step, the full (gathered) LoRA weights and AdamW exp_avg / exp_avg_sq / step
the optimizer held in memory when it saved, and the gradient it was then given for the next step with the
parameter change Δθ that step made (so a test can rebuild that step from the loaded state and compare).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
STEPS = 2
LR = 1e-2
WARMUP = 3  # a warm-up schedule, so that the saved lr differs from the configured one
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "framework_checkpoints"


def tiny_lora_model():
    """The tiny Qwen2 (hidden 16, 1 layer, 272-token BPE) with a random LoRA (r 4, alpha 8) on q,k,v,o."""
    from entropy_experiments.testing.tiny_model import add_random_lora, build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(vocab_size=272)
    model = build_tiny_model(len(tokenizer), tokenizer.eos_token_id, hidden_size=16, num_layers=1)
    return add_random_lora(model, r=4, alpha=8).train(), tokenizer


def batch(step: int, rank: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (2, 6), generator=gen)


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().cpu()


# ------------------------------------------------------------------------------------------------ verl

def verl_rank(rank: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import apply_fsdp2  # (its fsdp2_clip_grad_norm_ needs a GPU: no clipping here)
    from verl.utils.torch_functional import get_constant_schedule_with_warmup
    from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("fsdp",))
    model, tokenizer = tiny_lora_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)
    apply_fsdp2(model, {"mesh": mesh, "mp_policy": policy, "offload_policy": None, "reshard_after_forward": True},
                {})
    optimizer = build_optimizer(model.parameters(), FSDPOptimizerConfig(lr=LR, weight_decay=0.01,
                                                                        total_training_steps=10))
    scheduler = get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=WARMUP)
    manager = FSDPCheckpointManager(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                    processing_class=tokenizer, checkpoint_config={})
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    reference = {}
    for step in range(1, STEPS + 2):
        optimizer.zero_grad()
        lm_loss(model, batch(step, rank, len(tokenizer))).backward()
        grads = {n: full(params[n].grad) for n in names}
        before = {n: full(params[n]) for n in names}
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        if step > 1:  # the step taken after checkpoint step-1: its gradient and Δθ
            reference[step - 1].update(next_grad=grads, next_delta={n: full(params[n]) - before[n] for n in names},
                                       next_lr=lr)
        if step <= STEPS:
            state = {n: optimizer.state[params[n]] for n in names}
            reference[step] = {"weights": {n: full(params[n]) for n in names},
                               "exp_avg": {n: full(s["exp_avg"]) for n, s in state.items()},
                               "exp_avg_sq": {n: full(s["exp_avg_sq"]) for n, s in state.items()},
                               "step": {n: float(s["step"]) for n, s in state.items()},
                               "lr": optimizer.param_groups[0]["lr"], "names": names}
            manager.save_checkpoint(str(out / f"global_step_{step}" / "actor"), global_step=step)
    if rank == 0:
        torch.save(reference, out / "reference.pt")
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ DeepSpeed

def deepspeed_rank(rank: int, out: Path) -> None:
    import deepspeed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    deepspeed.init_distributed(dist_backend="gloo")
    model, _ = tiny_lora_model()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 2}, "bf16": {"enabled": False},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": LR,
                                                           "warmup_num_steps": WARMUP, "warmup_type": "linear"}}}
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    reference = {}
    for step in range(1, STEPS + 2):
        loss = lm_loss(engine, batch(step, rank, model.config.vocab_size))
        engine.backward(loss)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        lr = optimizer.param_groups[0]["lr"]
        engine.step()
        if step > 1:
            reference[step - 1].update(next_delta={n: p.detach() - before[n] for n, p in model.named_parameters()
                                                   if p.requires_grad}, next_lr=lr)
        if step <= STEPS:
            reference[step] = {"weights": {n: p.detach().clone() for n, p in model.named_parameters()
                                           if p.requires_grad}, "lr": optimizer.param_groups[0]["lr"],
                               "names": names}
            engine.save_checkpoint(str(out), tag=f"global_step{step}")
    if rank == 0:
        torch.save(reference, out / "reference.pt")
    dist.barrier()


def spawn(target, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", OMP_NUM_THREADS="1")
    mp.spawn(target, args=(out,), nprocs=WORLD_SIZE, join=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("framework", choices=["verl", "deepspeed"])
    args = parser.parse_args()
    torch.manual_seed(0)
    spawn(verl_rank if args.framework == "verl" else deepspeed_rank, OUT / args.framework)


if __name__ == "__main__":
    main()
