"""The probe, phase by phase (docs/development.md "Layout"): `run(config, dist=...) -> ProbeOutcome`.

    load              checkpoint → the policy, its AdamW state and the lr of δH₁     (checkpoint/load.py)
    sample            index plan → E and U generated, rewarded and packed            (probe/sampling.py)
    update_direction  g = ∇L_U of the trainer objective → v, the AdamW step per unit lr
                                                                       (estimators/objective_gradient.py)
    e_pass            X̂ = ∇L_X on E, the scores and (for the error bars) the pieces a, r; δH₁ = lr·X̂·v
                                                                       (probe/e_pass.py, estimators/entropy_gradient.py)
    error_bars        SE_E, SE_U, SE_total                                           (estimators/error_bars.py)
    delta_h           ΔH(η) by SNIS on the same E and the paired residuals  (probe/beyond.py, estimators/delta_h.py)
    second_order      d2 = D²_v H, η*, the second-order prediction per η             (probe/beyond.py)
    predictors        the competing predictors of the same step                       (probe/beyond.py)
    attribution       δH₁ by U prompt and by E token                                  (probe/attribution.py)
                      (second_order by jvp and attribution share one pass along v: probe/tangent.py)
    report            the results dict and the per-sequence rows                      (report/results_dict.py)

Each phase returns a frozen typed result (probe/results.py) and edits none; results.json's `timing` has one key
per phase under these names. Only this module, e_pass.py, beyond.py, tangent.py, sampling.py, runner.py and
parallel.py know about ranks. Under torchrun rank 0 draws the index plan;
each rank runs its contiguous share of the work items a single process would run (so every microbatch
is computed as in one process); float64 sums are all-reduced, per-sequence values gathered in order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial

from ..checkpoint.base_model import BaseModelChoice
from ..checkpoint.displacement import NEXT_CHECKPOINT_KEY, displacement_to
from ..checkpoint.layout import CheckpointFiles
from ..checkpoint.learning_rate import resolve_learning_rate
from ..checkpoint.load import load_for_probe
from ..checkpoint.rollouts import refuse_rollout_reuse
from ..checkpoint.runtime_precision import runtime_precision_warnings
from ..checkpoint.trainer_batch import trainer_batch_record
from ..checkpoint.trainer_log import rollout_reuse_warnings, vllm_correction_warnings
from ..config import ProbeConfig
from ..data.batch import Batch
from ..data.rewards import clear_reward_warnings
from ..errors import ConfigError
from ..estimators.delta_h import DeltaH
from ..estimators.entropy_gradient import (
    pieces_method,
)
from ..estimators.entropy_proxies import u_proxy_entries
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
from ..estimators.step_directions import predictor_directions, probe_step, step_direction
from ..estimators.update_direction import named_dot, named_norm
from ..policy.engine import PolicyEngine
from ..report.results_dict import ProbeOutcome, RunFacts, assemble_results, sampler_block
from ..tensors import NamedTensors
from .attribution import attribution_phase
from .beyond import beyond_first_order_phase, central_difference_phase
from .e_pass import MAIN, choose_e_pass, one_pass_phase, progress, score_E, surrogate_gradient_phase
from .memory_plan import budgeted_config
from .parallel import SINGLE, DistContext, init_from_env
from .preflight import preflight
from .results import BeyondFirstOrder, DeltaH1Result, Estimates, Policy, Samples, UpdateStep, WarningLog
from .sampling import sample_phase, saved_batches, warn_zero_advantages
from .tangent import TangentAlongV, tangent_phase

# the phase functions of the whole probe, the E pass's included (e_pass.py), by their phase names
__all__ = ["MAIN", "ProbeOutcome", "delta_h1_phase", "estimate_phase", "load_phase", "one_pass_phase", "run",
           "sample_phase", "score_E", "surrogate_gradient_phase", "update_gradients", "update_phase"]

log = logging.getLogger("entropy_experiments.probe")
DISPLACEMENT = "displacement"  # the key of Δθ = θ_next − θ among them (predictors.next_checkpoint)


def process_context(config: ProbeConfig) -> DistContext:
    """This process's place in a torchrun job (SINGLE semantics when not launched by torchrun)."""
    return init_from_env(config.distributed)


# ---------------------------------------------------------------------- phase: load
def load_phase(config: ProbeConfig, dist: DistContext, notes: WarningLog, logger: logging.Logger = log) -> Policy:
    """The checkpoint of `config.checkpoint` loaded: policy model (one GPU per rank under nccl), AdamW, lr."""
    ck = config.checkpoint
    device_map = f"cuda:{dist.local_rank}" if dist.backend == "nccl" else None
    loaded = load_for_probe(ck, config.learning_rate, before_loading=partial(checked_files, config, notes),
                            device_map=device_map, runtime_dtype=config.precision.runtime_dtype, logger=logger)
    for message in loaded.warnings:
        notes.warn(message)
    bc = config.batch_config
    loaded.info["trainer_batch"], batch_warning = trainer_batch_record(
        config.objective.trainer_batch_completions, loaded.files.trainer_state_path, bc.B_U, bc.G)
    if batch_warning is not None:
        notes.warn(batch_warning)
    engine = PolicyEngine(loaded.model, loaded.tokenizer, config.policy_settings(), logger)
    return Policy(engine, Trainable.of(loaded.model), loaded.optimizer, loaded.tokenizer, loaded.info)


def checked_files(config: ProbeConfig, notes: WarningLog, files: CheckpointFiles, base: BaseModelChoice) -> None:
    """Before the model loads: a checkpoint whose next step reuses rollouts is refused, and what the files say
    about the trainer (objective, vLLM correction, rollout reuse, a base model other than the adapter's) is noted."""
    refuse_rollout_reuse(config.objective.num_iterations, files.trainer_state_path,
                         str(config.checkpoint.checkpoint_path))
    if base.warning is not None:
        notes.warn(base.warning)
    for message in [*config.objective_warnings(files.layout), *vllm_correction_warnings(
            files.trainer_state_path, config.objective.vllm_importance_sampling_correction),
            *rollout_reuse_warnings(files.trainer_state_path, config.objective.num_iterations)]:
        notes.warn(message)


def load_displacement(config: ProbeConfig, policy: Policy, notes: WarningLog) -> NamedTensors | None:
    """Δθ = θ_next − θ to `predictors.next_checkpoint` (None: not set); Δθ = 0 is recorded as a warning."""
    path = config.predictors.next_checkpoint
    if path is None:
        return None
    if not (config.predictors.enabled or config.predictors.displacement):
        raise ConfigError(f"{NEXT_CHECKPOINT_KEY} is set but predictors.displacement and predictors.enabled are "
                          "both false: the displacement predictor is off")
    t = policy.trainable
    delta = displacement_to(t.model, path, list(t.names), list(t.params))
    if named_norm(delta) == 0:
        notes.warn(f"{NEXT_CHECKPOINT_KEY} {path}: the adapter is unchanged (Δθ = 0), so δH_Δθ = 0")
    return delta


# ---------------------------------------------------------------------- update_direction and e_pass
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


def delta_h1_phase(config: ProbeConfig, policy: Policy, E: Batch, U: Batch, *, u_groups=None,
                   per_sequence_pieces: bool = False, dist: DistContext = SINGLE) -> DeltaH1Result:
    """δH₁ = lr · X̂·v. U goes first: v (and the competing predictors' directions) are needed by the E pass
    when the pieces are wanted."""
    timings, t0 = {}, time.perf_counter()
    update = update_phase(config, policy, U, u_groups, dist)
    extra, unavailable = predictor_directions(config.step_options(), policy, update.gradients.total)
    timings["update_direction"] = time.perf_counter() - t0
    method = pieces_method(policy.trainable, config.entropy_options(), per_sequence_pieces)
    directions = {MAIN: update.v, **extra}
    if policy.displacement is not None:
        directions[DISPLACEMENT] = policy.displacement
    e_pass = choose_e_pass(method, config.variance.r_method, len(directions))
    surrogate = e_pass.run(config, policy, E, directions, dist)
    timings.update(surrogate.timings)
    lr = resolve_learning_rate(config.learning_rate, policy.optimizer.param_groups).value
    x_hat_dot_v = named_dot(surrogate.X_hat, update.v)
    pieces = dict(surrogate.pieces)
    main_pieces = pieces.pop(MAIN, None)
    return DeltaH1Result(delta_h1=lr * x_hat_dot_v, x_hat_dot_v=x_hat_dot_v, learning_rate=lr, X_hat=surrogate.X_hat,
                         v=update.v, coefficients=surrogate.coefficients, scores=surrogate.scores,
                         u_gradients=update.gradients, update_info=update.info,
                         timings=timings, pieces=main_pieces, e_pass=e_pass.name,
                         predictor_directions=extra, predictor_pieces=pieces, predictors_unavailable=unavailable,
                         sampler_weights=surrogate.coefficients.weights,
                         scores_tf_batch=e_pass.scores_tf_batch(config, E), r_method=e_pass.r_method,
                         r_rows=surrogate.rows)


# ---------------------------------------------------------------------- error bars and truth
def error_bars_phase(config: ProbeConfig, policy: Policy, res: DeltaH1Result, u_groups: list[list[int]],
                     notes: WarningLog) -> ErrorBars:
    """SE_E, SE_U (v rebuilt without each U group through the loaded AdamW state) and SE_total."""
    if not config.variance.enabled:
        return ErrorBars.unavailable()
    return error_bars(res, u_groups, normalize=config.estimator.normalize,
                      direction_of=partial(probe_step, config.step_options(), policy), warn=notes.warn)


# ---------------------------------------------------------------------- the whole probe
def add_results(results: dict, extra: dict) -> None:
    """`extra` (the after_estimates hook's keys) into `results`, its `warnings` added to the run's (once each)."""
    results["warnings"] += [w for w in extra.pop("warnings", []) if w not in results["warnings"]]
    results.update(extra)



def estimate_phase(config: ProbeConfig, policy: Policy, E: Batch, U: Batch, notes: WarningLog,
                   dist: DistContext = SINGLE, logger: logging.Logger = log) -> Estimates:
    """update_direction, e_pass and error_bars: δH₁ with its error bars, and their timings."""
    B_U = U.num_prompts
    u_groups = split_into_groups(B_U, config.u_group_count(B_U)) if config.variance.enabled else None
    t0 = time.perf_counter()
    res = delta_h1_phase(config, policy, E, U, u_groups=u_groups, per_sequence_pieces=config.variance.enabled,
                         dist=dist)
    timing = dict(res.timings)
    truth, early = None, 0.0
    if res.r_rows is not None:  # r_i from the ±η passes: ΔH (or a pair of its own) runs before the error bars
        res, truth, passes = central_difference_phase(config, policy, E, res, dist)
        timing.update(passes)
        early = sum(passes.values())
    elif config.variance.enabled and config.variance.r_method == "central_difference":
        notes.warn(f"variance.r_method central_difference applies to the backward-hook pieces along v alone; r_i "
                   f"came from the {res.e_pass} pass that the predictors' directions or the model need")
    if E.sampler_logqs is not None:  # docs/maths.md §12: the sampler is far from the policy
        for line in correction_warnings(correction_diagnostics(res.scores.token_logqs, E.sampler_response_logqs())):
            notes.warn(line)
    t1 = time.perf_counter()
    bars = error_bars_phase(config, policy, res, u_groups or [], notes)
    if config.variance.enabled:
        timing["error_bars"] = time.perf_counter() - t1
    timing["delta_h1_total"] = time.perf_counter() - t0 - early
    logger.info("δH₁ = %+.4e ± %.2e (SE_E %.2e, SE_U %.2e) at lr = %.3g", res.delta_h1, bars.se["total"],
                bars.se["E"], bars.se["U"], res.learning_rate)
    return Estimates(res, bars, timing, truth)


def timed_attribution(config: ProbeConfig, policy: Policy, batches: tuple[Batch, Batch],
                      estimates: tuple[DeltaH1Result, ErrorBars], along_v: TangentAlongV, truth: DeltaH,
                      notes: WarningLog) -> tuple[dict, dict | None, float]:
    """attribution_phase's (results, E token columns) and its seconds, which include the pass along v when it was
    made for the attribution alone (order 1; an order-2 pass counts as the second order's; the ΔH passes whose
    per-token entropies it differences count as ΔH's)."""
    t0 = time.perf_counter()
    (E, U), (res, bars) = batches, estimates
    attribution, e_tokens = attribution_phase(config, policy, E, U, res, bars, along_v.scores, truth)
    if (error := ((attribution.get("E_tokens") or {}).get("dH_error") or {}).get("warning")) is not None:
        notes.warn(error)  # a token's dH may be off by more than ERROR_SHARE_MAX of the largest
    return attribution, e_tokens, time.perf_counter() - t0 + (along_v.seconds if along_v.order == 1 else 0.0)


def record_later(later: BeyondFirstOrder, timing: dict[str, float], notes: WarningLog) -> None:
    """The later phases' seconds into the run's `timing`, the second order's warnings (its bias above its SE, its η
    past the measured window) and ΔH's (rows under the rounding floor) into `notes`, so that results.json
    `warnings` carries them."""
    timing.update(later.timing)
    for key in ("warning", "window_warning"):
        if later.second_order and later.second_order.get(key):
            notes.warn(later.second_order[key])
    for message in later.warnings:
        notes.warn(message)


def with_proxies(config: ProbeConfig, later: BeyondFirstOrder, engine: PolicyEngine, U: Batch,
                 timing: dict[str, float]) -> BeyondFirstOrder:
    """`later` with the field's proxies beside its predictors (none without predictors.enabled): one no-grad pass
    over U with the trainer objective's advantages, timed with the predictors."""
    if later.predictors is None or not config.predictors.enabled:
        return later
    t0 = time.perf_counter()
    advantages = [t.advantage for row in u_terms(U, config.objective_options()) for t in row]
    predictors = {**later.predictors, **u_proxy_entries(engine, U, advantages)}
    timing["predictors"] += time.perf_counter() - t0
    return replace(later, predictors=predictors)


def with_absolute_etas(config: ProbeConfig, policy: Policy) -> ProbeConfig:
    """`config` with importance.eta_over_lr turned into eta_list at the checkpoint's lr (unchanged when unset):
    every later phase reads eta_list; config_hash stays the configured one's."""
    imp = config.importance
    if imp.eta_over_lr is None:
        return config
    lr = resolve_learning_rate(config.learning_rate, policy.optimizer.param_groups).value
    importance = imp.model_copy(update={"eta_list": [k * lr for k in imp.eta_over_lr], "eta_over_lr": None})
    return config.model_copy(update={"importance": importance})


def run(config: ProbeConfig, *, dist: DistContext = SINGLE, policy: Policy | None = None,
        batches: tuple[Batch, Batch] | None = None, on_batches=None, chunk_store=None,
        notes: WarningLog | None = None, sampling_warnings: list[str] = (),
        logger: logging.Logger = log, after_estimates=None) -> ProbeOutcome:  # after_estimates: what_if.py
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
    policy = replace(policy, displacement=load_displacement(config, policy, notes))
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
    timing["sample"] = time.perf_counter() - t0
    if on_batches is not None:
        on_batches(E, U)
    n_zero = warn_zero_advantages(U, notes.warn, logger)
    work = budgeted_config(with_absolute_etas(config, policy), policy.trainable.model, (E, U), notes.warn)
    estimates = estimate_phase(work, policy, E, U, notes, dist, logger)
    res, bars = estimates.delta_h1, estimates.error_bars
    timing.update(estimates.timing)
    along_v = tangent_phase(work, policy, E, res, dist)  # one pass along v: second order and attribution share it
    later = beyond_first_order_phase(work, policy, E, res, bars, dist, estimates.truth,
                                     None if along_v.sums is None else (along_v.sums, along_v.seconds))
    record_later(later, timing, notes)
    later = with_proxies(config, later, policy.engine, U, timing)
    attribution, e_tokens, timing["attribution"] = timed_attribution(work, policy, (E, U), (res, bars), along_v,
                                                                     later.truth, notes)
    timing["total"] = time.perf_counter() - t_start
    facts = RunFacts(normalize=config.estimator.normalize, config_hash=config.config_hash(), seed=config.seed,
                     entropy_fp64=config.precision.entropy_fp64,
                     u_groups=len(res.u_gradients.groups) if config.variance.enabled else 0,
                     model=policy.trainable.model, checkpoint_info=policy.checkpoint_info, world_size=dist.world_size,
                     backend=dist.backend, warnings=list(notes.messages), sampling_warnings=list(sampling_warnings),
                     zero_advantage_prompts=n_zero, plan=samples.plan)
    outcome = assemble_results(E, U, estimates, later, timing, facts)
    outcome.results["attribution"], outcome.e_tokens, outcome.policy = attribution, e_tokens, policy
    # what drew E and U, then the estimators' correction diagnostics (assemble_results)
    outcome.results["sampler"] = {**(samples.sampler or sampler_block(None, None)), **outcome.results["sampler"]}
    add_results(outcome.results, after_estimates(work, policy, E, U, res, dist) if after_estimates else {})
    return outcome
