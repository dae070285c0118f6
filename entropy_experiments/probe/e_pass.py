"""The E pass of δH₁ (docs/maths.md §3–4, docs/scaling.md): X̂ = ∇L_X on E, the E scores, the surrogate's
coefficients and the per-sequence pieces (a, r) along each direction — by one of four strategies, chosen once
by `choose_e_pass`. Each has one name: its class, the config value that selects it and results.json's `e_pass`
(`E_PASSES`):

    BackwardHooksPass      backward_hooks (variance.directional): one forward + backward per microbatch; the
                           pieces from the backward's row hooks (exact r_i)
    CentralDifferencePass  central_difference (variance.r_method): scores without grad, then the L_X backward whose
                           row hooks give D_v L_X,i; r_i is left to the ±η passes (beyond.central_difference_phase)
    JvpPass                jvp (variance.directional): scores first with the jvp along each direction, then the
                           L_X backward
    TwoPass                two_pass (no key: what runs when no pieces are wanted, variance.enabled false): scores
                           without grad, then the L_X backward

Like recipe.py this module knows the ranks: microbatches split over ranks, sums all-reduced, rows gathered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

from torch import Tensor

from ..config import ProbeConfig
from ..data.batch import Batch
from ..estimators.entropy_gradient import (
    coefficients,
    e_microbatches,
    finish_one_pass,
    one_pass_sums,
    sampler_weights,
    surrogate_gradient_rows,
)
from ..estimators.objective_gradient import prompts_per_microbatch
from ..estimators.sequence_scores import SequenceScores, score_sequences, units_of
from ..estimators.surrogate import SurrogateCoefficients, directional_pieces
from ..policy.progress import progress as progress_bar
from ..tensors import NamedTensors
from .beyond import scoring_share
from .parallel import SINGLE, DistContext
from .results import Policy, SurrogatePass

MAIN = "v"  # the key of the probe's own direction among the directions the E pass takes pieces along


def progress(desc: str):
    """Progress over the work items of a loop (a bar on a terminal, else log lines: policy/progress.py)."""
    return lambda items: progress_bar(items, desc)


class EPass(Protocol):
    """One way of running the E pass: its name, the key that selects it, what it records about itself, and the pass."""

    name: ClassVar[str]                # the strategy's one word: results.json `e_pass`, the config value
    config_key: ClassVar[str | None]   # the key whose value `name` selects it (None: chosen when no pieces are wanted)
    r_method: ClassVar[str]            # "backward" | "jvp" | "central_difference" (r_i by the ±η passes, later)

    def scores_tf_batch(self, config: ProbeConfig, E: Batch) -> int | None:
        """Rows per forward the E scores were made with (None: the config's tf_batch_size)."""

    def run(self, config: ProbeConfig, policy: Policy, E: Batch, directions: dict[str, NamedTensors],
            dist: DistContext) -> SurrogatePass:
        """X̂, the scores, the coefficients and the pieces along `directions` ({name: v}; MAIN is v), timed."""


@dataclass(frozen=True)
class BackwardHooksPass:
    """One forward + backward per microbatch; the pieces along every direction from the row hooks."""

    name: ClassVar[str] = "backward_hooks"
    config_key: ClassVar[str | None] = "variance.directional"
    r_method: ClassVar[str] = "backward"

    def scores_tf_batch(self, config: ProbeConfig, E: Batch) -> int | None:
        G = E.num_responses_per_prompt
        return prompts_per_microbatch(config.entropy_options().microbatch_size, G) * G

    def run(self, config, policy, E, directions, dist) -> SurrogatePass:
        t0 = time.perf_counter()
        e_pass = one_pass_phase(config, policy, E, directions, dist)
        return replace(e_pass, timings={"e_pass_backward": time.perf_counter() - t0})


@dataclass(frozen=True)
class ScoredFirst:
    """The passes that score E first, then run the L_X backward (`scored_pieces_phase` with their name)."""

    name: ClassVar[str]

    def scores_tf_batch(self, config: ProbeConfig, E: Batch) -> int | None:
        return None

    def run(self, config, policy, E, directions, dist) -> SurrogatePass:
        return scored_pieces_phase(config, policy, E, directions, self.name, dist)


@dataclass(frozen=True)
class CentralDifferencePass(ScoredFirst):
    """Scores without grad, then the L_X backward with the row hooks along v alone (r_i later, by the ±η passes)."""

    name: ClassVar[str] = "central_difference"
    config_key: ClassVar[str | None] = "variance.r_method"
    r_method: ClassVar[str] = "central_difference"


@dataclass(frozen=True)
class JvpPass(ScoredFirst):
    """Scores with the jvp along each direction (the pieces), then the L_X backward."""

    name: ClassVar[str] = "jvp"
    config_key: ClassVar[str | None] = "variance.directional"
    r_method: ClassVar[str] = "jvp"


@dataclass(frozen=True)
class TwoPass(ScoredFirst):
    """Scores without grad, then the L_X backward: no pieces (no error bars wanted them)."""

    name: ClassVar[str] = "two_pass"
    config_key: ClassVar[str | None] = None
    r_method: ClassVar[str] = "backward"


E_PASSES: dict[str, type] = {cls.name: cls for cls in (BackwardHooksPass, CentralDifferencePass, JvpPass, TwoPass)}


def choose_e_pass(method: str, r_method: str, n_directions: int) -> EPass:
    """The E pass for `method` (entropy_gradient.pieces_method: backward_hooks | jvp | two_pass). r_i by the
    central difference (variance.r_method) only along v alone: every other direction would cost two no-grad
    passes, more than the L_β backward that gives them all (docs/scaling.md "r_i without the second backward")."""
    if method == BackwardHooksPass.name and r_method == CentralDifferencePass.name and n_directions == 1:
        return CentralDifferencePass()
    return E_PASSES[method]()


def score_E(config: ProbeConfig, policy: Policy, E: Batch, v: NamedTensors | None,
            dist: DistContext = SINGLE) -> SequenceScores:
    """ℓ, H (and with v their derivatives along v) of every E sequence; each rank scores its share."""
    local_E, rows_mine = scoring_share(config, E, dist)
    local = score_sequences(policy.engine, local_E, v_named=v) if local_E is not None else None
    if not dist.enabled:
        return local
    units = units_of(E.num_prompts, E.num_responses_per_prompt)
    rows = {} if local is None else local.rows(rows_mine)
    return SequenceScores.from_rows(dist.gather_rows(rows, len(units), "E scores gather"), units)


def one_pass_phase(config: ProbeConfig, policy: Policy, E: Batch, directions: dict[str, NamedTensors],
                   dist: DistContext = SINGLE) -> SurrogatePass:
    """X̂, the E scores, the coefficients and the pieces along each of `directions` ({name: v}; empty: none)
    from ONE forward per microbatch (baseline none)."""
    options = config.entropy_options()
    G, N = E.num_responses_per_prompt, E.num_prompts * E.num_responses_per_prompt
    sums = one_pass_sums(policy.engine, policy.trainable, E,
                         dist.chunk_slice(e_microbatches(E.num_prompts, G, options.microbatch_size)), options,
                         directions, agree_on_shift=lambda s: dist.broadcast_float(s, "E shift broadcast"),
                         agree_on_scale=lambda c: dist.max_float(c, "E sampler-weight scale"),
                         progress=progress("E backward (entropy surrogate)"))
    if dist.enabled:  # one flat all-reduce: X_α, X_β and the per-sequence a, r (zero off this rank)
        summed = dist.all_reduce_tree({"alpha": sums.X_alpha, "beta": sums.X_beta, "a": sums.a, "r": sums.r},
                                      "X̂ all-reduce")
        sums.X_alpha, sums.X_beta, sums.a, sums.r = summed["alpha"], summed["beta"], summed["a"], summed["r"]
    gathered = dist.gather_rows(sums.rows, N, "E scores gather")
    scores = SequenceScores(token_logqs=[row[0] for row in gathered], token_entropies=[row[1] for row in gathered],
                            unit_of_sequence=units_of(E.num_prompts, G))
    X, coefs, pieces = finish_one_pass(sums, scores, options, E.sampler_response_logqs())
    return SurrogatePass(X, scores, coefs, pieces)


def scored_pieces_phase(config: ProbeConfig, policy: Policy, E: Batch, directions: dict[str, NamedTensors],
                        name: str, dist: DistContext = SINGLE) -> SurrogatePass:
    """The E pass `name` that scores E first: "jvp" (the scores with the jvp along v, the pieces along every
    other direction by one more jvp scoring pass each), "central_difference" (no jvp; the backward's row hooks
    give D_v L_X,i, whose r_i the ±η passes give later: beyond.central_difference_phase) or "two_pass" (no
    pieces); then X̂ by a second backward pass. Returns the timings too."""
    with_pieces = name == JvpPass.name
    hooked = {MAIN: directions[MAIN]} if name == CentralDifferencePass.name else {}  # D_v L_X,i by the row hooks
    timings, t0 = {}, time.perf_counter()
    scores = score_E(config, policy, E, directions[MAIN] if with_pieces else None, dist)
    coefs = coefficients(scores, config.entropy_options(), sampler_weights(scores, E.sampler_response_logqs()))
    pieces = {}
    if with_pieces:
        pieces[MAIN] = directional_pieces(scores.d_logq, scores.d_entropy, coefs)
        for key, v in directions.items():
            if key != MAIN:
                other = score_E(config, policy, E, v, dist)
                pieces[key] = directional_pieces(other.d_logq, other.d_entropy, coefs)
    timings["e_pass_scoring"], t0 = time.perf_counter() - t0, time.perf_counter()
    X, rows = surrogate_rows_phase(config, policy, E, coefs, hooked, dist)
    timings["e_pass_backward"] = time.perf_counter() - t0
    return SurrogatePass(X, scores, coefs, pieces, timings, rows.get(MAIN))


def surrogate_gradient_phase(config: ProbeConfig, policy: Policy, E: Batch, coefs: SurrogateCoefficients,
                             dist: DistContext = SINGLE) -> NamedTensors:
    """X̂ = ∇L_X with the coefficients of the whole E (this rank's microbatches, summed over ranks), fp32."""
    return surrogate_rows_phase(config, policy, E, coefs, {}, dist)[0]


def surrogate_rows_phase(config: ProbeConfig, policy: Policy, E: Batch, coefs: SurrogateCoefficients,
                         directions: dict[str, NamedTensors], dist: DistContext = SINGLE
                         ) -> tuple[NamedTensors, dict[str, Tensor]]:
    """X̂ = ∇L_X with the coefficients of the whole E (this rank's microbatches, summed over ranks), fp32, and
    D_u L_X,i [N] along each of `directions` from the same backward (row hooks)."""
    options = config.entropy_options()
    microbatches = e_microbatches(E.num_prompts, E.num_responses_per_prompt, options.microbatch_size)
    X, rows = surrogate_gradient_rows(policy.engine, policy.trainable, E, dist.chunk_slice(microbatches), coefs,
                                      directions, progress=progress("E backward (entropy surrogate)"))
    summed = dist.all_reduce_tree({"X": X, "rows": rows}, "X̂ all-reduce")
    return {n: t.float() for n, t in summed["X"].items()}, summed["rows"]
