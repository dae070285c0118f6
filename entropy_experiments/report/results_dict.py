"""The results dict of one probe run (docs/outputs.md "results.json") and its per-sequence rows.

`assemble_results` only arranges values the phases computed (probe/recipe.py); it computes no statistic.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..data.batch import Batch
from ..data.rewards import reward_warnings
from ..estimators.sampler_correction import correction_diagnostics, sampler_log_weights
from ..estimators.surrogate import entropy_estimates
from .results_schema import SCHEMA_VERSION


@dataclass
class RunFacts:
    """What the report needs besides the estimates: settings, the model (environment), provenance, warnings."""

    normalize: str
    config_hash: str
    seed: int
    entropy_fp64: bool
    u_groups: int                         # U groups of the SE_U jackknife (0: error bars off)
    model: nn.Module
    checkpoint_info: dict | None
    world_size: int
    backend: str | None
    warnings: list[str]
    sampling_warnings: list[str] = field(default_factory=list)
    zero_advantage_prompts: int = 0
    plan: Any = None                      # the IndexPlan of a fresh sampling (None when batches were reused)


def sampler_block(E: dict | None, U: dict | None) -> dict[str, Any]:
    """results.json "sampler": what drew E and U — dtype, engine, draws ("row_keyed" | "chunk_seeded"), and per batch
    the rows per generate call (chosen and after any OOM halving), new tokens, seconds, tokens/s. E, U: each batch's
    `generation` record (the policy engine's `last_generation` when it was drawn, saved with the batch, so a
    resumed run reports the sampling it reused; None: no record — the reference sampler, or batches saved without
    one, which a resumed run still reads). The estimators add their importance-correction diagnostics under "correction"."""
    if E is None and U is None:
        return {"sampled": False}
    first = E or U
    block: dict[str, Any] = {"sampled": True, **{k: first[k] for k in ("dtype", "engine", "draws")}}
    for name, gen in (("E", E), ("U", U)):
        if gen is not None:
            block[name] = {k: v for k, v in gen.items() if k not in ("dtype", "engine", "draws")}
    return block


@dataclass
class ProbeOutcome:
    """One run: the results dict (results.json), one row per E sequence (per_sequence.jsonl), v by name."""

    results: dict[str, Any]
    per_sequence_rows: list[dict]
    update_vector: dict[str, torch.Tensor]
    plan: Any = None                      # the IndexPlan of a fresh sampling
    policy: Any = None                    # probe.results.Policy: the policy engine, the trainable model, the optimizer
    e_tokens: dict | None = None          # E_tokens table columns (probe/attribution.py; None: not computed)


def assemble_results(E: Batch, U: Batch, estimates, later, timing: dict, facts: RunFacts) -> ProbeOutcome:
    """The results dict from the phases' typed results: `estimates` (probe.results.Estimates: δH₁ and its error
    bars) and `later` (probe.results.BeyondFirstOrder: ΔH(η) and its paired residuals, one per η, the
    second-order report, the competing predictors and their per-sequence columns)."""
    res, bars, truth = estimates.delta_h1, estimates.error_bars, later.truth
    second_order, predictors = later.second_order, later.predictors
    scores = res.scores
    results = {
        "schema_version": SCHEMA_VERSION, "deltaH1": res.delta_h1, "x_hat_dot_v": res.x_hat_dot_v,
        "learning_rate": res.learning_rate,
        "e_pass": res.e_pass, "normalize": facts.normalize, "se": bars.se,
        "H_orig": entropy_estimates(scores.seq_entropies, scores.lengths, res.sampler_weights),
        "true": [{**row, "residual": resid,
                  "second_order_prediction": None if second_order is None else second_order["predictions"][f"{row['eta']:g}"]}
                 for row, resid in zip(truth.rows, later.residuals)],
        "second_order": None if second_order is None else {
            k: v for k, v in second_order.items() if k != "predictions"},
        "linearity": truth.linearity,
        "rounding_floor": later.rounding_floor,
        "predictors": predictors,
        "counts": {"B_E": E.num_prompts * E.num_responses_per_prompt,
                   "unique_E_prompts": len(set(E.prompt_ids)), "B_U": U.num_prompts,
                   "G": U.num_responses_per_prompt, "E_tokens": E.count_tokens(), "U_tokens": U.count_tokens(),
                   "zero_advantage_prompts": facts.zero_advantage_prompts,
                   "u_groups": facts.u_groups},
        "update": res.update_info, "consistency": bars.consistency, "timing": timing,
        "environment": {**environment_info(facts.model, facts.entropy_fp64, facts.seed),
                        "distributed": {"world_size": facts.world_size, "backend": facts.backend}},
        "config_hash": facts.config_hash,
        "checkpoint": facts.checkpoint_info,  # layout, files and their sources, base model, lr source
        "sampler": sampler_results(E, scores),
        "warnings": facts.warnings + list(dict.fromkeys(facts.sampling_warnings + list(reward_warnings()))),
    }
    rows = per_sequence_rows(E, scores, bars.a, bars.r, truth.per_sequence, later.per_sequence_extra)
    if E.sampler_logqs is not None:  # log s_i of docs/maths.md §12, before normalisation
        for row, log_w in zip(rows, sampler_log_weights(scores.token_logqs, E.sampler_response_logqs()), strict=True):
            row["sampler_log_weight"] = float(log_w)
    return ProbeOutcome(results, rows, res.v, facts.plan)


def sampler_results(E: Batch, scores) -> dict:
    """results.json `sampler`: `correction`, how far the sampler that drew E is from the policy
    (estimators/sampler_correction.py; None when the sampler is the policy)."""
    rows = E.sampler_response_logqs()
    return {"correction": None if rows is None else correction_diagnostics(scores.token_logqs, rows)}


def per_sequence_rows(E: Batch, scores, a, r, per_eta: dict, extra: dict | None = None) -> list[dict]:
    """One row per E sequence: its prompt, T, h, Σℓ, the pieces a, r, log w at every η (when computed) and the
    `extra` columns {name: {column: [N]}} as row[name] = {column: value} (e.g. the displacement's pieces)."""
    G = E.num_responses_per_prompt
    rows = []
    for n, (logq, ent) in enumerate(zip(scores.token_logqs, scores.token_entropies)):
        b = n // G
        row = {"index": n, "prompt_index": b, "prompt_id": E.prompt_ids[b], "T": len(logq),
               "h": float(ent.sum()), "logq_sum": float(logq.sum())}
        if a is not None:
            row.update({"a": float(a[n]), "r": float(r[n])})
        if per_eta:
            row["logw"] = {f"{eta:g}": d["logw"][n] for eta, d in per_eta.items()}
        for name, columns in (extra or {}).items():
            row[name] = {k: col[n] for k, col in columns.items()}
        rows.append(row)
    return rows


def environment_info(model: nn.Module, entropy_fp64: bool, seed: int) -> dict:
    """Versions, device, dtypes, seed and threads of this run."""
    import peft
    import transformers

    param = next(model.parameters())
    return {"versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "peft": peft.__version__},
            "device": str(param.device), "dtypes": {"parameters": str(param.dtype), "entropy_fp64": entropy_fp64},
            "seeds": {"seed": seed}, "threads": torch.get_num_threads()}
