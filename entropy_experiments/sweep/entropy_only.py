"""The entropy alone at a checkpoint that takes no next step (`measure_entropy_only`).

A Trainer checkpoint saved at the end of a linear schedule holds lr = 0.0: the probe refuses it (δH₁ would be
0 by construction), yet its entropy is the end point of the last realised change. Here E is drawn exactly as
the probe draws it (the same index plan from the config seed, `probe.sampling.sample_sharded` with seed + 1, so the same
prompts and the same generator seed as at every other checkpoint), scored without gradients, and written to
a run directory like the probe's: config.yaml, run_meta.json, E_batch.pt, per_sequence.jsonl and
entropy_only.json {kind, reason, normalize, H, learning_rate, checkpoint, config_hash, counts}; learning_rate is
the lr the next step takes (0.0 where the schedule ended; the schedule's lr where the next step reuses rollouts). No U, no v,
no δH₁: the reason says why. A killed measurement resumes from its saved E batch or generation chunks.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .. import io_utils
from ..config import ProbeConfig
from ..data.batch import Batch
from ..errors import output_error_on_os_error
from ..estimators.sequence_scores import score_sequences
from ..estimators.surrogate import entropy_estimates
from ..probe.parallel import SINGLE
from ..probe.results import Policy
from ..probe.sampling import BatchDraw, SamplingSpec, draw_plan, prompt_examples, sample_sharded
from ..report.results_dict import per_sequence_rows
from ..report.results_schema import dumps_strict
from ..report.run_dir import GenerationChunkStore, RunDirectory
from .rows import ENTROPY_ONLY_FILE

__all__ = ["measure_entropy_only"]

log = logging.getLogger("entropy_experiments.sweep")


def _sample_E(config: ProbeConfig, policy: Policy, run_dir: RunDirectory, logger: logging.Logger) -> Batch:
    """E as `probe.sampling.sample_phase` draws it (same plan, same seed), or the E batch a killed measurement saved."""
    saved = run_dir.load_batch("E")
    if saved is not None:
        logger.info("entropy only: reusing the saved E batch of %s", run_dir.path)
        return Batch.from_dict(saved, "E_batch")
    examples = prompt_examples(config.batch_config)
    plan = draw_plan(config, len(examples), SINGLE)
    policy.engine.chunk_store = GenerationChunkStore(run_dir)
    spec = SamplingSpec.choose(policy.engine, reference=not config.sampler.batched,
                               chat_template_kwargs=config.batch_config.chat_template_kwargs)
    E = sample_sharded(spec, examples, BatchDraw(plan.E_prompt_indices, plan.E_responses_per_prompt, config.seed + 1,
                                                 None, "E"), SINGLE)
    run_dir.save_batch("E", E.to_dict())
    GenerationChunkStore(run_dir).clear()
    return E


def measure_entropy_only(config: ProbeConfig, policy: Policy, out: Path, reason: str, *, resume: bool,
                         logger: logging.Logger = log) -> dict:
    """Sample E at `policy`'s checkpoint, score it, write the run directory `out`; returns entropy_only.json."""
    run_dir = RunDirectory.prepare(out, config.to_yaml(), config.config_hash(), overwrite=False, resume=resume)
    handler = run_dir.attach_log_handler(logging.getLogger("entropy_experiments"))
    try:
        run_dir.mark_status("running")
        logger.warning("entropy only at %s: %s", config.checkpoint.checkpoint_path, reason)
        E = _sample_E(config, policy, run_dir, logger)
        scores = score_sequences(policy.engine, E)
        h, T = scores.seq_entropies.double(), scores.lengths
        rows = per_sequence_rows(E, scores, None, None, {})
        doc = {"kind": "entropy_only", "reason": reason, "normalize": config.estimator.normalize,
               "H": entropy_estimates(h, T),
               "learning_rate": (policy.checkpoint_info or {}).get("next_step_lr", 0.0), "checkpoint": policy.checkpoint_info, "config_hash": config.config_hash(),
               "counts": {"E_sequences": len(rows), "E_tokens": int(T.sum()),
                          "unique_E_prompts": len(set(E.prompt_ids))}}
        run_dir.write_per_sequence(rows)
        with output_error_on_os_error(f"cannot write {run_dir.path / ENTROPY_ONLY_FILE}"):
            io_utils.atomic_write_text(run_dir.path / ENTROPY_ONLY_FILE, dumps_strict(doc, indent=2) + "\n")
        run_dir.mark_status("complete")
        logger.info("entropy only: Ĥ = %.6g nats per token (%d sequences)", doc["H"]["per_token"], len(rows))
        return doc
    except BaseException:
        run_dir.mark_status("failed")
        raise
    finally:
        logging.getLogger("entropy_experiments").removeHandler(handler)
        handler.close()
