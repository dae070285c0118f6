"""The callbacks under several processes (accelerate multi-process / torchrun, DDP): E split, pieces reduced, one decision.

Under DDP the trainer's step is one step: at `on_pre_optimizer_step` every rank holds the same all-reduced
gradient in `.grad` and the same AdamW state, so Δθ_next is the same everywhere. The only per-rank work is E:

- each rank samples its contiguous share of E's index plan with its own seed stream (`parallel.rank_seed`: rank 0
  keeps the one-process seed) and the shares are gathered, so every rank holds the union E in plan order
  (`sampling.sample_sharded`);
- each rank scores whole teacher-forcing chunks of the union (jvp along Δθ_next, and at θ' for the realised
  change: `measured_on_shares`); per-sequence values are gathered in global order, X̂-sized sums all-reduced
  (`summed`), so δH_next, SE_E, Ĥ, realised and every row field are the union's, identical on every rank;
- rank 0 alone writes rows, batches and the console line (`writes`);
- a decision every rank applies (the autopilot's multiplier, a pushed gradient) goes through `agree`: its
  checksum is gathered, and ranks that disagree stop with `DecisionMismatch`, never a silent divergence.

`current()` is the trainer's process group (accelerate made it); in one process it is `parallel.SINGLE` and every
helper is the one-process code path. What is refused (`launch_refusal`): DeepSpeed ZeRO and FSDP (the optimizer
state and gradients are sharded; docs/callback.md "Launch modes"), single-process DataParallel and tensor/context
parallelism (a rank then holds no whole policy).
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from typing import Any

import numpy as np
import torch
from torch import Tensor

from entropy_experiments.config import ProbeConfig
from entropy_experiments.data.batch import Batch
from entropy_experiments.estimators.delta_h import (
    DeltaH,
    delta_h_from_values,
    eta_values,
    measure_delta_h,
    score_at_eta,
)
from entropy_experiments.estimators.sequence_scores import SequenceScores, units_of
from entropy_experiments.policy.engine import PolicyEngine
from entropy_experiments.probe.beyond import scoring_share
from entropy_experiments.probe.parallel import SINGLE, DistContext, DistributedError

KEY = "EntropyProbeCallback"
DDP_HINT = "launch one process per device with DDP instead (accelerate launch without it, or torchrun)"


class DecisionMismatch(DistributedError):
    """Ranks computed different decisions: applying them would make the replicas diverge."""


def current() -> DistContext:
    """The process group the trainer runs in (accelerate / torchrun made it), or SINGLE in one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return SINGLE
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=int(os.environ.get("LOCAL_RANK", "0")), backend=dist.get_backend())


def writes(dist: DistContext) -> bool:
    """Whether this rank writes files and prints (rank 0 only)."""
    return dist.is_main


def launch_refusal(trainer: Any) -> str | None:
    """One line naming the launch setting the callbacks cannot run under and what works instead; None: fine."""
    from transformers.training_args import ParallelMode

    if getattr(trainer, "is_deepspeed_enabled", False):
        return (f"{KEY}: DeepSpeed (ZeRO) is not supported — each rank holds a shard of the AdamW state and of the "
                f"gradients, so Δθ_next is not known on any rank; {DDP_HINT}")
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer.args, "fsdp", None):
        return (f"{KEY}: FSDP (TrainingArguments.fsdp) is not supported — parameters, gradients and the AdamW "
                f"state are sharded across ranks; {DDP_HINT}")
    if trainer.args.parallel_mode == ParallelMode.NOT_DISTRIBUTED:
        return (f"{KEY}: {trainer.args.n_gpu} GPUs in one process (torch DataParallel) is not supported; "
                f"{DDP_HINT}")
    config = getattr(trainer.accelerator, "parallelism_config", None)
    split = [name for name in ("tp", "cp", "sp") if getattr(config, f"{name}_enabled", False)]
    if split:
        return (f"{KEY}: parallelism_config with {'/'.join(split)} > 1 is not supported (no rank holds the whole "
                f"policy); {DDP_HINT}")
    return None


def per_rank_config(config: ProbeConfig, dist: DistContext) -> ProbeConfig:
    """`config` with teacher-forcing chunks small enough that every rank scores a share of E: ranks split E's
    scoring by whole chunks of `generation.tf_batch_size` rows, so chunks as large as E would leave rank 0 all
    the work (one process: `config` unchanged)."""
    share = max(1, math.ceil(config.batch_config.B_E / dist.world_size))
    if not dist.enabled or config.generation.tf_batch_size <= share:
        return config
    return config.model_copy(update={"generation": config.generation.model_copy(update={"tf_batch_size": share})})


def measured_on_shares(config: ProbeConfig, engine: PolicyEngine, E: Batch, delta: dict[str, Tensor], *,
                       base: SequenceScores, sampler_weights: np.ndarray | None, dist: DistContext,
                       tf_batch_size: int | None = None) -> DeltaH:
    """`delta_h.measure_delta_h` at η = 1 (θ' = θ + delta) on the union E, each rank scoring whole chunks of
    `tf_batch_size` rows of it (None: `generation.tf_batch_size`, the layout `e_pass.score_E` scored `base`,
    the union's scores at θ, in); log w and h' gathered in global order."""
    normalize = config.estimator.normalize
    if not dist.enabled:
        return measure_delta_h(engine, E, delta, [1.0], normalize=normalize, base=base,
                               tf_batch_size=tf_batch_size, sampler_weights=sampler_weights)
    local_E, rows_mine = scoring_share(config, E, dist, tf_batch_size)
    gather = dist.row_gatherer(rows_mine, E.num_prompts * E.num_responses_per_prompt)
    mine = (eta_values(score_at_eta(engine, local_E, delta, 1.0, tf_batch_size=tf_batch_size),
                       base.subset(rows_mine)) if local_E is not None else {})
    per_eta = {1.0: {k: gather(mine.get(k, []), f"realised {k} gather") for k in ("logw", "h_new")}}
    h = np.asarray(base.seq_entropies.tolist(), dtype=np.float64)
    T = np.asarray([len(x) for x in base.token_logqs], dtype=np.float64)
    return delta_h_from_values(h, T, per_eta, normalize=normalize, units=units_of(E.num_prompts,
                                                                                  E.num_responses_per_prompt),
                               sampler_weights=sampler_weights)


def summed(dist: DistContext, named: dict[str, Tensor], what: str) -> dict[str, Tensor]:
    """Σ over ranks of a named gradient dict (each rank's share of an X̂ over the union E), in one float64
    all-reduce; identical on every rank. In one process: `named` itself."""
    return dist.all_reduce_named(named, what)


def digest(values: dict[str, Any]) -> str:
    """A checksum of a decision: floats / ints / bools / None / strings / tensors by their exact bits."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(values):
        value = values[key]
        h.update(key.encode() + b"\0")
        if isinstance(value, Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode() + t.view(torch.uint8).numpy().tobytes())
        elif isinstance(value, bool) or value is None or isinstance(value, str):
            h.update(repr(value).encode())
        else:
            h.update(struct.pack("<d", float(value)))
    return h.hexdigest()


def grads_digest(named: dict[str, torch.nn.Parameter]) -> str:
    """The checksum of every `.grad` the optimizer is about to step (None for a parameter without one)."""
    return digest({n: p.grad for n, p in named.items()})


def agree(dist: DistContext, values: dict[str, Any], what: str) -> None:
    """Check that every rank holds the same decision `values` (one gather of a 16-byte checksum); on a
    mismatch every rank raises `DecisionMismatch` naming the ranks and the values that differ."""
    if not dist.enabled:
        return
    mine = digest(values)
    checksums = dist.all_gather_object(mine, f"{what}: decision checksum")
    if len(set(checksums)) == 1:
        return
    # every rank sees the same checksums, so every rank takes this second gather: no rank is left waiting
    shown = {k: (v if not isinstance(v, Tensor) else f"tensor {digest({k: v})[:8]}") for k, v in values.items()}
    everyone = dist.all_gather_object(shown, f"{what}: decision values")
    differing = sorted(k for k in shown if len({repr(d.get(k)) for d in everyone}) > 1)
    detail = "; ".join(f"{k}: " + ", ".join(f"rank {r} {d.get(k)!r}" for r, d in enumerate(everyone))
                       for k in differing) or "checksums differ"
    raise DecisionMismatch(f"{what}: the ranks' decisions differ ({detail}) — applying them would make the "
                           "replicas diverge")
