"""Each E batch of an interval scored at the other checkpoint's policy, for the realised change by importance
weights (estimators/realised_change.py; docs/realised-change.md).

For consecutive swept checkpoints N → N' whose run directories both saved E_batch.pt: E_N and E_{N'} are
teacher-forced at θ_N and at θ_{N'} (the adapter swapped onto the sweep's one model; no gradients), and
`intervals/<from>__<to>.json` keeps, per batch and sequence, log w = Σ_k (ℓ_other − ℓ_own) (float64, from
per-token differences: `sequence_scores.log_weights`), h_own, h_other, T and the unit key "draw:prompt id", and
`n_changed`: the draws present in both batches whose responses differ (token ids compared). A batch drawn by a
sampler other than its checkpoint's policy (its saved `sampler_logqs`, docs/maths.md §12) also keeps
`sampler_weights`: s = q_own/q_sampler per sequence (mean 1), from its scores at its own checkpoint; the weights
are relative to the sampler, so the other checkpoint's w rides on top of them (null: no sampler correction). Both batches are
re-scored at their own policy with the same layout, so equal parameters give log w = 0 exactly. A finished
file is kept on --resume. Nothing is written for an interval whose E batches were not saved.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

from .. import io_utils
from ..config import ProbeConfig
from ..data.batch import Batch
from ..errors import OutputError, output_error_on_os_error
from ..estimators.realised_change import CrossScored
from ..estimators.sampler_correction import sequence_weights
from ..estimators.sequence_scores import log_weights, score_sequences
from ..policy.sequences import completion_ids
from ..report.results_schema import dumps_strict
from ..report.run_dir import BATCH_FILES, RunDirectory
from .discovery import SweepCheckpoint
from .policies import SweepPolicies, scoring_engine

__all__ = ["INTERVALS_DIR", "changed_draws", "interval_path", "read_cross_scores", "sampler_weights_at_own",
           "score_intervals"]

INTERVALS_DIR = "intervals"
SIDES = ("forward", "reverse")


def interval_path(sweep_path: Path, from_name: str, to_name: str) -> Path:
    return Path(sweep_path) / INTERVALS_DIR / f"{from_name}__{to_name}.json"


def _keys(E: Batch) -> list[str]:
    G = E.num_responses_per_prompt
    return [f"{b}:{E.prompt_ids[b]}" for b in range(E.num_prompts) for _ in range(G)]


def changed_draws(E_from: Batch, E_to: Batch) -> tuple[int, int]:
    """(draws in both batches whose prompt or response token ids differ, draws in both)."""
    both = min(E_from.num_prompts, E_to.num_prompts)
    changed = sum(E_from.prompt_ids[i] != E_to.prompt_ids[i] or completion_ids(E_from, i) != completion_ids(E_to, i)
                  for i in range(both))
    return int(changed), int(both)


def sampler_weights_at_own(own, E: Batch) -> list[float] | None:
    """s = q_own/q_sampler per sequence of E (mean 1) from E's scores at its own checkpoint and the sampler's
    saved log-probs; None when E was drawn by its own policy."""
    weights = sequence_weights(own.token_logqs, E.sampler_response_logqs())
    return None if weights is None else weights.tolist()


def _side(own, other, E: Batch) -> dict:
    return {"logw": log_weights(other, own).tolist(), "h_own": own.seq_entropies.tolist(),
            "h_other": other.seq_entropies.tolist(), "T": own.lengths.tolist(), "units": _keys(E),
            "sampler_weights": sampler_weights_at_own(own, E)}


def _score_interval(config: ProbeConfig, a: SweepCheckpoint, b: SweepCheckpoint, batches: tuple[Batch, Batch],
                    policies: SweepPolicies) -> dict:
    E_a, E_b = batches
    engine = scoring_engine(policies, config, a)
    a_at_a, b_at_a = score_sequences(engine, E_a), score_sequences(engine, E_b)
    engine = scoring_engine(policies, config, b)
    a_at_b, b_at_b = score_sequences(engine, E_a), score_sequences(engine, E_b)
    changed, both = changed_draws(E_a, E_b)
    return {"from_checkpoint": a.name, "to_checkpoint": b.name, "n_changed": changed, "n_common_draws": both,
            "forward": _side(a_at_a, a_at_b, E_a), "reverse": _side(b_at_b, b_at_a, E_b)}


def score_intervals(config_for, chosen: list[SweepCheckpoint], run_dir_of, sweep_path: Path,
                    policies: SweepPolicies, logger: logging.Logger) -> None:
    """Write intervals/<from>__<to>.json for every consecutive pair with both E batches saved (kept when it
    exists). `config_for(ck)`: the checkpoint's config; `run_dir_of(name)`: its run directory."""
    for a, b in itertools.pairwise(chosen):
        path = interval_path(sweep_path, a.name, b.name)
        if path.is_file():
            continue
        saved = tuple(RunDirectory(run_dir_of(ck.name)).load_batch("E") for ck in (a, b))
        if any(E is None for E in saved):
            logger.warning("sweep: %s → %s: no saved %s (output.save_batches false?): the realised change "
                           "falls back to two independent-batch entropies", a.name, b.name, BATCH_FILES["E"])
            continue
        logger.info("sweep: scoring E of %s and %s at both checkpoints (realised change)", a.name, b.name)
        batches = tuple(Batch.from_dict(E, "E_batch") for E in saved)
        doc = _score_interval(config_for(a), a, b, batches, policies)
        with output_error_on_os_error(f"cannot write {path}"):
            path.parent.mkdir(parents=True, exist_ok=True)
            io_utils.atomic_write_text(path, dumps_strict(doc) + "\n")


def read_cross_scores(path: Path) -> tuple[CrossScored, CrossScored, dict] | None:
    """(forward, reverse, {n_changed, n_common_draws}) from an interval file; None when there is none."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        sides = [CrossScored(**{k: doc[s][k] for k in ("logw", "h_own", "h_other", "T", "units")},
                             sampler_weights=doc[s].get("sampler_weights")) for s in SIDES]
        return sides[0], sides[1], {"n_changed": int(doc["n_changed"]), "n_common_draws": int(doc["n_common_draws"])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OutputError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
