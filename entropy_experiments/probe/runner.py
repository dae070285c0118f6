"""A probe run with its run directory: `run_probe(config, out=..., resume=...)` (what `entropy-probe run` calls).

The run directory (report/run_dir.py) is prepared before anything is computed; E and U are saved as
soon as they are sampled (and generation chunks as they complete), so that a killed run resumes
without sampling again; results.json, per_sequence.jsonl and v are written at the end, atomically.
Launched by torchrun with several ranks, every rank computes and only rank 0 writes: rank 0 prepares
the run directory and broadcasts the saved batches of a resumed run (or its error).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ..config import ProbeConfig, config_from_dict
from ..data.batch import Batch
from ..data.rewards import reward_warnings
from ..errors import ProbeError
from ..report.html_report import write_html_report
from ..report.plot import plot_delta_h
from ..report.results_schema import validate_results_schema
from ..report.run_dir import GenerationChunkStore, RunDirectory
from ..report.run_lines import objective_lines
from ..report.summary import print_summary
from ..report.token_table import write_token_table
from . import recipe
from .parallel import DistContext, init_from_env
from .reanalysis import copy_samples, reusable_samples
from .results import Policy, WarningLog
from .what_if import WhatIfRequest, what_if_hook, what_if_text

log = logging.getLogger("entropy_experiments.probe")

DRYRUN_OVERRIDES = {"batch_config": {"B_E": 4, "B_U": 2, "G": 2}, "generation": {"max_new_tokens": 16}}


def dryrun_config(config: ProbeConfig) -> ProbeConfig:
    """The same config at minimal sizes (B_E=4, B_U=2, G=2, max_new_tokens=16): a one-minute check."""
    d = config.to_dict()
    for section, values in DRYRUN_OVERRIDES.items():
        d[section].update(values)
    return config_from_dict(d)


def run_probe(config: ProbeConfig, *, out: str | None = None, resume: str | None = None, overwrite: bool = False,
              dryrun: bool = False, logger: logging.Logger | None = None, policy: Policy | None = None,
              notes: WarningLog | None = None, reuse_samples: str | None = None,
              what_if: WhatIfRequest | None = None) -> dict:
    """Run the probe and write its run directory (unless dryrun). Returns the results dict.

    `policy`: the checkpoint of `config` already loaded (one process only; `entropy-probe sweep` loads the
    base model once), with `notes` holding the warnings its loading raised (they go into results.json).
    `reuse_samples`: a run directory whose saved E / U batches are analysed instead of sampling (reanalysis.py).
    `what_if`: other objectives' δH₁ on the same E and U (probe/what_if.py)."""
    logger = logger or log
    dist = init_from_env(config.distributed)
    if policy is not None and dist.enabled:
        raise ValueError("run_probe(policy=...) runs in one process; under torchrun every rank loads its own")
    try:
        if dryrun:
            results = recipe.run(dryrun_config(config), dist=dist, logger=logger,
                                 after_estimates=what_if_hook(what_if)).results
            if dist.is_main:
                print_summary(results)
                print(what_if_text(results))
            logger.info("dry run: nothing written")
            return results
        if not dist.is_main:
            return run_worker(config, dist, logger, what_if)
        return run_main(config, dist, out=out, resume=resume, overwrite=overwrite, logger=logger, policy=policy,
                        notes=notes, reuse_samples=reuse_samples, what_if=what_if)
    finally:
        dist.shutdown()


def run_worker(config: ProbeConfig, dist: DistContext, logger: logging.Logger,
               what_if: WhatIfRequest | None = None) -> dict:
    """A rank > 0: receive rank 0's saved batches (resume) and compute; write nothing."""
    package_logger = logging.getLogger("entropy_experiments")
    if package_logger.getEffectiveLevel() > logging.DEBUG:  # rank 0 tells the story; the others only warn
        package_logger.setLevel(logging.WARNING)
    status, payload = dist.broadcast_object(None, "run directory broadcast")
    if status == "error":
        raise ProbeError(payload)
    return recipe.run(config, dist=dist, batches=typed_batches(payload), logger=logger,
                      after_estimates=what_if_hook(what_if)).results


def open_run_directory(config: ProbeConfig, dist: DistContext, *, out: str | None, resume: str | None,
                       overwrite: bool) -> RunDirectory:
    """The run directory, created (or reopened to resume); an error is shared with the other ranks."""
    run_path = Path(resume or out or config.output.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    try:
        return RunDirectory.prepare(run_path, config.to_yaml(), config.config_hash(), overwrite=overwrite,
                                    resume=resume is not None)
    except ProbeError as exc:
        dist.broadcast_object(("error", str(exc)), "run directory broadcast")
        raise


def reused_samples(config: ProbeConfig, dist: DistContext, source: str | None) -> tuple[dict, dict] | None:
    """Another run's saved batches for a re-analysis (None: no --reuse-samples); an error is shared."""
    if source is None:
        return None
    try:
        return reusable_samples(source, config)
    except ProbeError as exc:
        if dist.enabled:
            dist.broadcast_object(("error", str(exc)), "run directory broadcast")
        raise


def resumed_batches(run_dir: RunDirectory, dist: DistContext, resume: str | None,
                    logger: logging.Logger, reused: tuple[dict, dict] | None = None) -> tuple[Batch, Batch] | None:
    """The E and U batches a resumed run saved, or `reused` ones (None: sample them), shared with the other ranks."""
    batches = reused
    if resume is not None and reused is None:
        try:
            E, U = run_dir.load_batch("E"), run_dir.load_batch("U")
        except ProbeError as exc:
            dist.broadcast_object(("error", str(exc)), "run directory broadcast")
            raise
        if E is not None and U is not None:
            batches = (E, U)
            logger.info("resuming %s from its saved E and U batches", run_dir.path)
        elif run_dir.has_partial_chunks():
            logger.info("resuming %s: reusing the generation chunks it saved", run_dir.path)
    if dist.enabled:
        dist.broadcast_object(("ok", batches), "run directory broadcast")
    return typed_batches(batches)


def typed_batches(saved: tuple[dict, dict] | None) -> tuple[Batch, Batch] | None:
    """Saved E_batch.pt / U_batch.pt dicts as checked `Batch`es (every rank checks the ones it received)."""
    return None if saved is None else (Batch.from_dict(saved[0], "E_batch"), Batch.from_dict(saved[1], "U_batch"))


def run_main(config: ProbeConfig, dist: DistContext, *, out: str | None, resume: str | None, overwrite: bool,
             logger: logging.Logger, policy: Policy | None = None, notes: WarningLog | None = None,
             reuse_samples: str | None = None, what_if: WhatIfRequest | None = None) -> dict:
    """Rank 0 (or the only process): prepare the run directory, run the probe, write every file."""
    reused = reused_samples(config, dist, reuse_samples)
    run_dir = open_run_directory(config, dist, out=out, resume=resume, overwrite=overwrite)
    handler = run_dir.attach_log_handler(logging.getLogger("entropy_experiments"))
    try:
        run_dir.mark_status("running")
        if reused is not None:
            copy_samples(reuse_samples, run_dir.path)
            logger.info("re-analysing the saved samples of %s", reuse_samples)
        batches = resumed_batches(run_dir, dist, resume, logger, reused)
        outcome = probe_into(run_dir, config, dist, batches, logger, policy=policy, notes=notes,
                             after_estimates=what_if_hook(what_if))
        if reused is not None:
            outcome.results["samples"] = {"reused_from": str(Path(reuse_samples).resolve())}
        write_outcome(run_dir, config, outcome)
        run_dir.clear_partial()  # generation chunks exist only to resume an unfinished sampling
        run_dir.mark_status("complete")
        print_summary(outcome.results)
        if what_if is not None:
            print(what_if_text(outcome.results))
        logger.info("run directory: %s", run_dir.path)
        return outcome.results
    except BaseException as exc:
        run_dir.mark_status("failed")
        if isinstance(exc, KeyboardInterrupt):
            logger.error("%s: run marked failed; finish it with: entropy-probe run --resume %s",
                         exc or "interrupted", run_dir.path)
        elif isinstance(exc, ProbeError) and (hint := run_dir.resume_hint()):  # e.g. a reward that raised
            logger.info(hint)
        raise
    finally:
        logging.getLogger("entropy_experiments").removeHandler(handler)
        handler.close()


def probe_into(run_dir: RunDirectory, config: ProbeConfig, dist: DistContext, batches: tuple[Batch, Batch] | None,
               logger: logging.Logger, *, policy: Policy | None = None,
               notes: WarningLog | None = None, after_estimates=None) -> recipe.ProbeOutcome:
    """`recipe.run`, saving E and U (and the generation chunks) into the run directory as they are made."""
    chunks = GenerationChunkStore(run_dir)

    def save_batches(E: Batch, U: Batch) -> None:
        if config.output.save_batches and batches is None:
            run_dir.save_batch("E", E.to_dict())
            run_dir.save_batch("U", U.to_dict())
            run_dir.record_meta("sampling_warnings", list(reward_warnings()))
            chunks.clear()

    sampling_warnings = saved_sampling_warnings(run_dir) if batches is not None else []
    logger.info("objective (v is its next AdamW step): %s; %s", *objective_lines(config.objective_options().to_dict()))
    return recipe.run(config, dist=dist, batches=batches, on_batches=save_batches,
                     chunk_store=chunks if config.output.save_batches else None,
                     sampling_warnings=sampling_warnings, logger=logger, policy=policy, notes=notes,
                     after_estimates=after_estimates)


def saved_sampling_warnings(run_dir: RunDirectory) -> list[str]:
    """The reward warnings of the sampling that made a resumed run's batches (run_meta.json; partial/ in
    run directories of older versions)."""
    saved = (run_dir.read_meta() or {}).get("sampling_warnings")
    if saved is None:
        saved = run_dir.load_partial("sampling_warnings")
    return [str(w) for w in saved or []]


def write_outcome(run_dir: RunDirectory, config: ProbeConfig, outcome: recipe.ProbeOutcome) -> None:
    """results.json (schema-checked), per_sequence.jsonl, v, E_tokens.parquet, report.html and the plot."""
    results = outcome.results
    validate_results_schema(results)
    run_dir.save_update_vector(outcome.update_vector, {"learning_rate": repr(results["learning_rate"]),
                                                       "direction": results["update"]["direction"],
                                                       "units": "parameter change per unit learning rate"})
    run_dir.write_per_sequence(outcome.per_sequence_rows)
    run_dir.write_results(results)
    if outcome.e_tokens is not None:
        write_token_table(run_dir.path, outcome.e_tokens)
    write_html_report(run_dir.path)
    if config.output.plot:
        plot_delta_h(results, run_dir.path / "delta_h_vs_eta.png")
