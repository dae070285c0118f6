"""sweep.json per realised interval: the step the run really took and what first order explains of it (docs/maths.md §9).

For an interval N → N' whose `from` run measured the `displacement` predictor (predictors.next_checkpoint = the
`to` checkpoint; over --every K it spans the K steps: Δθ is their chord), from the run directories alone:

* `displacement` {value, se, se_E, second_order {value, se}, steps_spanned, span, delta_theta_norm,
  cos_with_probe_step, probe_step_norm_ratio}: δH_Δθ = X̂(θ_N)·Δθ with its SE_E, ½·D²_Δθ H, and how the probe's
  own step over the interval (K·lr·v) compares with Δθ;
* `first_order` {residual, se, z, method, paired_diagnostic}: ρ₁ = realised − δH_Δθ, with the realised change
  of the `realised` row (its `method`): `importance` — ONE jackknife over the units of both batches, the
  importance estimate's replicates minus δH_Δθ's (they share E_N); `independent_batches` — Ĥ(to) −
  [Ĥ(from) + δH_Δθ], the SEs of the two batches in quadrature. `paired_diagnostic` {residual, se, z}: the same
  with the paired difference Ĥ(E_{N'}) − Ĥ(E_N) (one joint jackknife), which misses the responses that would
  change (docs/realised-change.md): shown, never used. `with_second_order` the same for ρ₂ = ρ₁ − ½·D²_Δθ H
  (estimators/displacement.py);
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

from ..errors import OutputError
from ..estimators.displacement import (
    BatchColumns,
    DisplacementPieces,
    independent_residuals,
    interval_residuals,
    u_noise,
)
from ..estimators.realised_change import importance_realised_replicates, paired_change_replicates

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


def _residuals(frm: BatchColumns, pieces: DisplacementPieces, to: BatchColumns, normalize: str, cross,
               method: str) -> tuple[dict, dict]:
    """(the residuals against the realised change by `method`, those against the paired difference)."""
    paired = interval_residuals(frm, pieces, paired_change_replicates(frm.h, frm.d, frm.keys, to.h, to.d, to.keys,
                                                                      frm.s, to.s), normalize)
    if method == "importance":
        realised = importance_realised_replicates(cross[0], cross[1], normalize=normalize)
        return interval_residuals(frm, pieces, realised, normalize), paired
    return independent_residuals(frm, pieces, to, normalize), paired


def _residual_entry(residuals: dict, paired: dict, key: str, method: str) -> dict | None:
    entry = z_entry(residuals[key])
    return None if entry is None else {**entry, "method": method, "paired_diagnostic": z_entry(paired[key])}


def interval_decomposition(row_a: dict, run_a, run_b, steps: int, normalize: str, *, cross=None,
                           method: str = "independent_batches") -> dict:
    """{displacement, first_order, with_second_order, u_noise} of the interval run_a → run_b (all None when the
    `from` run has no displacement predictor, or one towards another checkpoint). `cross`, `method`: the
    interval's cross scores (cross_scores.read_cross_scores) and the realised change's method (realised.py)."""
    entry = ((run_a.results.get("predictors") or {}).get("displacement") if run_a.kind == "probe" else None)
    none = {"displacement": None, "first_order": None, "with_second_order": None, "u_noise": None}
    target = None if entry is None else entry.get("next_checkpoint")
    if target is None or not _probed_in(run_b, Path(target)):
        return none
    pieces = _pieces(run_a.columns)
    frm = BatchColumns(run_a.h, run_a.d(normalize), run_a.pair_keys, run_a.sampler_weights)
    to = BatchColumns(run_b.h, run_b.d(normalize), run_b.pair_keys, run_b.sampler_weights)
    ratio = entry.get("probe_step_norm_ratio")
    displacement = {"value": entry["delta_h1"], "se": entry.get("se_E"), "se_E": entry.get("se_E"),
                    "second_order": entry.get("second_order"), "steps_spanned": steps,
                    "span": "Δθ = θ_to − θ_from" + (f": the chord of {steps} steps" if steps > 1 else ": one step"),
                    "delta_theta_norm": entry.get("delta_theta_norm"),
                    "cos_with_probe_step": entry.get("cos_with_probe_step"),
                    "probe_step_norm_ratio": None if ratio is None else steps * ratio}
    if pieces is None:
        return {**none, "displacement": displacement}
    try:
        residuals, paired = _residuals(frm, pieces, to, normalize, cross, method)
    except ValueError as exc:  # the interval file was scored on other E batches than these run directories hold
        raise OutputError(f"sweep: the cross scores of {run_a.path.name} → {run_b.path.name} do not match their "
                          f"E batches ({exc}); delete the interval file and rerun the sweep") from exc
    return {"displacement": displacement, "first_order": _residual_entry(residuals, paired, "first_order", method),
            "with_second_order": _residual_entry(residuals, paired, "second_order", method),
            "u_noise": _u_noise_entry(run_a, row_a, frm, pieces, steps)}


def _probed_in(run_b, checkpoint: Path) -> bool:
    """Whether the run in `run_b` probed the checkpoint directory `checkpoint` (its adapter lies in it)."""
    adapter = ((run_b.results.get("checkpoint") or {}).get("files") or {}).get("adapter")
    return adapter is not None and Path(adapter).resolve().is_relative_to(checkpoint.resolve())
