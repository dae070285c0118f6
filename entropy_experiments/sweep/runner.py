"""`entropy-probe sweep`: the probe on every checkpoint of a training run, then sweep.json and two plots.

    find the checkpoints (discovery.py) → for each, in step order: skip it when its run directory finished,
    else put its adapter + AdamW state on the one loaded base model (policies.py) and run the probe into
    runs/<checkpoint>/ (probe.runner.run_probe, resumable), or measure only Ĥ where no step follows (entropy_only.py)
    → sweep.json from the run directories (rows.py, calibration.py) → trajectory.png, calibration.png.

Every checkpoint is probed with the same config (only checkpoint.checkpoint_path changes), hence the same
seed: E is the same prompts at every checkpoint with responses sampled afresh from each checkpoint's policy
by the same generator seed (common random numbers). After the probes, each interval's two E batches are scored
at both checkpoints (cross_scores.py) for the realised change by importance weights (realised.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

from ..config import ProbeConfig
from ..errors import ConfigError
from ..policy.progress import progress
from ..probe.runner import run_probe
from .calibration import calibration, decomposition_coverage
from .cross_scores import interval_path, read_cross_scores, score_intervals
from .discovery import SweepCheckpoint, find_checkpoints, select_every
from .entropy_only import measure_entropy_only
from .plots import plot_calibration, plot_predictors, plot_trajectory
from .policies import SweepPolicies
from .reuse import mark_rollout_reuse
from .rows import checkpoint_row, read_run, realised_rows
from .summary import print_sweep_summary
from .sweep_dir import SWEEP_KIND, SweepDirectory, sweep_config_hash

__all__ = ["build_sweep_json", "checkpoint_config", "run_sweep"]

log = logging.getLogger("entropy_experiments.sweep")

UNITS = {"per_token": "nats per token", "per_sequence": "nats per sequence"}


def checkpoint_config(config: ProbeConfig, ck: SweepCheckpoint, next_ck: SweepCheckpoint | None = None) -> ProbeConfig:
    """The sweep's config for one checkpoint: checkpoint.checkpoint_path = its directory and, unless
    predictors.displacement and predictors.enabled are both off, predictors.next_checkpoint = the next swept
    checkpoint's (the displacement predictor)."""
    ckpt = config.checkpoint.model_copy(update={"checkpoint_path": str(ck.path.resolve())})
    wanted = config.predictors.enabled or config.predictors.displacement
    nxt = str(next_ck.path.resolve()) if next_ck is not None and wanted else None
    predictors = config.predictors.model_copy(update={"next_checkpoint": nxt})
    return config.model_copy(update={"checkpoint": ckpt, "predictors": predictors})


def _refuse_torchrun() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("entropy-probe sweep runs in one process (it keeps one model loaded); launch it "
                          "without torchrun")


def _announce(config: ProbeConfig, chosen: list[SweepCheckpoint], found: int, every: int,
              logger: logging.Logger) -> None:
    logger.info("sweep: %d of %d checkpoints (--every %d): steps %s", len(chosen), found, every,
                ", ".join(str(c.step) for c in chosen))
    if config.checkpoint.checkpoint_path is not None:
        logger.info("sweep: the config's checkpoint.checkpoint_path %s is not used (each checkpoint sets its own)",
                    config.checkpoint.checkpoint_path)
    if not (config.predictors.enabled or config.predictors.displacement):
        logger.info("sweep: predictors.displacement and predictors.enabled are false, so no interval gets the "
                    "displacement predictor or its decomposition")
    elif not config.predictors.enabled:
        logger.info("sweep: predictors.enabled is false (the default): the displacement predictor and its "
                    "decomposition only; set predictors.enabled: true for the competing predictors and the "
                    "field's proxies")
    if config.learning_rate is not None:
        logger.warning("sweep: learning_rate = %g is set, so every checkpoint's δH₁ uses it, not the lr its "
                       "optimizer saved (the lr of its next step)", config.learning_rate)


def probe_checkpoint(config: ProbeConfig, ck: SweepCheckpoint, sweep: SweepDirectory, policies: SweepPolicies,
                     logger: logging.Logger) -> None:
    """Probe one checkpoint into runs/<name>/ (or measure Ĥ only), unless that run already finished."""
    run_dir = sweep.run_dir(ck.name)
    state = SweepDirectory.run_state(run_dir, config.config_hash())
    if state == "complete":
        logger.info("sweep: %s (step %d) finished earlier: kept", ck.name, ck.step)
        return
    loaded = policies.policy_for(config, ck)
    resume = state == "partial"
    if loaded.no_step is not None:
        measure_entropy_only(config, loaded.policy, run_dir, loaded.no_step, resume=resume, logger=logger)
        return
    run_probe(config, out=None if resume else str(run_dir), resume=str(run_dir) if resume else None,
              policy=loaded.policy, notes=loaded.notes)


def build_sweep_json(config: ProbeConfig, chosen: list[SweepCheckpoint], sweep: SweepDirectory,
                     checkpoints_dir: Path, every: int) -> dict:
    """sweep.json from the finished run directories (nothing is recomputed from a model)."""
    normalize = config.estimator.normalize
    runs = [read_run(sweep.run_dir(ck.name)) for ck in chosen]
    rows = [checkpoint_row(ck, run, normalize, sweep.path) for ck, run in zip(chosen, runs)]
    crosses = [read_cross_scores(interval_path(sweep.path, a.name, b.name)) for a, b in itertools.pairwise(chosen)]
    realised, warnings = realised_rows(rows, runs, normalize, crosses)
    mark_rollout_reuse(rows, realised, config.objective.num_iterations)
    return {"kind": SWEEP_KIND, "checkpoints_dir": str(checkpoints_dir.resolve()), "every": every,
            "config_hash": sweep_config_hash(config), "normalize": normalize, "units": UNITS[normalize],
            "num_iterations": config.objective.num_iterations,
            "n_checkpoints": len(rows), "rows": rows, "realised": realised,
            "calibration": calibration(rows, realised), "decomposition": decomposition_coverage(realised),
            "warnings": warnings}


def run_sweep(config: ProbeConfig, checkpoints_dir: str | Path, *, out: str | None = None,
              resume: str | None = None, every: int = 1, logger: logging.Logger | None = None) -> dict:
    """Probe every (every-th) checkpoint in `checkpoints_dir`, write the sweep directory; returns sweep.json."""
    logger = logger or log
    _refuse_torchrun()
    checkpoints_dir = Path(checkpoints_dir).expanduser()
    found = find_checkpoints(checkpoints_dir, allow_fresh_optimizer=config.checkpoint.allow_fresh_optimizer)
    chosen = select_every(found, every)
    path = Path(resume or out or Path("runs") / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    sweep = SweepDirectory.prepare(path, config, checkpoints_dir, every, resume=resume is not None)
    handler = logging.FileHandler(sweep.log_path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    package_logger = logging.getLogger("entropy_experiments")
    package_logger.addHandler(handler)
    try:
        _announce(config, chosen, len(found), every, logger)
        policies = SweepPolicies(logger)
        for i, ck in enumerate(progress(chosen, "sweep (checkpoints)")):
            logger.info("sweep: checkpoint %d/%d: %s (step %d)", i + 1, len(chosen), ck.name, ck.step)
            next_ck = chosen[i + 1] if i + 1 < len(chosen) else None
            probe_checkpoint(checkpoint_config(config, ck, next_ck), ck, sweep, policies, logger)
        score_intervals(lambda ck: checkpoint_config(config, ck), chosen, sweep.run_dir, sweep.path, policies, logger)
        doc = build_sweep_json(config, chosen, sweep, checkpoints_dir, every)
        sweep.write_sweep(doc)
        plot_trajectory(doc, sweep.path / "trajectory.png")
        plot_calibration(doc, sweep.path / "calibration.png")
        plot_predictors(doc, sweep.path / "predictors.png")
        sweep.mark_status("complete")
        print_sweep_summary(doc)
        logger.info("sweep directory: %s", sweep.path)
        return doc
    except BaseException as exc:
        sweep.mark_status("failed")
        # an interruption is the user's to act on now; after an error the one-line message says what to fix
        (logger.error if isinstance(exc, KeyboardInterrupt) else logger.info)(
            "sweep marked failed; finish it with: entropy-probe sweep --resume %s", sweep.path)
        raise
    finally:
        package_logger.removeHandler(handler)
        handler.close()
