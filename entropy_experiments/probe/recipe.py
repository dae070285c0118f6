"""The probe, phase by phase (docs/development.md "Layout"): `run(config, dist=...) -> ProbeOutcome`.

    load      checkpoint → the policy, its AdamW state and the lr of δH₁            (checkpoint/load.py)
    sample    index plan → E and U generated, rewarded and packed                   (probe/sampling.py)
    update    g = ∇L_U of the trainer objective → v, the AdamW step per unit lr      (estimators/objective_gradient.py)
    entropy   X̂ = ∇L_X on E, the scores and (for the error bars) the pieces a, r    (estimators/entropy_gradient.py)
    bars      SE_E, SE_U, SE_total                                                  (estimators/error_bars.py)
    beyond    ΔH(η) by SNIS on the same E, paired residuals, d2 = D²_v H, competing predictors
                                                                                   (probe/beyond.py)
    report    the results dict and the per-sequence rows                             (report/results_dict.py)

Only this module, beyond.py, sampling.py, runner.py and parallel.py know about ranks. Under torchrun rank 0 draws the index plan;
each rank runs its contiguous share of the work items a single process would run (so every microbatch
is computed as in one process); float64 sums are all-reduced, per-sequence values gathered in order.
"""

from __future__ import annotations

import logging
import time
from functools import partial

from torch import Tensor

from ..checkpoint.displacement import NEXT_CHECKPOINT_KEY, displacement_to
from ..checkpoint.learning_rate import resolve_learning_rate
from ..checkpoint.load import load_for_probe, locate_checkpoint
from ..checkpoint.rollouts import refuse_rollout_reuse
from ..checkpoint.runtime_precision import runtime_precision_warnings
from ..checkpoint.trainer_batch import trainer_batch_record
from ..checkpoint.trainer_log import vllm_correction_warnings
from ..config import ProbeConfig
from ..data.batch import Batch
from ..data.rewards import clear_reward_warnings
from ..errors import ConfigError
from ..estimators.entropy_gradient import (
    coefficients,
    e_microbatches,
    finish_one_pass,
    one_pass_sums,
    pieces_method,
    sampler_weights,
    surrogate_gradient_rows,
)
from ..estimators.error_bars import ErrorBars, error_bars
from ..estimators.objective_gradient import (
    Trainable,
    UGradients,
    objective_gradient_sums,
    prompts_per_microbatch,
    split_into_groups,
    u_gradients,
    u_terms,
    u_work_items,
)
from ..estimators.sampler_correction import correction_diagnostics, correction_warnings
from ..estimators.sequence_scores import SequenceScores, score_sequences, units_of
from ..estimators.step_directions import predictor_directions, probe_step, step_direction
from ..estimators.surrogate import SurrogateCoefficients, directional_pieces
from ..estimators.update_direction import named_dot, named_norm
from ..policy.engine import PolicyEngine
from ..policy.progress import progress as progress_bar
from ..report.results_dict import ProbeOutcome, RunFacts, assemble_results, sampler_block
from ..tensors import NamedTensors
from .attribution import attribution_phase
from .beyond import beyond_first_order_phase, central_difference_phase, scoring_share
from .memory_plan import budgeted_config
from .parallel import SINGLE, DistContext, init_from_env
from .preflight import preflight
from .results import DeltaH1Result, Estimates, Policy, Samples, SurrogatePass, UpdateStep, WarningLog
from .sampling import sample_phase, saved_batches, warn_zero_advantages

log = logging.getLogger("entropy_experiments.probe")
MAIN = "v"  # the key of the probe's own direction among the directions the E pass takes pieces along
DISPLACEMENT = "displacement"  # the key of Δθ = θ_next − θ among them (predictors.next_checkpoint)


def progress(desc: str):
    """Progress over the work items of a loop (a bar on a terminal, else log lines: policy/progress.py)."""
    return lambda items: progress_bar(items, desc)


def process_context(config: ProbeConfig) -> DistContext:
    """This process's place in a torchrun job (SINGLE semantics when not launched by torchrun)."""
    return init_from_env(config.distributed)


# ---------------------------------------------------------------------- phase: load
def load_phase(config: ProbeConfig, dist: DistContext, notes: WarningLog, logger: logging.Logger = log) -> Policy:
    """The checkpoint of `config.checkpoint` loaded: policy model (one GPU per rank under nccl), AdamW, lr."""
    ck = config.checkpoint
    files, base = locate_checkpoint(ck, logger)
    refuse_rollout_reuse(config.objective.num_iterations, files.trainer_state_path, str(ck.checkpoint_path))
    if base.warning is not None:
        notes.warn(base.warning)
    for message in [*config.objective_warnings(files.layout), *vllm_correction_warnings(
            files.trainer_state_path, config.objective.vllm_importance_sampling_correction)]:
        notes.warn(message)
    device_map = f"cuda:{dist.local_rank}" if dist.backend == "nccl" else None
    loaded = load_for_probe(ck, files, base, config.learning_rate, device_map=device_map,
                            runtime_dtype=config.precision.runtime_dtype, logger=logger)
    for message in loaded.warnings:
        notes.warn(message)
    bc = config.batch_config
    loaded.info["trainer_batch"], batch_warning = trainer_batch_record(
        config.objective.trainer_batch_completions, files.trainer_state_path, bc.B_U, bc.G)
    if batch_warning is not None:
        notes.warn(batch_warning)
    engine = PolicyEngine(loaded.model, loaded.tokenizer, config.policy_settings(), logger)
    return Policy(engine, Trainable.of(loaded.model), loaded.optimizer, loaded.tokenizer, loaded.info)


def displacement_phase(config: ProbeConfig, policy: Policy, notes: WarningLog) -> NamedTensors | None:
    """Δθ = θ_next − θ to `predictors.next_checkpoint` (None: not set); Δθ = 0 is recorded as a warning."""
    path = config.predictors.next_checkpoint
    if path is None:
        return None
    if not config.predictors.enabled:
        raise ConfigError(f"{NEXT_CHECKPOINT_KEY} is set but predictors.enabled is false: the displacement "
                          "predictor is one of the predictors")
    t = policy.trainable
    delta = displacement_to(t.model, path, list(t.names), list(t.params))
    if named_norm(delta) == 0:
        notes.warn(f"{NEXT_CHECKPOINT_KEY} {path}: the adapter is unchanged (Δθ = 0), so δH_Δθ = 0")
    return delta


# ---------------------------------------------------------------------- phases 1–3: update and entropy
def update_gradients(config: ProbeConfig, policy: Policy, U: Batch, groups: list[list[int]],
                     dist: DistContext = SINGLE) -> UGradients:
    """g per group of U prompts: this rank's share of the microbatches, summed over ranks."""
    options = config.objective_options()
    terms = u_terms(U, options)
    per_mb = prompts_per_microbatch(config.estimator.microbatch_size, U.num_responses_per_prompt)
    items = dist.chunk_slice(u_work_items(terms, groups, options, per_mb))
    sums, loss = objective_gradient_sums(policy.engine, policy.trainable, U, items, terms, options, len(groups),
                                         progress=progress("U backward (trainer objective gradient)"))
    if dist.enabled:  # one flat all-reduce of the K group buffers (+ the loss)
        summed = dist.all_reduce_tree({"groups": sums, "loss": loss}, "U gradient all-reduce")
        sums, loss = summed["groups"], summed["loss"]
    return u_gradients(sums, loss, U, groups, options)


def update_phase(config: ProbeConfig, policy: Policy, U: Batch, groups: list[list[int]] | None,
                 dist: DistContext = SINGLE) -> UpdateStep:
    """g (per group; one group by default) → v, the AdamW step per unit lr, and its description."""
    grads = update_gradients(config, policy, U, groups or [list(range(U.num_prompts))], dist)
    v, info = step_direction(config.step_options(), policy, grads.total)
    info["u_loss"] = grads.loss
    return UpdateStep(grads, v, info)


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
                        with_pieces: bool, dist: DistContext = SINGLE, lean: bool = False) -> SurrogatePass:
    """E scored first (with the jvp along v when the pieces are wanted), X̂ by a second backward pass; the
    pieces along every other direction by one more jvp scoring pass each. Returns the timings too. `lean`
    (variance.r_method central_difference): no jvp; the backward's row hooks give D_v L_X,i, whose r_i the ±η
    passes give later (beyond.central_difference_phase)."""
    timings, t0 = {}, time.perf_counter()
    scores = score_E(config, policy, E, directions[MAIN] if with_pieces else None, dist)
    coefs = coefficients(scores, config.entropy_options(), sampler_weights(scores, E.sampler_response_logqs()))
    pieces = {}
    if with_pieces:
        pieces[MAIN] = directional_pieces(scores.d_logq, scores.d_entropy, coefs)
        for name, v in directions.items():
            if name != MAIN:
                other = score_E(config, policy, E, v, dist)
                pieces[name] = directional_pieces(other.d_logq, other.d_entropy, coefs)
    timings["E_scoring"], t0 = time.perf_counter() - t0, time.perf_counter()
    X, rows = surrogate_rows_phase(config, policy, E, coefs, {MAIN: directions[MAIN]} if lean else {}, dist)
    timings["E_backward"] = time.perf_counter() - t0
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


def delta_h1_phase(config: ProbeConfig, policy: Policy, E: Batch, U: Batch, *, u_groups=None,
                   per_sequence_pieces: bool = False, dist: DistContext = SINGLE) -> DeltaH1Result:
    """δH₁ = lr · X̂·v. U goes first: v (and the competing predictors' directions) are needed by the E pass
    when the pieces are wanted."""
    timings, t0 = {}, time.perf_counter()
    update = update_phase(config, policy, U, u_groups, dist)
    extra, unavailable = predictor_directions(config.step_options(), policy, update.gradients.total)
    timings["U_gradient_and_direction"] = time.perf_counter() - t0
    method = pieces_method(policy.trainable, config.entropy_options(), per_sequence_pieces)
    directions = {MAIN: update.v, **extra}
    if policy.displacement is not None:
        directions[DISPLACEMENT] = policy.displacement
    # r by the central difference only along v alone: every other direction would cost two no-grad passes,
    # more than the L_β backward that gives them all (docs/scaling.md "r_i without the second backward")
    lean = method == "backward_hooks" and config.variance.r_method == "central_difference" and len(directions) == 1
    if lean:
        e_pass = scored_pieces_phase(config, policy, E, directions, False, dist, lean=True)
        timings.update(e_pass.timings)
    elif method == "backward_hooks":
        t0 = time.perf_counter()
        e_pass = one_pass_phase(config, policy, E, directions, dist)
        timings["E_backward"] = time.perf_counter() - t0
    else:
        e_pass = scored_pieces_phase(config, policy, E, directions, method == "jvp", dist)
        timings.update(e_pass.timings)
    lr = resolve_learning_rate(config.learning_rate, policy.optimizer.param_groups).value
    x_hat_dot_v = named_dot(e_pass.X_hat, update.v)
    pieces = dict(e_pass.pieces)
    main_pieces = pieces.pop(MAIN, None)
    G = E.num_responses_per_prompt
    one_pass_rows = prompts_per_microbatch(config.entropy_options().microbatch_size, G) * G
    return DeltaH1Result(delta_h1=lr * x_hat_dot_v, x_hat_dot_v=x_hat_dot_v, learning_rate=lr, X_hat=e_pass.X_hat,
                         v=update.v, coefficients=e_pass.coefficients, scores=e_pass.scores,
                         u_gradients=update.gradients, update_info=update.info,
                         timings=timings, pieces=main_pieces,
                         pieces_method=method if method in ("backward_hooks", "jvp") else None,
                         predictor_directions=extra, predictor_pieces=pieces, predictors_unavailable=unavailable,
                         sampler_weights=e_pass.coefficients.weights,
                         scores_tf_batch=one_pass_rows if method == "backward_hooks" and not lean else None,
                         r_method="central_difference" if lean else ("jvp" if method == "jvp" else "backward"),
                         r_rows=e_pass.rows)


# ---------------------------------------------------------------------- error bars and truth
def error_bars_phase(config: ProbeConfig, policy: Policy, res: DeltaH1Result, u_groups: list[list[int]],
                     notes: WarningLog) -> ErrorBars:
    """SE_E, SE_U (v rebuilt without each U group through the loaded AdamW state) and SE_total."""
    if not config.variance.enabled:
        return ErrorBars.unavailable()
    return error_bars(res, u_groups, normalize=config.estimator.normalize,
                      direction_of=partial(probe_step, config.step_options(), policy), warn=notes.warn)


# ---------------------------------------------------------------------- the whole probe
def estimate_phase(config: ProbeConfig, policy: Policy, E: Batch, U: Batch, notes: WarningLog,
                   dist: DistContext = SINGLE, logger: logging.Logger = log) -> Estimates:
    """Phases 1–3: δH₁ with its error bars, and their timings."""
    B_U = U.num_prompts
    K = config.variance.u_groups or min(B_U, 8)
    u_groups = split_into_groups(B_U, min(K, B_U)) if config.variance.enabled else None
    t0 = time.perf_counter()
    res = delta_h1_phase(config, policy, E, U, u_groups=u_groups, per_sequence_pieces=config.variance.enabled,
                         dist=dist)
    timing = {f"phase1_3_{k}": v for k, v in res.timings.items()}
    truth, early = None, 0.0
    if res.r_rows is not None:  # r_i from the ±η passes: ΔH (or a pair of its own) runs before the error bars
        truth, passes = central_difference_phase(config, policy, E, res, dist)
        timing.update(passes)
        early = sum(passes.values())
    elif config.variance.enabled and config.variance.r_method == "central_difference":
        notes.warn(f"variance.r_method central_difference applies to the backward-hook pieces along v alone; r_i "
                   f"came from the {res.pieces_method} pass that the predictors' directions or the model need")
    if E.sampler_logqs is not None:  # docs/maths.md §12: the sampler is far from the policy
        for line in correction_warnings(correction_diagnostics(res.scores.token_logqs, E.sampler_response_logqs())):
            notes.warn(line)
    t1 = time.perf_counter()
    bars = error_bars_phase(config, policy, res, u_groups or [], notes)
    if config.variance.enabled:
        timing["phase3_variance"] = time.perf_counter() - t1
    timing["phase1_3_total"] = time.perf_counter() - t0 - early
    logger.info("δH₁ = %+.4e ± %.2e (SE_E %.2e, SE_U %.2e) at lr = %.3g", res.delta_h1, bars.se["total"],
                bars.se["E"], bars.se["U"], res.learning_rate)
    return Estimates(res, bars, timing, truth)


def run(config: ProbeConfig, *, dist: DistContext = SINGLE, policy: Policy | None = None,
        batches: tuple[Batch, Batch] | None = None, on_batches=None, chunk_store=None,
        notes: WarningLog | None = None, sampling_warnings: list[str] = (),
        logger: logging.Logger = log) -> ProbeOutcome:
    """Every phase in order. `batches` = (E, U) reuses saved batches (resume); `on_batches(E, U)` is called
    right after sampling so that the caller can save them before the long phases start; `chunk_store`
    keeps generation chunks as they complete (report/run_dir.GenerationChunkStore)."""
    notes = notes or WarningLog(logger)
    timing, t_start = {}, time.perf_counter()
    clear_reward_warnings()  # warnings of an earlier run in this process are not this run's
    if batches is None:  # the data set and the rewards checked before the model loads
        for message in preflight(config, policy.tokenizer if policy is not None else None, logger):
            notes.warn(message)
    if policy is None:
        policy = load_phase(config, dist, notes, logger)
        timing["load"] = time.perf_counter() - t_start
    for message in runtime_precision_warnings(policy.trainable.model, config, policy.optimizer):
        notes.warn(message)  # a model handed in at the wrong precision is refused (ConfigError) here
    t0 = time.perf_counter()
    policy.displacement = displacement_phase(config, policy, notes)
    if policy.displacement is not None:
        timing["load_displacement"] = time.perf_counter() - t0
    if chunk_store is not None:
        policy.engine.chunk_store = chunk_store
    t0 = time.perf_counter()
    if batches is None:
        samples = sample_phase(config, policy.engine, dist, logger)
    else:  # a resumed run's saved batches carry the record of how they were drawn
        E, U = saved_batches(batches)
        samples = Samples(E, U, None, sampler_block(E.generation, U.generation))
    E, U = samples.E, samples.U
    timing["phase0_sampling"] = time.perf_counter() - t0
    if on_batches is not None:
        on_batches(E, U)
    n_zero = warn_zero_advantages(U, notes.warn, logger)
    work = budgeted_config(config, policy.trainable.model, (E, U), notes.warn)  # estimator.memory_budget_gb
    estimates = estimate_phase(work, policy, E, U, notes, dist, logger)
    res, bars = estimates.delta_h1, estimates.error_bars
    timing.update(estimates.timing)
    later = beyond_first_order_phase(work, policy, E, res, bars, dist, estimates.truth)
    timing.update(later.timing)
    t0 = time.perf_counter()
    attribution, e_tokens = attribution_phase(work, policy, E, U, res, bars,
                                              partial(score_E, work, policy, E, res.v, dist))
    timing["phase7_attribution"] = time.perf_counter() - t0
    timing["total"] = time.perf_counter() - t_start
    facts = RunFacts(normalize=config.estimator.normalize, config_hash=config.config_hash(), seed=config.seed,
                     entropy_fp64=config.precision.entropy_fp64,
                     u_groups=len(res.u_gradients.groups) if config.variance.enabled else 0,
                     model=policy.trainable.model, checkpoint_info=policy.checkpoint_info, world_size=dist.world_size,
                     backend=dist.backend, warnings=list(notes.messages), sampling_warnings=list(sampling_warnings),
                     zero_advantage_prompts=n_zero, plan=samples.plan)
    outcome = assemble_results(E, U, res, bars, later.truth, later.residuals, later.second_order, later.predictors,
                               timing, facts)
    outcome.results["attribution"], outcome.e_tokens = attribution, e_tokens
    # what drew E and U, then the estimators' correction diagnostics (assemble_results)
    outcome.results["sampler"] = {**(samples.sampler or sampler_block(None, None)), **outcome.results["sampler"]}
    outcome.policy = policy
    return outcome
