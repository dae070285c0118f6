"""sweep.json per realised interval: the step the run really took and what first order explains of it (MATH.md §9).

For an interval N → N' whose `from` run measured the `displacement` predictor (predictors.next_checkpoint = the
`to` checkpoint; over --every K it spans the K steps: Δθ is their chord), from the run directories alone:

* `displacement` {value, se, se_E, second_order {value, se}, steps_spanned, span, delta_theta_norm,
  cos_with_probe_step, probe_step_norm_ratio}: δH_Δθ = X̂(θ_N)·Δθ with its SE_E, ½·D²_Δθ H, and how the probe's
  own step over the interval (K·lr·v) compares with Δθ;
* `first_order` {residual, se, z}: ρ₁ = realised − δH_Δθ with ONE jackknife over the units of both batches;
  `with_second_order` the same for ρ₂ = ρ₁ − ½·D²_Δθ H (estimators/displacement.py);
* `u_noise` {value, se_E, se, z, variance, probe_U_sequences, trainer_batch_sequences, trainer_batch_source}:
  K·lr·X̂·v − δH_Δθ against √(K²·SE_U² + K·(n_U/n_trainer)·SE_U² + SE_E²) — 2·SE_U² + SE_E² when K = 1 and the
  probe's U has the trainer's batch size. The trainer's batch (sequences per optimizer step) is
  `objective.trainer_batch_completions` when set, else read from the checkpoint (checkpoint.json `data` B_U·G,
  or trainer_state.json `train_batch_size`, which does not count gradient accumulation); when none says, it
  is taken equal to the probe's and the row says so.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..estimators.displacement import BatchColumns, DisplacementPieces, interval_residuals, u_noise

__all__ = ["interval_decomposition", "z_entry"]

SECOND_ORDER_COLUMNS = ("s", "s2", "dh", "d2h")


def z_entry(estimate) -> dict | None:
    """{residual, se, z} of an Estimate (None: not measured; z None where the SE is 0 or undefined)."""
    if estimate is None:
        return None
    ok = math.isfinite(estimate.se) and estimate.se > 0
    return {"residual": estimate.value, "se": estimate.se if math.isfinite(estimate.se) else None,
            "z": estimate.value / estimate.se if ok else None}


def _pieces(columns: dict[str, np.ndarray]) -> DisplacementPieces | None:
    if "displacement.a" not in columns:
        return None
    second = (tuple(columns[f"displacement.{k}"] for k in SECOND_ORDER_COLUMNS)
              if all(f"displacement.{k}" in columns for k in SECOND_ORDER_COLUMNS) else None)
    return DisplacementPieces(columns["displacement.a"], columns["displacement.r"], second,
                              columns.get("a"), columns.get("r"))


def _u_noise_entry(run_a, row_a: dict, frm: BatchColumns, pieces: DisplacementPieces, steps: int) -> dict | None:
    counts = run_a.results.get("counts") or {}
    n_probe = int(counts.get("B_U", 0)) * int(counts.get("G", 0)) or None
    n_trainer, source = row_a.get("trainer_batch_sequences"), row_a.get("trainer_batch_source")
    configured = ((run_a.results.get("checkpoint") or {}).get("trainer_batch") or {}).get("trainer_step_completions")
    if configured:  # objective.trainer_batch_completions (checkpoint/trainer_batch.py) wins over the files
        n_trainer, source = int(configured), "objective.trainer_batch_completions"
    if n_trainer is None or n_probe is None:
        n_trainer, source = n_probe, f"{source}: taken equal to the probe's U"
    ratio = 1.0 if not n_probe or not n_trainer else n_probe / n_trainer
    out = u_noise(frm, pieces, step_lr=row_a["lr"], steps=steps, se_U=row_a["se_U"], u_batch_ratio=ratio)
    if out is not None:
        out.update(probe_U_sequences=n_probe, trainer_batch_sequences=n_trainer, trainer_batch_source=source)
    return out


def interval_decomposition(row_a: dict, run_a, run_b, steps: int, normalize: str) -> dict:
    """{displacement, first_order, with_second_order, u_noise} of the interval run_a → run_b (all None when the
    `from` run has no displacement predictor, or one towards another checkpoint)."""
    entry = ((run_a.results.get("predictors") or {}).get("displacement") if run_a.kind == "probe" else None)
    none = {"displacement": None, "first_order": None, "with_second_order": None, "u_noise": None}
    target = None if entry is None else entry.get("next_checkpoint")
    if target is None or not _probed_in(run_b, Path(target)):
        return none
    pieces = _pieces(run_a.columns)
    frm = BatchColumns(run_a.h, run_a.d(normalize), run_a.pair_keys)
    to = BatchColumns(run_b.h, run_b.d(normalize), run_b.pair_keys)
    ratio = entry.get("probe_step_norm_ratio")
    displacement = {"value": entry["delta_h1"], "se": entry.get("se_E"), "se_E": entry.get("se_E"),
                    "second_order": entry.get("second_order"), "steps_spanned": steps,
                    "span": "Δθ = θ_to − θ_from" + (f": the chord of {steps} steps" if steps > 1 else ": one step"),
                    "delta_theta_norm": entry.get("delta_theta_norm"),
                    "cos_with_probe_step": entry.get("cos_with_probe_step"),
                    "probe_step_norm_ratio": None if ratio is None else steps * ratio}
    if pieces is None:
        return {**none, "displacement": displacement}
    residuals = interval_residuals(frm, pieces, to, normalize)
    return {"displacement": displacement, "first_order": z_entry(residuals["first_order"]),
            "with_second_order": z_entry(residuals["second_order"]),
            "u_noise": _u_noise_entry(run_a, row_a, frm, pieces, steps)}


def _probed_in(run_b, checkpoint: Path) -> bool:
    """Whether the run in `run_b` probed the checkpoint directory `checkpoint` (its adapter lies in it)."""
    adapter = ((run_b.results.get("checkpoint") or {}).get("files") or {}).get("adapter")
    return adapter is not None and Path(adapter).resolve().is_relative_to(checkpoint.resolve())
