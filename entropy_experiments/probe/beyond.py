"""The probe's phases after δH₁ (`recipe.run` runs them): what first order misses and how it compares.

    delta_h      ΔH(η) by SNIS on the same E, and the paired residuals ΔH(η) − η·X̂·v     (estimators/delta_h.py)
    second_order d2 = D²_v H of the SNIS estimate, η*, the second-order prediction per η  (estimators/second_order.py
                 by jvp, estimators/second_difference.py from no-grad passes at θ ± η·v)
    predictors   the competing predictors of the same step with their SEs and ratios      (estimators/predictors.py)

When E was drawn by a sampler other than the policy, every E sum here carries the sampler correction's weight
s_i (`res.sampler_weights`, docs/maths.md §12; None: unweighted, the code path unchanged).

Like recipe.py this module knows the ranks: no-grad passes score whole tf chunks per rank (`scoring_share`)
and gather per-sequence values in order; backward passes split the microbatches and all-reduce the sums.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch

from ..config import ProbeConfig
from ..data.batch import Batch
from ..errors import ConfigError
from ..estimators import jackknife
from ..estimators.central_difference import (
    beta_log_ratio,
    central_difference_eta,
    pieces_from_weighted_rows,
    r_eta_message,
    r_from_log_ratios,
)
from ..estimators.delta_h import DeltaH, RealStep, delta_h_from_values, eta_values, score_at_eta
from ..estimators.displacement import displacement_entry, step_comparison
from ..estimators.entropy_gradient import e_microbatches, entropy_only_gradient_sum
from ..estimators.error_bars import ErrorBars, paired_residuals, with_slope_residuals
from ..estimators.jackknife import Estimate
from ..estimators.predictors import (
    PairedTruth,
    direct_only_estimate,
    direction_estimate,
    estimate_entry,
    measured_reference,
    unavailable_entry,
    with_ratios,
)
from ..estimators.rounding_floor import floor_from_passes
from ..estimators.second_difference import finite_difference_report, window_warning
from ..estimators.second_order import second_derivative, second_order_report
from ..estimators.sequence_scores import SECOND_ORDER_KEYS, second_order_sums, units_of
from ..estimators.step_directions import no_momentum_caveat, predictor_direction_fns
from ..policy.progress import progress
from .attribution import token_choice
from .parallel import SINGLE, DistContext
from .results import BeyondFirstOrder, DeltaH1Result, NamedTensors, Policy

log = logging.getLogger(__name__)


def sampler_weights_of(res: DeltaH1Result) -> np.ndarray | None:
    """The sampler correction's s [N] over all of E as float64 numpy (None: E was drawn by the policy)."""
    return None if res.sampler_weights is None else res.sampler_weights.detach().cpu().double().numpy()


def scoring_share(config: ProbeConfig, E: Batch, dist: DistContext,
                  tf_batch_size: int | None = None) -> tuple[dict | None, list[int]]:
    """This rank's share of E for a no-grad pass (whole tf chunks of `tf_batch_size` rows, default the config's):
    its sub-batch (None: none) and sequence indices."""
    G, B = E.num_responses_per_prompt, E.num_prompts
    if not dist.enabled:
        return E, list(range(B * G))
    mine = dist.scoring_prompts(B, G, tf_batch_size or config.generation.tf_batch_size)
    return (E.subset(mine) if mine else None), [b * G + g for b in mine for g in range(G)]


def delta_h_phase(config: ProbeConfig, policy: Policy, E: Batch, res: DeltaH1Result, dist: DistContext = SINGLE,
                  with_beta: bool = False) -> DeltaH:
    """ΔH(η) by SNIS on the same E for every η: one no-grad pass per η, none at θ — the e_pass scores are the
    base, and E is scored at θ' in the e_pass's batch layout so that log w is exactly 0 at η = 0. Each rank
    scores whole chunks of that layout; values are gathered in order and the estimate runs on the whole E
    (delta_h.delta_h_from_values). `with_beta`: each η's per-sequence values also carry Σ_k β_ik (ℓ'_ik − ℓ_ik)
    ("beta_logw", for r_i by the central difference). The per-token entropies of the passes the token attribution
    differences (attribution.token_choice) are kept, gathered over all E. The η are `config.delta_h_etas()`: the
    importance η and the finite-difference second order's ±η, measured here once for both."""
    imp = config.importance
    if not imp.enabled:
        return DeltaH.not_measured()
    G, B = E.num_responses_per_prompt, E.num_prompts
    local_E, rows_mine = scoring_share(config, E, dist, res.scores_tf_batch)
    local = local_E is not None
    gather = dist.row_gatherer(rows_mine, B * G)
    base = res.scores.subset(rows_mine) if local else None
    beta = [res.coefficients.beta[i] for i in rows_mine] if with_beta and local else None
    T = gather([len(x) for x in base.token_logqs] if local else [], "E lengths gather")
    h = gather(base.seq_entropies.tolist() if local else [], "E entropies gather")
    step = real_step_of(config, policy, res) if imp.mode == "real_step" else None
    choice = token_choice(config)
    keep = choice.etas() if choice is not None else ()
    per_eta, tokens = {}, {}
    for eta in config.delta_h_etas():
        new = (score_at_eta(policy.engine, local_E, res.v, eta, real_step=step, tf_batch_size=res.scores_tf_batch)
               if local else None)
        mine = eta_values(new, base, beta) if local else {}
        keys = ("logw", "h_new", "beta_logw") if with_beta else ("logw", "h_new")
        per_eta[eta] = {k: gather(mine.get(k, []), f"{k} gather (η={eta:g})") for k in keys}
        if eta in keep:
            tokens[eta] = dist.gather_rows(dict(zip(rows_mine, new.token_entropies)) if local else {}, B * G,
                                           f"token entropies gather (η={eta:g})")
    truth = delta_h_from_values(h, T, per_eta, normalize=config.estimator.normalize, units=units_of(B, G),
                                sampler_weights=sampler_weights_of(res))
    return replace(truth, token_entropies=tokens)


#: ΔH(η) under this many rounding floors F measures the rounding more than the step (docs/maths.md §8).
FLOOR_MULTIPLE = 5.0


def rounding_floor_of(config: ProbeConfig, truth: DeltaH, res: DeltaH1Result) -> dict | None:
    """results.json `rounding_floor` {value, eta, pair_eta}: F of ΔH from the ΔH passes (rounding_floor.py); None
    where they hold no small η with a pair ≥ 10× it."""
    if truth.h is None:
        return None
    return floor_from_passes(truth.h, truth.T, truth.per_sequence, normalize=config.estimator.normalize,
                             sampler_weights=sampler_weights_of(res))


def floor_warnings(truth: DeltaH, floor: dict | None) -> list[str]:
    """One warning per ΔH(η) row with |ΔH| < FLOOR_MULTIPLE·F."""
    if floor is None:
        return []
    F = floor["value"]
    return [f"importance: |ΔH(η={row['eta']:g})| = {abs(row['deltaH_true']):.2g} is under {FLOOR_MULTIPLE:g}× the "
            f"rounding floor F = {F:.2g} (from η {floor['eta']:g} and ±{floor['pair_eta']:g}): at that η ΔH and its "
            "residual measure fp32 rounding, not first order; read the rows at larger η (docs/maths.md §8)"
            for row in truth.rows if abs(row["deltaH_true"]) < FLOOR_MULTIPLE * F]


def real_step_of(config: ProbeConfig, policy: Policy, res: DeltaH1Result) -> RealStep:
    """θ' of importance.mode real_step: the loaded AdamW stepped with the U gradient (clipped like the trainer)."""
    t = policy.trainable
    return RealStep(policy.optimizer, list(zip(t.names, t.params)), res.u_gradients.total,
                    config.objective_options().max_grad_norm)


def central_difference_phase(config: ProbeConfig, policy: Policy, E: Batch, res: DeltaH1Result,
                             dist: DistContext = SINGLE) -> tuple[DeltaH1Result, DeltaH | None, dict[str, float]]:
    """r_i along v by the central difference (docs/maths.md §6) and with it the pieces (a_i from the L_X
    backward's D_v L_X,i in `res.r_rows`): `res` with its pieces, r_eta set and r_rows spent. η = variance.r_eta, default the largest η ≤ R_ETA_MAX of the ΔH(±η)
    passes: then ΔH is measured here, before the error bars, and its result returned for the delta_h phase to reuse;
    an η of no ΔH pass gets a pair of its own (no-grad, θ ± η·v as a parameter override). Returns (that result,
    ΔH or None, timings)."""
    etas = config.delta_h_etas()
    eta = central_difference_eta(config.variance.r_eta, etas)
    if eta is None:
        raise ConfigError(r_eta_message(config.importance.enabled))
    t0 = time.perf_counter()
    if eta in etas and -eta in etas:
        truth = delta_h_phase(config, policy, E, res, dist, with_beta=True)
        plus, minus = (truth.per_sequence[e]["beta_logw"] for e in (eta, -eta))
        timing = {"delta_h": time.perf_counter() - t0}
    else:
        truth, (plus, minus) = None, (beta_log_ratios_at(config, policy, E, res, s * eta, dist) for s in (1, -1))
        timing = {"r_central_difference": time.perf_counter() - t0}
    pieces = pieces_from_weighted_rows(res.r_rows, r_from_log_ratios(plus, minus, eta), res.coefficients)
    return replace(res, pieces=pieces, r_eta=eta, r_rows=None), truth, timing


def beta_log_ratios_at(config: ProbeConfig, policy: Policy, E: Batch, res: DeltaH1Result, eta: float,
                       dist: DistContext = SINGLE) -> np.ndarray:
    """Σ_k β_ik (ℓ_ik(θ + η·v) − ℓ_ik) [N] of all E by one no-grad pass in the layout of the scores at θ (each
    rank its share, gathered)."""
    local_E, rows_mine = scoring_share(config, E, dist, res.scores_tf_batch)
    values = []
    if local_E is not None:
        new = score_at_eta(policy.engine, local_E, res.v, eta, tf_batch_size=res.scores_tf_batch)
        base = res.scores.subset(rows_mine)
        values = beta_log_ratio(new.token_logqs, base.token_logqs, [res.coefficients.beta[i] for i in rows_mine])
    return dist.row_gatherer(rows_mine, len(res.scores.token_logqs))(values, f"β-weighted log-ratios (η={eta:g})")


def second_derivative_along(config: ProbeConfig, policy: Policy, E: Batch, direction: NamedTensors,
                            dist: DistContext = SINGLE, sampler_weights: np.ndarray | None = None
                            ) -> tuple[Estimate, dict[str, list[float]]]:
    """(D² Ĥ along `direction` of the SNIS estimate on E with its SE, the per-sequence sums it came from),
    by the nested jvp; sharded like ΔH; `sampler_weights`: s [N] of all E (None: unweighted)."""
    G, B = E.num_responses_per_prompt, E.num_prompts
    local_E, rows_mine = scoring_share(config, E, dist)
    sums = second_order_sums(policy.engine, local_E, direction) if local_E is not None else None
    gather = dist.row_gatherer(rows_mine, B * G)
    cols = {k: gather(sums[k] if sums else [], f"second-order sums gather ({k})") for k in SECOND_ORDER_KEYS}
    return second_derivative_of(config, E, cols, sampler_weights), cols


def second_derivative_of(config: ProbeConfig, E: Batch, sums: dict[str, np.ndarray],
                         sampler_weights: np.ndarray | None = None) -> Estimate:
    """D² Ĥ with its SE from the per-sequence second-order sums of all E ({SECOND_ORDER_KEYS: [N]})."""
    G, B = E.num_responses_per_prompt, E.num_prompts
    return second_derivative(sums["s"], sums["s2"], sums["dh"], sums["d2h"], sums["h"], sums["T"],
                             normalize=config.estimator.normalize, units=units_of(B, G),
                             sampler_weights=sampler_weights)


def second_order_phase(config: ProbeConfig, policy: Policy, E: Batch, res: DeltaH1Result, truth: DeltaH,
                       dist: DistContext = SINGLE, sums_along_v: dict[str, np.ndarray] | None = None) -> dict | None:
    """d2 = D²_v H of the SNIS estimate on E with its SE, η* and the prediction per η (None: off): by the nested
    jvp (`sums_along_v`: the per-sequence sums of the shared order-2 pass along v, probe/tangent.py; None: a pass
    of its own), or by the second difference at each η of second_order.eta_list (`second_difference_values`)."""
    if not config.second_order.enabled:
        return None
    etas = config.delta_h_etas()
    if config.second_order.method == "jvp":
        d2 = (second_derivative_along(config, policy, E, res.v, dist, sampler_weights_of(res))[0]
              if sums_along_v is None else second_derivative_of(config, E, sums_along_v, sampler_weights_of(res)))
        return second_order_report(d2, res.x_hat_dot_v, etas, "jvp")
    G, B = E.num_responses_per_prompt, E.num_prompts
    fd = finite_difference_report(second_difference_values(config, policy, E, res, truth, dist),
                                  res.scores.seq_entropies.numpy(), res.scores.lengths.numpy(),
                                  normalize=config.estimator.normalize, units=units_of(B, G),
                                  sampler_weights=sampler_weights_of(res))
    report = second_order_report(Estimate(fd["d2"], fd["se"]), res.x_hat_dot_v, etas, "finite_difference")
    if fd["bias_estimate"] is not None and not fd["bias_estimate"] <= fd["se"]:  # results.json warnings (recipe.run)
        report["warning"] = (f"second_order: d2 at η = {fd['eta']:g} has a bias estimate {fd['bias_estimate']:.3g} "
                             f"above its SE {fd['se']:.3g}: the second difference is rounding-bound or past the "
                             "quadratic regime there; see second_order.per_eta, set another second_order.eta_list "
                             "or second_order.method: jvp")
    report["window_warning"] = window_warning(fd["per_eta"][-1])  # the reported η's (the largest)
    return {**report, **{k: fd[k] for k in ("eta", "bias_estimate", "per_eta")}}


def second_difference_values(config: ProbeConfig, policy: Policy, E: Batch, res: DeltaH1Result, truth: DeltaH,
                             dist: DistContext = SINGLE) -> dict[float, dict[str, np.ndarray]]:
    """{±η: {"logw", "h_new"}} of all E for every η of second_order.eta_list: the ΔH pass's values where `truth`
    measured that η, else a no-grad pass at θ + η·v of its own in the layout of the scores at θ (each rank its
    share, gathered in order)."""
    wanted = [s * eta for eta in config.second_order.eta_list for s in (1, -1)]
    out = {eta: truth.per_sequence[eta] for eta in wanted if eta in truth.per_sequence}
    local_E, rows_mine = scoring_share(config, E, dist, res.scores_tf_batch)
    gather = dist.row_gatherer(rows_mine, len(res.scores.token_logqs))
    base = res.scores.subset(rows_mine) if local_E is not None else None
    for eta in (e for e in wanted if e not in out):
        mine = (eta_values(score_at_eta(policy.engine, local_E, res.v, eta, tf_batch_size=res.scores_tf_batch), base)
                if local_E is not None else {})
        out[eta] = {k: gather(mine.get(k, []), f"{k} gather (second difference, η={eta:g})") for k in ("logw", "h_new")}
    return out


def displacement_predictor(config: ProbeConfig, policy: Policy, E: Batch, res: DeltaH1Result,
                           dist: DistContext = SINGLE) -> tuple[dict, dict[str, list[float]]]:
    """The `displacement` predictor: δH_Δθ = X̂·Δθ with SE_E from the pieces along Δθ (same E pass as v),
    ½·D²_Δθ H by the nested jvp (only with second_order.enabled: it is a second-order pass over E; None
    otherwise), and how the probe's own step lr·v compares with Δθ. Returns (its entry, its per-sequence
    pieces and second-order sums {column: [N]} for per_sequence.jsonl and the sweep's joint jackknife)."""
    delta = policy.displacement
    pieces = res.predictor_pieces.get("displacement")
    s = sampler_weights_of(res)
    d2, cols = (second_derivative_along(config, policy, E, delta, dist, s) if config.second_order.enabled
                else (None, {}))
    entry = displacement_entry(res.X_hat, delta, pieces, res.scores, normalize=config.estimator.normalize,
                               second=d2, sampler_weights=s)
    entry.update(step_comparison(res.v, res.learning_rate, delta))
    entry["next_checkpoint"] = config.predictors.next_checkpoint
    extra = {k: [float(x) for x in cols[k]] for k in ("s", "s2", "dh", "d2h") if k in cols}
    if pieces is not None:
        extra.update(a=[float(x) for x in pieces[0]], r=[float(x) for x in pieces[1]])
    return entry, extra


def weighted_normalizer(res: DeltaH1Result, normalize: str) -> float:
    """D of X_H = ∇Σ H / D: the coefficients' D, or with the sampler weights Σ s d (docs/maths.md §12)."""
    if res.sampler_weights is None:
        return res.coefficients.D
    s = res.sampler_weights.double()
    return float((s * res.scores.lengths.double()).sum() if normalize == "per_token" else s.sum())


def direct_only_phase(config: ProbeConfig, policy: Policy, E: Batch, res: DeltaH1Result, bars: ErrorBars,
                      dist: DistContext = SINGLE, paired: PairedTruth | None = None) -> dict:
    """The `direct_only` predictor: one forward + backward of Σ H over E (this rank's microbatches, summed over
    ranks) → X_H = ∇ΣH/D, with d_i = D_v h_i from the same backward (hooks) or from the jvp scores."""
    options = config.entropy_options()
    hooks = res.e_pass in ("backward_hooks", "central_difference")  # the passes with the row hooks
    microbatches = e_microbatches(E.num_prompts, E.num_responses_per_prompt, options.microbatch_size)
    X_H, d = entropy_only_gradient_sum(policy.engine, policy.trainable, E, dist.chunk_slice(microbatches), options,
                                       res.v if hooks else None,
                                       progress=lambda items: progress(items, "E backward (Σ H, direct_only)"),
                                       sampler_weights=res.sampler_weights)
    if dist.enabled:
        summed = dist.all_reduce_tree({"X_H": X_H, "d": d}, "direct_only all-reduce")
        X_H, d = summed["X_H"], summed["d"]
    if res.e_pass == "jvp":  # the E scores already carry D_v H_ik
        d = torch.stack([t.double().sum() for t in res.scores.d_entropy])
    X_H = {n: (t / weighted_normalizer(res, config.estimator.normalize)).float() for n, t in X_H.items()}
    return direct_only_estimate(X_H, None if res.e_pass == "two_pass" else d, res.scores, res.learning_rate, res.v,
                                bars.loo_directions, normalize=config.estimator.normalize,
                                sampler_weights=res.sampler_weights, paired=paired)


def predictors_phase(config: ProbeConfig, policy: Policy, E: Batch, res: DeltaH1Result, bars: ErrorBars,
                     truth: DeltaH, dist: DistContext = SINGLE) -> tuple[dict | None, dict[str, dict]]:
    """results.json `predictors`: {name: {delta_h1, se, se_E, se_U, from_pieces, measured_over_predicted}} (None: off),
    and the extra per-sequence columns of the predictors that have them ({name: {column: [N]}}). With
    predictors.enabled false, the displacement alone where there is one (predictors.displacement)."""
    if not config.predictors.enabled:
        if policy.displacement is None:
            return None, {}
        entry, extra = displacement_predictor(config, policy, E, res, dist)
        return with_ratios({"displacement": entry}, measured_reference(truth.rows, res.learning_rate)), \
            {"displacement": extra}
    lr, normalize = res.learning_rate, config.estimator.normalize
    out = {config.estimator.update_direction: estimate_entry(res.delta_h1, bars.se["E"], bars.se["U"],
                                                             bars.consistency.get("deltaH1_from_pieces"))}
    fns = predictor_direction_fns(config.step_options(), policy)
    paired = PairedTruth.of(truth, res.scores, res.sampler_weights, normalize)  # one jackknife with ΔH (§11)
    for name, v_pred in res.predictor_directions.items():
        loo = jackknife.leave_one_group_out_directions(fns[name], res.u_gradients) if bars.loo_directions else []
        out[name] = direction_estimate(res.X_hat, v_pred, res.predictor_pieces.get(name), res.scores, lr, loo,
                                       normalize=normalize, sampler_weights=res.sampler_weights, paired=paired)
    out["direct_only"] = direct_only_phase(config, policy, E, res, bars, dist, paired)
    extra = {}
    if policy.displacement is not None:
        entry, extra["displacement"] = displacement_predictor(config, policy, E, res, dist)
        out = {"displacement": entry, **out}
    out = with_ratios(out, measured_reference(truth.rows, lr))
    if "no_momentum" in out:
        caveat = no_momentum_caveat(policy, res.u_gradients.total)
        if caveat:
            out["no_momentum"]["warning"] = caveat
            log.warning("predictor no_momentum: %s", caveat)
    for name, reason in res.predictors_unavailable.items():
        out[name] = unavailable_entry(reason)
    return out, extra


def beyond_first_order_phase(config: ProbeConfig, policy: Policy, E: Batch, res: DeltaH1Result, bars: ErrorBars,
                             dist: DistContext = SINGLE, truth: DeltaH | None = None,
                             sums_along_v: tuple[dict[str, np.ndarray], float] | None = None) -> BeyondFirstOrder:
    """ΔH(η) (`truth` when measured already) with the paired residuals, the second-order coefficient and the
    competing predictors, timed. `sums_along_v`: (the second-order sums, the seconds) of the shared order-2 pass
    along v (probe/tangent.py), whose seconds count as the second order's; None: the phase makes its own."""
    timing, t0 = {}, time.perf_counter()
    if truth is None:
        truth = delta_h_phase(config, policy, E, res, dist)
        if config.importance.enabled:
            timing["delta_h"] = time.perf_counter() - t0
    residuals = paired_residuals(truth, res, bars, normalize=config.estimator.normalize)
    truth = replace(truth, linearity=with_slope_residuals(truth.linearity, truth, res, bars,
                                                          normalize=config.estimator.normalize))
    floor = rounding_floor_of(config, truth, res)
    t0 = time.perf_counter()
    sums, shared = sums_along_v or (None, 0.0)
    second_order = second_order_phase(config, policy, E, res, truth, dist, sums)
    if second_order is not None:
        timing["second_order"] = time.perf_counter() - t0 + shared
    t0 = time.perf_counter()
    predictors, extra = predictors_phase(config, policy, E, res, bars, truth, dist)
    if predictors is not None:
        timing["predictors"] = time.perf_counter() - t0
    return BeyondFirstOrder(truth, residuals, second_order, predictors, timing, extra, floor,
                            floor_warnings(truth, floor))
