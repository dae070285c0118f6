"""Generation with row-keyed draws (policy/row_keyed.py): rows in spans of `rows_per_call`, any grouping.

Every row's tokens depend only on (seed, row index b·G + g, step), so the rows per generate call are chosen
for speed, an out-of-memory halving retries the rows left with fewer rows per call and changes nothing, and a
resumed run reuses whatever spans a killed one saved (keyed by their first row) and regenerates the rest.
With `record`, each row's log q_sampler of its T tokens comes back with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from entropy_experiments.errors import NumericsError
from entropy_experiments.policy.oom import shrink_after_oom, unless_out_of_memory
from entropy_experiments.policy.policy_model import PolicyModel
from entropy_experiments.policy.progress import progress
from entropy_experiments.policy.row_keyed import RowKeyedDraw
from entropy_experiments.policy.sampling_policy import NonFiniteLogitsError

__all__ = ["RowKeyedRun", "generate_row_keyed", "generate_spans", "sampler_logq_tensor"]


@dataclass
class RowKeyedRun:
    """What one row-keyed generation did: responses [R], log q per row ([T] float32 each, or None), the rows
    per call it started with and ended with (after any OOM halving), and the spans reused from a store."""

    responses: list[list[int]] = field(default_factory=list)
    logqs: list[Tensor] | None = None
    rows_per_call: int = 0
    rows_per_call_final: int = 0
    reused_spans: int = 0


def _call_rows(policy: PolicyModel, ids: Tensor, mask: Tensor, rows: Tensor, G: int, seed: int, record: bool,
               chunk_generator: Callable[..., Any], module: nn.Module) -> tuple[list[list[int]], list[Tensor]]:
    """One generate call for the global rows `rows` → (responses, per-row log q of their T tokens)."""
    config = policy.config
    draw = RowKeyedDraw(config.temperature, config.top_p, seed, rows, int(ids.shape[1]), record=record)
    try:
        part, _ = chunk_generator(ids, mask, (rows // G).to(ids.device), draw=draw, module=module)
    except NonFiniteLogitsError as exc:
        b, g = divmod(int(rows[exc.row]), G)
        raise NumericsError(f"non-finite logits in generation: sequence b={b} g={g}, token "
                            f"{getattr(exc, 'position', ids.shape[1]) - ids.shape[1]}") from None
    logq = draw.logqs()
    return part, [logq[i, :len(r)].clone() for i, r in enumerate(part)] if record else []


def _generate_span(policy, ids, mask, start, stop, G, seed, record, state, chunk_generator, module):
    """Rows [start, stop) in calls of at most state["limit"] rows; on OOM the rows not yet done are retried
    with half as many rows per call (their draws do not depend on it)."""
    responses: list[list[int]] = []
    logqs: list[Tensor] = []
    s = start
    while s < stop:
        limit = state["limit"]
        rows = torch.arange(s, min(s + limit, stop))
        out, reason = unless_out_of_memory(
            lambda rows=rows: _call_rows(policy, ids, mask, rows, G, seed, record, chunk_generator, module))
        if reason is not None:
            state["limit"] = shrink_after_oom(limit, reason, f"generation (rows {s}-{int(rows[-1])})",
                                              policy.logger)
            continue
        responses.extend(out[0])
        logqs.extend(out[1])
        s += len(rows)
    return responses, logqs


def generate_spans(R: int, rows_per_call: int, make_span: Callable[[int, int, int], tuple[list, list]], *,
                   record: bool, done_spans: Mapping[int, Any] | None = None,
                   on_span: Callable[..., None] | None = None,
                   on_first_group: Callable[[list[list[int]]], None] | None = None, G: int = 1) -> RowKeyedRun:
    """Rows [0, R) in spans of `rows_per_call`: span i = rows [start, stop) from `make_span(i, start, stop)` →
    (responses, per-row log q [T] or []), unless `done_spans` {first row: {"responses", "logqs"}} covers exactly
    that span (then reused); `on_span(first row, responses, logqs)` is called as each new span completes (to
    save it); `on_first_group` gets the first G responses as soon as they exist."""
    run = RowKeyedRun(logqs=[] if record else None, rows_per_call=rows_per_call)
    starts = list(range(0, R, rows_per_call))
    for i, start in enumerate(progress(starts, "generate", total=len(starts))):
        stop = min(start + rows_per_call, R)
        saved = (done_spans or {}).get(start)
        if isinstance(saved, dict) and len(saved["responses"]) == stop - start and \
                (not record or saved.get("logqs") is not None):
            rows = [list(map(int, r)) for r in saved["responses"]]
            logqs = [torch.tensor(q, dtype=torch.float32) for q in saved["logqs"]] if record else []
            run.reused_spans += 1
        else:
            rows, logqs = make_span(i, start, stop)
            if on_span is not None:
                on_span(start, rows, [q.tolist() for q in logqs] if record else None)
        run.responses.extend(rows)
        if record:
            run.logqs.extend(logqs)
        if on_first_group is not None and len(run.responses) >= G:
            on_first_group(run.responses[:G])
            on_first_group = None
    return run


def generate_row_keyed(policy: PolicyModel, ids: Tensor, mask: Tensor, G: int, rows_per_call: int, *, seed: int,
                       record: bool, module: nn.Module, chunk_generator: Callable[..., Any],
                       done_spans: Mapping[int, Any] | None = None,
                       on_span: Callable[..., None] | None = None,
                       on_first_group: Callable[[list[list[int]]], None] | None = None) -> RowKeyedRun:
    """The B·G responses (row = b·G + g) in spans of `rows_per_call` rows, drawn row-keyed from `seed`.

    `done_spans` {first row: {"responses", "logqs"}} are reused when they cover exactly a span;
    `on_span(first row, responses, logqs)` is called as each span completes (to save it)."""
    state = {"limit": rows_per_call}

    def make_span(_index: int, start: int, stop: int):
        return _generate_span(policy, ids, mask, start, stop, G, seed, record, state, chunk_generator, module)

    run = generate_spans(int(ids.shape[0]) * G, rows_per_call, make_span, record=record, done_spans=done_spans,
                         on_span=on_span, on_first_group=on_first_group, G=G)
    run.rows_per_call_final = state["limit"]
    return run


def sampler_logq_tensor(logqs: list[Tensor], B: int, G: int, Lp: int, L: int) -> Tensor:
    """[B, G, L] float32: row b·G + g's log q at its response positions [Lp, Lp + T), 0 elsewhere."""
    out = torch.zeros((B, G, L), dtype=torch.float32)
    for r, q in enumerate(logqs):
        b, g = divmod(r, G)
        out[b, g, Lp:Lp + len(q)] = q
    return out
