"""One forward-mode pass over E along v, made once and shared by the phases that need it (docs/scaling.md "One
tangent pass along v"):

    second order (`second_order.method: jvp`)  the per-sequence sums s, s2, dh, d2h, h, T (estimators/second_order.py)
    token attribution                          H_t and D_v H_t per realised token (probe/attribution.py)

With the second order by jvp the pass is forward over forward (order 2), and its order-0 and order-1 values are
the attribution's scores: the attribution costs no pass of its own. Without it, an order-1 pass when the
attribution wants the exact D_v H_t (`output.token_attribution_method: jvp`, or no ΔH pass to difference) and
the E pass made no jvp scores (pieces by backward hooks); else no pass. The result is
frozen and handed to each phase by recipe.py; no phase edits it.

Like beyond.py this module knows the ranks: each rank scores its share of E and the rows are gathered in order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..config import ProbeConfig
from ..data.batch import Batch
from ..estimators.sequence_scores import (
    SECOND_ORDER_KEYS,
    SequenceScores,
    directional_rows,
    jvp_scores,
    second_order_sums_of,
    units_of,
)
from .attribution import token_choice
from .beyond import scoring_share
from .parallel import SINGLE, DistContext
from .results import DeltaH1Result, Policy


@dataclass(frozen=True)
class TangentAlongV:
    """The shared pass along v: `scores` ℓ, H, D_vℓ, D_vH per token of all E (None: no pass), `sums` the
    second-order sums {SECOND_ORDER_KEYS: float64 [N]} (None: no order-2 pass), its `order` (0: none) and
    `seconds`."""

    scores: SequenceScores | None = None
    sums: dict[str, np.ndarray] | None = None
    order: int = 0
    seconds: float = 0.0


def tangent_order(config: ProbeConfig, res: DeltaH1Result) -> int:
    """2 with the second order by jvp; 1 for the token attribution when the E pass left no jvp scores and no ΔH
    passes give D_v H_t (attribution.token_choice); else 0."""
    if config.second_order.enabled and config.second_order.method == "jvp":
        return 2
    wanted = config.output.token_attribution and res.scores.d_entropy is None
    return 1 if wanted and token_choice(config) is None else 0


def tangent_phase(config: ProbeConfig, policy: Policy, E: Batch, res: DeltaH1Result,
                  dist: DistContext = SINGLE) -> TangentAlongV:
    """The one pass along `res.v` of the order `tangent_order` asks for (none: an empty TangentAlongV)."""
    order = tangent_order(config, res)
    if order == 0:
        return TangentAlongV()
    t0 = time.perf_counter()
    G, B = E.num_responses_per_prompt, E.num_prompts
    local_E, rows_mine = scoring_share(config, E, dist)
    rows = directional_rows(policy.engine, local_E, res.v, order=order) if local_E is not None else []
    scores = jvp_scores(rows, units_of(B, G) if not dist.enabled else [])
    if dist.enabled:  # each rank's rows, merged in global order
        gathered = dist.gather_rows(scores.rows(rows_mine) if rows else {}, B * G, "E jvp scores gather")
        scores = SequenceScores.from_rows(gathered, units_of(B, G))
    sums = None
    if order == 2:
        mine = second_order_sums_of(rows) if rows else None
        gather = dist.row_gatherer(rows_mine, B * G)
        sums = {k: gather(mine[k] if mine else [], f"second-order sums gather ({k})") for k in SECOND_ORDER_KEYS}
    return TangentAlongV(scores, sums, order, time.perf_counter() - t0)
