"""OfflineEntropyProbe: the orchestrator (ARCHITECTURE.md phases 0–5).

    python -m entropy_experiments.offline_entropy_probe --config FILE [--dryrun]

0. sampling (index plan → SequenceProcessor generation → packed E and U batches), or saved batches;
1–3. U gradient and the AdamW update direction v; E scored once with forward-mode derivatives along v;
     X̂ by a microbatched backward; δH₁ = lr·X̂·v with SE_E, SE_U, SE_total;
4. ΔH(η) by SNIS on the same E for every η;
5. results dict (written to the run directory by `run_probe`).

Under `torchrun --nproc_per_node=N -m entropy_experiments.offline_entropy_probe --config FILE` the
phases run data-parallel over torch.distributed (see distributed.py): rank 0 draws and broadcasts the
index plan, each rank samples, teacher-forces and back-propagates its slice, the reductions are
explicit, and only rank 0 writes the run directory.
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import importance_sampling as isamp
from .checkpoint import (
    BaseModelChoice,
    CheckpointFiles,
    LearningRate,
    checkpoint_info,
    fresh_adam_optimizer,
    load_adam_optimizer_from_path,
    load_peft_for_probe,
    load_tokenizer,
    log_checkpoint_files,
    resolve_base_model_id,
    resolve_checkpoint,
    resolve_learning_rate,
    schedule_hint,
)
from .config import ProbeConfig, config_from_dict, load_config
from .data.batch import count_tokens, validate_batch, zero_advantage_prompts
from .data.plan import draw_index_plan
from .distributed import DistContext, init_from_env
from .errors import CheckpointError, OptimizerStateError, ProbeError
from .estimators import jackknife as cv
from .probe_components import ProbeComponents, split_into_groups
from .sampling import sample_batch_sharded

log = logging.getLogger("entropy_experiments.probe")

DRYRUN_OVERRIDES = {"batch_config": {"B_E": 4, "B_U": 2, "G": 2}, "generation": {"max_new_tokens": 16}}


def dryrun_config(config: ProbeConfig) -> ProbeConfig:
    """The same config at minimal sizes (B_E=4, B_U=2, G=2, max_new_tokens=16): a one-minute check."""
    d = config.to_dict()
    for section, values in DRYRUN_OVERRIDES.items():
        d[section].update(values)
    return config_from_dict(d)


class OfflineEntropyProbe:
    """Loads the checkpoint, samples E and U, and runs the probe phases. See the module docstring."""

    def __init__(self, config: ProbeConfig | dict, logger: logging.Logger | None = None, *,
                 dist: DistContext | None = None):
        self.config = config if isinstance(config, ProbeConfig) else config_from_dict(config)
        self.logger = logger or log
        self.dist = dist  # None: from the environment (torchrun) at the first run
        self.index_plan = None  # the IndexPlan of the last fresh sampling
        self.model = None
        self.tokenizer = None
        self.optimizer = None
        self._sequence_processor = None
        self.warnings: list[str] = []
        self.sampling_warnings: list[str] = []  # reward warnings of a resumed run's sampling (saved with its batches)
        self.chunk_store = None  # results.GenerationChunkStore: generation chunks saved as they complete
        self.update_vector: dict[str, torch.Tensor] | None = None  # v of the last run, keyed by parameter name
        self.checkpoint_info: dict[str, Any] | None = None  # layout, files, base model, lr source (load())

    @classmethod
    def from_config_file(cls, path: str | Path, overrides: list[str] | None = None) -> OfflineEntropyProbe:
        return cls(load_config(path, overrides))

    # ------------------------------------------------------------------ loading
    def _warn(self, message: str) -> None:
        """A warning that changes how a result must be read: logged loudly and kept for results.json."""
        self.logger.warning(message)
        if message not in self.warnings:
            self.warnings.append(message)

    def _ensure_dist(self) -> DistContext:
        """This process's DistContext, made from the environment (torchrun) on first use."""
        if self.dist is None:
            self.dist = init_from_env(self.config.distributed)
        return self.dist

    def _load_lora_model(self, lora_path: str, base: BaseModelChoice):
        """Load the base model + LoRA adapter (trainable, active), upcast to fp32, eval mode (MATH.md §7)."""
        ck = self.config.checkpoint
        device_map = ck.device_map
        if self._ensure_dist().backend == "nccl":  # one GPU per rank
            device_map = f"cuda:{self.dist.local_rank}"
        try:
            model = load_peft_for_probe(base.name, lora_path, use_qlora=ck.use_qlora, dtype=ck.dtype,
                                        device_map=device_map, trust_remote_code=ck.trust_remote_code)
            self.tokenizer = load_tokenizer(base.name, trust_remote_code=ck.trust_remote_code)
        except CheckpointError as exc:
            if base.source == "checkpoint.base_model" or f"base model {base.name!r}" not in str(exc):
                raise
            raise CheckpointError(f"{exc} (the base model came from {base.source}; set checkpoint.base_model "
                                  "to load another)") from exc
        if not ck.use_qlora and ck.dtype != "fp32":
            # Stored in bf16/fp16, computed in fp32: bf16 runtimes quantise the log-prob changes away.
            model = model.float()
        if not ck.use_qlora:
            model.eval()
        self.model = model
        return model

    def _load_optimizer(self, files: CheckpointFiles) -> LearningRate:
        """The AdamW state (mapped onto the model as the layout says) and the learning rate of δH₁.

        A missing state is an error unless checkpoint.allow_fresh_optimizer; a resolved lr of 0 (a
        schedule that ended) is an error here, before any sampling.
        """
        ck, config_lr = self.config.checkpoint, self.config.learning_rate
        fresh = False
        try:
            if files.optimizer_path is None:
                raise OptimizerStateError(f"optimizer state file not found: {files.sources['optimizer']}; "
                                          "set checkpoint.optimizer_path")
            self.optimizer = load_adam_optimizer_from_path(
                self.model, files.optimizer_path, lr=config_lr, param_names_path=files.param_names_path,
                position_order=files.position_order)
        except OptimizerStateError as exc:
            if not ck.allow_fresh_optimizer:
                raise
            self._warn(f"FRESH OPTIMIZER: {exc} — checkpoint.allow_fresh_optimizer is true, so v is the first "
                       "Adam step from zero moments, NOT the step training would take")
            self.optimizer, fresh = fresh_adam_optimizer(self.model, lr=config_lr or 1e-5), True
        lr = resolve_learning_rate(config_lr, self.optimizer.param_groups,
                                   schedule=schedule_hint(files.trainer_state_path))
        if fresh and config_lr is None:
            lr = LearningRate(lr.value, "the fresh optimizer's default (no optimizer state)", None)
        self.logger.info("learning rate %.6g from %s%s", lr.value, lr.source,
                         "" if lr.initial_lr is None else f" (saved initial_lr {lr.initial_lr})")
        return lr

    def _ensure_sequence_processor(self):
        if self._sequence_processor is None:
            from .utils.sequence_processor import SequenceProcessor

            self._sequence_processor = SequenceProcessor(self.model, self.tokenizer, config=self.config,
                                                         logger=self.logger)
            self._sequence_processor.chunk_store = self.chunk_store
        return self._sequence_processor

    def _warn_objective_mismatches(self, files) -> None:
        """Loud warnings (kept for results.json) where the objective may not be the trainer's."""
        objective, ck = self.config.objective, self.config.checkpoint
        if files.layout == "trainer" and objective.trainer is None and objective.loss_type is None:
            self._warn(f"OBJECTIVE NOT SET: {ck.checkpoint_path} was written by a Hugging Face Trainer (TRL?) but "
                       "neither objective.trainer nor objective.loss_type is set, so v is the step of the seeds' "
                       "Dr-GRPO loss (dr_grpo_per_prompt), not your trainer's; set objective.trainer: trl "
                       "(or verl / openrlhf) — see README 'Probing a TRL / verl / OpenRLHF run'")
        options = self.config.objective_options()
        max_new = self.config.generation.max_new_tokens
        if options.loss_type == "dr_grpo" and options.max_completion_length != max_new:
            self._warn(f"objective.max_completion_length is {options.max_completion_length} (dr_grpo's constant "
                       f"normaliser) but generation.max_new_tokens is {max_new}: set both to your trainer's "
                       "max_completion_length, or the gradient scale and the sampled lengths are not the trainer's")

    def load(self, checkpoint_path: str | None = None) -> None:
        """Load model, tokenizer, optimizer and SequenceProcessor from the config's checkpoint section.

        The files come from `checkpoint_layout.resolve_checkpoint` (a `checkpoint_path` given here
        replaces the config's, and its layout decides every file); what was used is kept in
        `self.checkpoint_info` for results.json.
        """
        ck = self.config.checkpoint
        if checkpoint_path is not None:
            ck = ck.model_copy(update={"checkpoint_path": checkpoint_path, "adapter_path": None,
                                       "optimizer_path": None})
            self.config = self.config.model_copy(update={"checkpoint": ck})
        files = resolve_checkpoint(ck.checkpoint_path, ck.adapter_path, ck.optimizer_path)
        log_checkpoint_files(files, self.logger)
        base = resolve_base_model_id(ck.base_model, files.adapter_dir)
        self.logger.info("base model: %s (from %s)", base.name, base.source)
        if base.warning is not None:
            self._warn(base.warning)
        self._warn_objective_mismatches(files)
        self._load_lora_model(str(files.adapter_dir), base)
        lr = self._load_optimizer(files)
        self.checkpoint_info = checkpoint_info(files, base, lr)
        self._ensure_sequence_processor()

    # ------------------------------------------------------------------ phase 0
    def _examples(self) -> list:
        from .data.datasets import load_examples

        bc = self.config.batch_config
        return load_examples(bc.dataset_name, bc.split, dataset_path=bc.dataset_path, pool_size=bc.pool_size)

    def _pack_E_from_sequences(self, seqs) -> dict:
        from .data.batch import pack_batch
        return pack_batch(seqs, None, with_advantages=False)

    def _pack_U_from_sequences(self, seqs, rewards: list[list[float]]) -> dict:
        from .data.batch import pack_batch
        return pack_batch(seqs, rewards, with_advantages=True)

    def _sample_EU_via_sequence_processor(self, *, B_E: int, B_U: int, G_U: int) -> tuple[dict, dict]:
        """E: B_E prompts with replacement × 1 (or distinct × G); U: B_U distinct prompts × G."""
        bc, seed = self.config.batch_config, self.config.seed
        sp = self._ensure_sequence_processor()
        examples = self._examples()
        dist = self._ensure_dist()
        plan = error = None
        if dist.is_main:  # rank 0 draws the plan; the other ranks receive it (or rank 0's error)
            try:
                plan = draw_index_plan(len(examples), B_E=B_E, B_U=B_U, G=G_U, E_sampling_mode=bc.E_sampling_mode,
                                       seed=seed, max_prompts_pool=bc.max_prompts_pool)
            except ProbeError as exc:
                error = exc
        plan, message = dist.broadcast_object((plan, str(error) if error else None), "index plan broadcast")
        if error is not None:
            raise error
        if message is not None:
            raise ProbeError(message)
        reference = not self.config.probe_rework.use_sequence_processor_sampling
        desc = plan.describe()
        self.logger.info("Phase 0: sampling E = %d sequences (%d unique prompts, largest repeat %d, G=%d) and "
                         "U = %d prompts × G=%d%s", desc["E_sequences"], desc["unique_E_prompts"],
                         desc["largest_E_repeat"], plan.E_responses_per_prompt, B_U, G_U,
                         " [reference sampler]" if reference else "")
        if dist.enabled:
            self.logger.info("Phase 0: rank %d of %d samples %d E and %d U prompts", dist.rank, dist.world_size,
                             len(dist.prompt_slice(len(plan.E_prompt_indices))),
                             len(dist.prompt_slice(len(plan.U_prompt_indices))))
        self.index_plan = plan
        E = sample_batch_sharded(sp, examples, plan.E_prompt_indices, plan.E_responses_per_prompt, seed=seed + 1,
                                 with_rewards=False, reference=reference, dist=dist, what="E")
        U = sample_batch_sharded(sp, examples, plan.U_prompt_indices, G_U, seed=seed + 2, with_rewards=True,
                                 reference=reference, dist=dist, what="U")
        return E, U

    # ------------------------------------------------------------------ phases 1–5
    def run_mixed_probe(self, checkpoint_path: str | None = None, *, batches: tuple[dict, dict] | None = None,
                        on_batches=None) -> dict[str, Any]:
        """Run every phase; returns the results dict (ARCHITECTURE.md "results.json").

        `batches` = (E, U) reuses saved batches (resume); `on_batches(E, U)` is called right after
        sampling so that the caller can save them before the long phases start.
        """
        cfg = self.config
        timing: dict[str, float] = {}
        t_start = time.perf_counter()
        from .data.rewards import clear_reward_warnings
        clear_reward_warnings()  # warnings of an earlier run in this process are not this run's
        dist = self._ensure_dist()
        if self.model is None:
            t0 = time.perf_counter()
            self.load(checkpoint_path)
            timing["load"] = time.perf_counter() - t0
        sp = self._ensure_sequence_processor()

        t0 = time.perf_counter()
        if batches is None:
            bc = cfg.batch_config
            E_batch, U_batch = self._sample_EU_via_sequence_processor(B_E=bc.B_E, B_U=bc.B_U, G_U=bc.G)
        else:
            E_batch, U_batch = batches
            validate_batch(E_batch, "E_batch")
            validate_batch(U_batch, "U_batch")
            self.logger.info("Phase 0: reusing saved batches (E %d×%d, U %d×%d)", E_batch["num_prompts"],
                             E_batch["num_responses_per_prompt"], U_batch["num_prompts"],
                             U_batch["num_responses_per_prompt"])
        timing["phase0_sampling"] = time.perf_counter() - t0
        dist.checkpoint("sampled")
        if on_batches is not None:
            on_batches(E_batch, U_batch)
        n_zero = zero_advantage_prompts(U_batch)
        self.logger.info("U: %d of %d prompts have all-zero advantages (they add nothing to v)", n_zero,
                         U_batch["num_prompts"])
        if n_zero == U_batch["num_prompts"]:
            self._warn("every U prompt has all-zero advantages: the update direction is pure weight decay / "
                       "momentum (check rewards and gold answers)")

        # Phases 1–3
        components = ProbeComponents(self.model, cfg, self.logger, sequence_processor=sp, dist=dist)
        B_U = U_batch["num_prompts"]
        K = cfg.variance.u_groups or min(B_U, 8)
        u_groups = split_into_groups(B_U, min(K, B_U)) if cfg.variance.enabled else None
        t0 = time.perf_counter()
        res = components.compute_delta_h1_from_batches(E_batch, U_batch, self.optimizer, u_groups=u_groups,
                                                       per_sequence_pieces=cfg.variance.enabled)
        timing.update({f"phase1_3_{k}": v for k, v in res.timings.items()})
        dist.checkpoint("delta_h1")
        lr = res.learning_rate
        self.update_vector = res.Ybar
        scores = res.scores
        lengths, seq_h = scores.lengths, scores.seq_entropies
        se = {"E": float("nan"), "U": float("nan"), "total": float("nan")}
        consistency = {}
        a = r = None
        if cfg.variance.enabled:
            t1 = time.perf_counter()
            a, r = components.pieces(res)
            from_pieces, se["E"] = cv.se_E(a, r, seq_h, lengths, scores.unit_of_sequence,
                                           normalize=cfg.estimator.normalize, learning_rate=lr)
            rel = abs(from_pieces - res.delta_h1) / max(abs(res.delta_h1), 1e-300)
            consistency = {"deltaH1_from_pieces": from_pieces, "relative_difference": rel,
                           "pieces_method": res.pieces_method}
            if rel > 1e-3:
                self._warn(f"per-sequence pieces disagree with the backward X̂·v by {rel:.2e} "
                           "relative; error bars may be unreliable")
            if len(u_groups) >= 2:
                loo = cv.leave_one_group_out_directions(components, res.u_gradients, self.optimizer)
                se["U"], _ = cv.se_U(res.Xbar, loo, learning_rate=lr)
            else:
                self._warn("SE_U unavailable: U has a single prompt (need ≥ 2 groups)")
            se["total"] = cv.se_total(se["E"], se["U"]) if np.isfinite(se["U"]) else se["E"]
            timing["phase3_variance"] = time.perf_counter() - t1
        timing["phase1_3_total"] = time.perf_counter() - t0
        self.logger.info("δH₁ = %+.4e ± %.2e (SE_E %.2e, SE_U %.2e) at lr = %.3g", res.delta_h1, se["total"],
                         se["E"], se["U"], lr)

        # Phase 4
        truth = {"true": [], "linearity": isamp.stats.linearity_fit([], []), "per_sequence": {}}  # NaN slopes
        if cfg.importance.enabled:
            t0 = time.perf_counter()
            etas = isamp.eta_grid(cfg.importance.eta_list, cfg.importance.symmetric)
            truth = isamp.measure_delta_h(
                sp, E_batch, res.Ybar, etas, normalize=cfg.estimator.normalize, mode=cfg.importance.mode,
                optimizer=self.optimizer, named_params=list(zip(components.param_names, components.params)),
                grads=res.u_gradients.total, max_grad_norm=components.objective.max_grad_norm, dist=dist)
            timing["phase4_importance"] = time.perf_counter() - t0
        timing["total"] = time.perf_counter() - t_start

        H_tok = float(seq_h.sum() / lengths.sum())
        H_seq = float(seq_h.mean())
        results = {
            "deltaH1": res.delta_h1,
            "bars_dot": res.bars_dot,
            "learning_rate": lr,
            "normalize": cfg.estimator.normalize,
            "se": se,
            "H_orig": {"per_token": H_tok, "per_sequence": H_seq},
            "true": truth["true"],
            "linearity": truth["linearity"],
            "counts": {"B_E": E_batch["num_prompts"] * E_batch["num_responses_per_prompt"],
                       "unique_E_prompts": len(set(E_batch["prompt_ids"])), "B_U": B_U,
                       "G": U_batch["num_responses_per_prompt"], "E_tokens": count_tokens(E_batch),
                       "U_tokens": count_tokens(U_batch), "zero_advantage_prompts": n_zero,
                       "u_groups": len(u_groups) if u_groups else 0},
            "update": res.update_info,
            "consistency": consistency,
            "timing": timing,
            "environment": {**environment_info(self.model, cfg),
                            "distributed": {"world_size": dist.world_size, "backend": dist.backend}},
            "config_hash": cfg.config_hash(),
            "checkpoint": self.checkpoint_info,  # layout, files and their sources, base model, lr source
            "warnings": list(self.warnings) + list(dict.fromkeys(self.sampling_warnings + _reward_warnings())),
        }
        results["per_sequence_rows"] = _per_sequence_rows(E_batch, scores, a, r, truth["per_sequence"])
        return results


def _reward_warnings() -> list[str]:
    try:
        from .data.rewards import reward_warnings
        return list(reward_warnings())
    except ImportError:
        return []


def _per_sequence_rows(E_batch: dict, scores, a, r, per_eta: dict) -> list[dict]:
    G = E_batch["num_responses_per_prompt"]
    rows = []
    for n, (logq, ent) in enumerate(zip(scores.token_logqs, scores.token_entropies)):
        b = n // G
        row = {"index": n, "prompt_index": b, "prompt_id": E_batch["prompt_ids"][b], "T": len(logq),
               "h": float(ent.sum()), "logq_sum": float(logq.sum())}
        if a is not None:
            row.update({"a": float(a[n]), "r": float(r[n])})
        if per_eta:
            row["logw"] = {f"{eta:g}": d["logw"][n] for eta, d in per_eta.items()}
        rows.append(row)
    return rows


def environment_info(model, cfg: ProbeConfig) -> dict:
    import peft
    import transformers

    param = next(model.parameters())
    return {"versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "peft": peft.__version__},
            "device": str(param.device), "dtypes": {"parameters": str(param.dtype),
                                                    "entropy_fp64": cfg.precision.entropy_fp64},
            "seeds": {"seed": cfg.seed}, "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------- running with a run directory
def run_probe(config: ProbeConfig, *, out: str | None = None, resume: str | None = None, overwrite: bool = False,
              dryrun: bool = False, logger: logging.Logger | None = None) -> dict:
    """Run the probe and write its run directory (unless dryrun). Returns the results dict.

    Launched by torchrun with several ranks, every rank computes and only rank 0 writes: rank 0 prepares
    the run directory and broadcasts the saved batches of a resumed run (or its error).
    """
    from .report.summary import print_summary

    logger = logger or log
    dist = init_from_env(config.distributed)
    try:
        if dryrun:
            config = dryrun_config(config)
            probe = OfflineEntropyProbe(config, logger, dist=dist)
            results = probe.run_mixed_probe()
            results.pop("per_sequence_rows")
            if dist.is_main:
                print_summary(results)
            logger.info("dry run: nothing written")
            return results
        if not dist.is_main:
            return _run_probe_worker(config, dist, logger)
        return _run_probe_main(config, dist, out=out, resume=resume, overwrite=overwrite, logger=logger)
    finally:
        dist.shutdown()


def _run_probe_worker(config: ProbeConfig, dist: DistContext, logger: logging.Logger) -> dict:
    """A rank > 0: receive rank 0's saved batches (resume) and compute; write nothing."""
    package_logger = logging.getLogger("entropy_experiments")
    if package_logger.getEffectiveLevel() > logging.DEBUG:  # rank 0 tells the story; the others only warn
        package_logger.setLevel(logging.WARNING)
    status, payload = dist.broadcast_object(None, "run directory broadcast")
    if status == "error":
        raise ProbeError(payload)
    probe = OfflineEntropyProbe(config, logger, dist=dist)
    results = probe.run_mixed_probe(batches=payload)
    results.pop("per_sequence_rows")
    return results


def _run_probe_main(config: ProbeConfig, dist: DistContext, *, out: str | None, resume: str | None,
                    overwrite: bool, logger: logging.Logger) -> dict:
    from .lifecycle import hold_point
    from .report.results_schema import validate_results_schema
    from .report.run_dir import GenerationChunkStore, RunDirectory
    from .report.summary import print_summary

    run_path = Path(resume or out or config.output.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    try:
        run_dir = RunDirectory.prepare(run_path, config.to_yaml(), config.config_hash(), overwrite=overwrite,
                                       resume=resume is not None)
    except ProbeError as exc:
        dist.broadcast_object(("error", str(exc)), "run directory broadcast")
        raise
    handler = run_dir.attach_log_handler(logging.getLogger("entropy_experiments"))
    try:
        run_dir.mark_status("running")
        batches = None
        if resume is not None:
            try:
                E, U = run_dir.load_batch("E"), run_dir.load_batch("U")
            except ProbeError as exc:
                dist.broadcast_object(("error", str(exc)), "run directory broadcast")
                raise
            if E is not None and U is not None:
                batches = (E, U)
                logger.info("resuming %s from its saved E and U batches", run_path)
            elif run_dir.has_partial_chunks():
                logger.info("resuming %s: reusing the generation chunks it saved", run_path)
        if dist.enabled:
            dist.broadcast_object(("ok", batches), "run directory broadcast")

        def save_batches(E, U):
            if config.output.save_batches and batches is None:
                run_dir.save_batch("E", E)
                run_dir.save_batch("U", U)
                run_dir.save_partial("sampling_warnings", _reward_warnings())
                chunks.clear()
                hold_point("batches_saved")

        probe = OfflineEntropyProbe(config, logger, dist=dist)
        chunks = GenerationChunkStore(run_dir)
        if config.output.save_batches:
            probe.chunk_store = chunks
        if batches is not None:
            probe.sampling_warnings = list(run_dir.load_partial("sampling_warnings") or [])
        results = probe.run_mixed_probe(batches=batches, on_batches=save_batches)
        rows = results.pop("per_sequence_rows")
        validate_results_schema(results)
        run_dir.save_update_vector(probe.update_vector, {"learning_rate": repr(results["learning_rate"]),
                                                         "direction": results["update"]["direction"],
                                                         "units": "parameter change per unit learning rate"})
        run_dir.write_per_sequence(rows)
        run_dir.write_results(results)
        hold_point("results_written")
        if config.output.plot:
            from .report.plot import plot_delta_h
            plot_delta_h(results, run_dir.path / "delta_h_vs_eta.png")
        run_dir.mark_status("complete")
        print_summary(results)
        logger.info("run directory: %s", run_dir.path)
        return results
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m entropy_experiments.offline_entropy_probe",
                                     description="Run the offline entropy probe on a config file.")
    parser.add_argument("--config", required=True)
    parser.add_argument("--dryrun", action="store_true", help="minimal sizes, print the summary, write nothing")
    args = parser.parse_args(argv)
    from .cli import run_with_clean_errors
    return run_with_clean_errors(lambda: run_probe(load_config(args.config), dryrun=args.dryrun))


if __name__ == "__main__":
    sys.exit(main())
