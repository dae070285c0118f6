#!/usr/bin/env python3
"""Trap suite: plant known bugs one at a time and check that the tests catch each of them.

    python scripts/traps.py                  # every trap, 2 workers, + an unpatched baseline run
    python scripts/traps.py --only NAME ...  # some traps;  --list: print them;  --jobs N;  --no-baseline

Trap list format (TRAPS below): one `Trap(name, path, old, new, tests)` per planted bug —
- name:  short identifier (shown in the table, used by --only);
- path:  the file to patch, relative to the repository root;
- old:   the exact current text; it must occur EXACTLY ONCE in that file, otherwise the suite stops
         before running anything (the list must stay in sync with the code: update the snippet
         when the code moves, never drop or weaken a trap);
- new:   the text that replaces it (the planted bug);
- tests: pytest node ids (relative to the repository root) that must fail with the bug in place.
         Keep them few and fast: each trap runs only its own ids.

For each trap the package, the tests and pyproject.toml (entropy_experiments/, sequence_processing/,
tests/, pyproject.toml) are copied to a scratch directory, the patch is applied there and
`python -m pytest -x -q -p no:cacheprovider <tests>` runs from that directory with PYTHONPATH=<scratch>,
so the scratch copy is imported rather than the editable install (checked on every run: the scratch
conftest records where `entropy_experiments` came from). Result: CAUGHT (the tests fail), SURVIVED
(they pass: a gap in the suite) or ERROR (collection error, wrong import, timeout...). The baseline
runs every listed test once unpatched: they must all pass, or a CAUGHT would mean nothing.
Exit code 0 only if every trap is CAUGHT and the baseline passes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ["entropy_experiments", "sequence_processing", "examples", "tests", "pyproject.toml"]
TIMEOUT_S = 400


@dataclass(frozen=True)
class Trap:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


EE = "entropy_experiments/"
SWEEP_REALISED = "tests/test_sampler_sweep_paths.py::test_checkpoint_entropy_and_independent_and_paired_realised_change"
TRAPS = [
    # ---- U side (estimators/objectives.py): caught by tests/test_objectives.py's written-out loops
    Trap("dr_grpo_without_G", EE + "estimators/objectives.py",
         "return (1.0 / (B * G * l_max)).expand(B, G)", "return (1.0 / (B * l_max)).expand(B, G)",
         ("tests/test_objectives.py::test_loss_matches_written_out_formula[none-dr_grpo_per_prompt]",)),
    Trap("advantages_centred_on_batch_mean", EE + "estimators/objectives.py",
         "centred = r - r.mean(dim=1, keepdim=True)", "centred = r - r.mean()",
         ("tests/test_objectives.py::test_advantages_match_loops[none]",)),
    # ---- the entropy controls (estimators/entropy_terms.py): against TRL's own code and verl's transcribed code
    Trap("entropy_mask_quantile_inverted", EE + "estimators/entropy_terms.py",
         "threshold = torch.quantile(pooled, 1.0 - quantile)", "threshold = torch.quantile(pooled, quantile)",
         ("tests/test_trl_objectives.py::test_top_entropy_quantile_equals_trl[dapo-1-0.01-0.0-0.2]",)),
    Trap("entropy_mask_compared_at_float64", EE + "estimators/entropy_terms.py",
         "masks.extend((v.float() >= threshold)", "masks.extend((v >= threshold)",
         ("tests/test_trl_objectives.py::test_high_entropy_mask_at_float64_is_trls_at_float32",)),
    Trap("second_order_bias_warning_only_logged", EE + "probe/recipe.py",
         'notes.warn(later.second_order[key])', "pass",
         ("tests/test_second_difference.py::test_finite_difference_on_enumerable_model[per_token-etas2]",)),
    Trap("token_forward_difference_over_two_eta", EE + "estimators/token_derivatives.py",
         "return [(n.double() - b.double()) / eta for n, b in zip(new, base)]",
         "return [(n.double() - b.double()) / (2.0 * eta) for n, b in zip(new, base)]",
         ("tests/test_token_derivatives.py::test_default_token_attribution_matches_the_exact_one",)),
    Trap("token_central_difference_over_one_eta", EE + "estimators/token_derivatives.py",
         "return [(p.double() - m.double()) / (2.0 * eta) for p, m in zip(plus, minus)]",
         "return [(p.double() - m.double()) / eta for p, m in zip(plus, minus)]",
         ("tests/test_token_derivatives.py::test_central_and_forward_differences_converge_at_their_orders",)),
    Trap("clip_cov_drops_the_whole_band", EE + "estimators/entropy_terms.py",
         "keep = 1.0 - min(k, n_band) / n_band if n_band else 1.0", "keep = 0.0 if n_band else 1.0",
         ("tests/test_verl_entropy_losses.py::test_clip_cov_gradient_is_the_expectation_of_verls_draw[3-5-0.03]",)),
    # ---- E side surrogate (estimators/surrogate.py)
    Trap("tokens_to_go_off_by_one", EE + "estimators/surrogate.py",
         "return torch.arange(length - 1, -1, -1, dtype=dtype, device=device)",
         "return torch.arange(length, 0, -1, dtype=dtype, device=device)",
         ("tests/test_losses.py::test_tokens_to_go_counts_tokens_strictly_after_k[7]",)),
    Trap("loo_baseline_includes_own_coefficient", EE + "estimators/surrogate.py",
         "(total[:T] - c) / others.clamp(min=1)", "total[:T] / count[:T]",
         ("tests/test_losses.py::test_loo_baseline_excludes_the_sequence_itself",)),
    Trap("missing_H_R_term_in_coefficients", EE + "estimators/surrogate.py",
         "beta = (tokens_to_go(T, device=h.device) if normalize == \"per_token\"",
         "beta = (torch.zeros(T, dtype=torch.float64, device=h.device) if normalize == \"per_token\"",
         ("tests/test_losses.py::test_per_token_causal_coefficient_is_G_minus_H_hat_R",)),
    Trap("missing_H_R_term_in_jackknife_statistic", EE + "estimators/jackknife.py",
         "return float((a - (h / t) * b) / t)", "return float(a / t)",
         ("tests/test_stats.py::test_delta_h1_per_token_value_and_se_vs_brute_force",)),
    Trap("missing_H_R_term_in_one_pass_backward", EE + "estimators/entropy_gradient.py",
         "residual = coefs.H_hat - shift", "residual = -shift",
         ("tests/test_probe.py::test_one_pass_backward_matches_forward_mode_and_two_pass[per_token-causal]",)),
    # ---- ΔH(η) by SNIS (estimators/delta_h.py): caught against enumeration and the direction predictors' slopes
    Trap("snis_delta_h_without_the_sampler_weights", EE + "estimators/delta_h.py",
         "units=units,\n                                sampler_weights=sampler_weights)", "units=units)",
         ("tests/test_sampler_beyond_toy.py::test_delta_h_corrected_matches_enumeration_and_uncorrected_does_not",)),
    Trap("snis_log_weights_with_the_wrong_sign", EE + "estimators/delta_h.py",
         '"logw": log_weights(new, base)', '"logw": log_weights(base, new)',
         ("tests/test_predictors.py::test_direction_predictors_equal_the_snis_slope_along_their_direction",)),
    # ---- error bars
    Trap("se_total_added_linearly", EE + "estimators/jackknife.py",
         "return math.sqrt(se_e ** 2 + se_u ** 2)", "return se_e + se_u",
         ("tests/test_losses.py::test_se_total_is_root_sum_of_squares[3.0-4.0]",)),
    Trap("se_of_mean_reported_as_se_of_sum", EE + "estimators/jackknife.py",
         "return float(math.sqrt((n - 1) / n * np.sum((theta - theta.mean()) ** 2)))",
         "return float(math.sqrt((n - 1) / n * np.sum((theta - theta.mean()) ** 2)) / n)",
         ("tests/test_stats.py::test_jackknife_se_of_mean_is_std_over_sqrt_n",)),
    # ---- log-prob alignment (docs/maths.md §1: logits at i−1 score the token at i)
    Trap("logprob_gathered_at_own_position", EE + "policy/tf_batches.py",
         "offset = lp - 1 - lead - first", "offset = lp - lead - first",
         ("tests/test_sequence_processor.py::test_teacher_forcing_matches_brute_force[1.0-1.0]",)),
    Trap("logprob_tokens_shifted_by_one", EE + "policy/tf_batches.py",
         "tokens.append(ids[r, lp - lead: lp - lead + t])", "tokens.append(ids[r, lp - lead - 1: lp - lead - 1 + t])",
         ("tests/test_sequence_processor.py::test_teacher_forcing_matches_brute_force[1.0-1.0]",)),
    Trap("bf16_runtime", EE + "checkpoint/runtime_precision.py",
         "        return model.float()", "        return model",
         ("tests/test_traps_targets.py::test_a_bf16_checkpoint_runs_in_fp32",)),
    # ---- optimizer state
    Trap("weight_decay_from_constructor_default", EE + "estimators/adam_state.py",
         'weight_decay=_scalar(group["weight_decay"]),', "weight_decay=0.0,",
         ("tests/test_adam_preconditioner.py::test_state_is_cloned_and_hyper_comes_from_saved_groups",)),
    Trap("silent_fresh_optimizer", EE + "checkpoint/load.py",
         "if not ck.allow_fresh_optimizer:", "if False:",
         ("tests/test_errors_cli.py::test_bad_input_is_one_clean_line_and_exit_2[optimizer_missing]",)),
    Trap("positional_remap_without_shape_check", EE + "checkpoint/optimizer_state.py",
         "if not state:\n        return  # parameter never stepped", "if True:\n        return  # parameter never stepped",
         ("tests/test_model_loader.py::test_shape_mismatch_by_position",)),
    Trap("u_gradient_in_train_mode", EE + "estimators/objective_gradient.py",
         "trainable.model.eval()\n    group_grads", "trainable.model.train()\n    group_grads",
         ("tests/test_traps_targets.py::test_u_gradient_is_taken_in_eval_mode_even_with_dropout",)),
    # ---- SNIS (estimators/snis.py): against numpy written out in tests/test_stats.py
    Trap("snis_denominator_unweighted", EE + "estimators/snis.py",
         'denom = np.dot(w, t) if normalize == "per_token" else w.sum()',
         'denom = t.sum() if normalize == "per_token" else float(w.size)',
         ("tests/test_stats.py::test_snis_matches_direct_numpy_and_is_shift_invariant",)),
    Trap("snis_delta_h_length_column_unweighted", EE + "estimators/snis.py",
         "columns = sampler_weighted([w * hn, w * d, hh, d], sampler_weights)",
         "columns = sampler_weighted([w * hn, d, hh, d], sampler_weights)",
         ("tests/test_stats.py::test_snis_delta_h_value_and_se_vs_brute_force[per_token]",)),
    # ---- the sampler correction (estimators/sampler_correction.py)
    Trap("sampler_log_weight_sign_flipped", EE + "estimators/sampler_correction.py",
         "out[i] = lq.sum() - ls.sum()", "out[i] = ls.sum() - lq.sum()",
         ("tests/test_sampler_correction.py::test_log_weights_are_the_sequence_log_ratio",)),
    Trap("sampler_kl_direction_reversed", EE + "estimators/sampler_correction.py",
         "deltas = [as_float64(ls) - as_float64(lq) for",
         "deltas = [as_float64(lq) - as_float64(ls) for",
         ("tests/test_sampler_correction.py::test_mean_token_kl_estimates_the_sampler_policy_kl",)),
    # ---- the sampling policy (policy/sampling_policy.py): against the brute-force rule of tests/test_sp_policy.py
    Trap("nucleus_drops_crossing_token", EE + "policy/sampling_policy.py",
         "return 1 + torch.count_nonzero(cum[:, :-1] < top_p, dim=-1)",
         "return 1 + torch.count_nonzero(cum[:, 1:] < top_p, dim=-1)",
         ("tests/test_sp_policy.py::test_nucleus_rule_keeps_crossing_token_and_at_least_one",)),
    Trap("rb_entropy_with_untruncated_normaliser", EE + "policy/sampling_policy.py",
         '"rb_entropy": log_z - mean_a,', '"rb_entropy": log_z_full - mean_a,',
         ("tests/test_sp_policy.py::test_token_stats_match_brute_force[1.0-0.9]",)),
    Trap("bf16_sampler_log_q_unnormalised", EE + "policy/row_keyed.py",
         "self.recorded.append((chosen - torch.logsumexp(a, dim=-1)).float())", "self.recorded.append(chosen.float())",
         ("tests/test_sampler.py::test_bf16_sampler_records_log_q_of_its_own_logits",)),
    # ---- second order (estimators/second_order.py, second_difference.py): against finite differences
    Trap("second_order_curvature_without_s_squared", EE + "estimators/second_order.py",
         "curv = s2 + s ** 2", "curv = s2",
         ("tests/test_second_order.py::test_jackknife_se_matches_a_written_out_loop_of_finite_differences[False]",)),
    Trap("second_order_prediction_without_half", EE + "estimators/second_order.py",
         "eta * x_hat_dot_v + 0.5 * eta ** 2 * d2.value", "eta * x_hat_dot_v + eta ** 2 * d2.value",
         ("tests/test_second_order.py::test_report_gives_eta_star_and_the_second_order_prediction",)),
    Trap("second_difference_over_two_eta_squared", EE + "estimators/second_difference.py",
         "return float((a / b + c / e - 2 * f / g) / eta ** 2)",
         "return float((a / b + c / e - 2 * f / g) / (2 * eta ** 2))",
         ("tests/test_second_difference.py::test_jackknife_se_written_out_by_hand",)),
    # ---- the competing predictors (estimators/predictors.py): against the SNIS slope along a hand-built direction
    Trap("sgd_same_norm_unit_length", EE + "estimators/predictors.py",
         "scale = named_norm(ctx.probe_direction(grads)) / g_norm if g_norm > 0 else 0.0",
         "scale = 1.0 / g_norm if g_norm > 0 else 0.0",
         ("tests/test_predictors.py::test_direction_predictors_equal_the_snis_slope_along_their_direction[per_token]",)),
    # ---- the sweep's realised change (sweep/realised.py): against a brute-force weighted jackknife
    Trap("sweep_realised_change_sign_flipped", EE + "sweep/realised.py",
         "return b.value - a.value, math.hypot(a.se, b.se)", "return a.value - b.value, math.hypot(a.se, b.se)",
         (SWEEP_REALISED + "[unweighted-per_token]",)),
    Trap("sweep_independent_se_added_linearly", EE + "sweep/realised.py",
         "return b.value - a.value, math.hypot(a.se, b.se)", "return b.value - a.value, a.se + b.se",
         (SWEEP_REALISED + "[weighted-per_token]",)),
    # ---- the TRL callback (integrations/): against TRL's own batch accounting
    Trap("trl_trainer_batch_without_accumulation", EE + "integrations/trl_trainer_view.py",
         "return int(args.per_device_train_batch_size * args.gradient_accumulation_steps)",
         "return int(args.per_device_train_batch_size)",
         ("tests/test_trl_trainer_view.py::test_the_callback_mirrors_the_trainers_batch_and_accumulation[2]",)),
    Trap("trl_u_batch_ratio_without_G", EE + "integrations/trl_callback.py",
         "self.u_batch_ratio = bc.B_U * bc.G / (view.trainer_batch(args)",
         "self.u_batch_ratio = bc.B_U / (view.trainer_batch(args)",
         ("tests/test_trl_trainer_view.py::test_the_callback_mirrors_the_trainers_batch_and_accumulation[1]",)),
    Trap("trl_kl_coefficient_dropped", EE + "integrations/trl_trainer_view.py",
         '"kl_coef": float(args.beta),', '"kl_coef": 0.0,',
         ("tests/test_trl_callback.py::test_the_callback_takes_the_trainers_kl_bias_correction[True]",)),
    # ---- the trainer's own next step and the autopilot (integrations/): against torch's real AdamW step
    Trap("next_step_first_groups_lr_for_every_group", EE + "integrations/next_step.py",
         "NextStep({n: hyper[n].lr * v[n] for n in names}", "NextStep({n: hyper[names[0]].lr * v[n] for n in names}",
         ("tests/test_trainer_step_prediction.py::test_next_step_is_the_step_adamw_takes[None-False]",)),
    Trap("autopilot_ratchet_at_the_target", EE + "integrations/autopilot_rule.py",
         "return Decision(resting, 0.0, resting * step.value, resting * step.value, words, rest_limit)",
         "return Decision(limited_multiplier(rule, 0.0, previous)[0], 0.0, 0.0, 0.0, words, rest_limit)",
         ("tests/test_autopilot_rule.py::test_pure_noise_at_the_target_leaves_m_near_1_and_pushes_nothing[False]",)),
    Trap("autopilot_acts_on_noise", EE + "integrations/autopilot_rule.py",
         "if not significant(rule, gap, excess, step.se):", "if False:",
         ("tests/test_autopilot_rule.py::test_pure_noise_at_the_target_leaves_m_near_1_and_pushes_nothing[True]",)),
    Trap("autopilot_without_rate_limit", EE + "integrations/autopilot_rule.py",
         "low, high = previous / (rule.max_rate_clear if clear else rule.max_rate), previous * rule.max_rate_clear",
         "low, high = 0.0, math.inf",
         ("tests/test_autopilot_rule.py::test_the_chosen_step_is_never_predicted_worse_than_the_lr_only_step",)),
    Trap("autopilot_term_along_an_unconfirmed_direction", EE + "integrations/autopilot_rule.py",
         "if not term.value > rule.z * term.se:", "if False:",
         ("tests/test_autopilot_rule.py::test_an_unconfirmed_term_direction_is_not_used",)),
    Trap("autopilot_prefers_the_term_whatever_its_miss", EE + "integrations/autopilot_rule.py",
         "best = min(c[0] for c in candidates) + 0.1 * step.se ** 2", "best = math.inf",
         ("tests/test_autopilot_rule.py::test_the_chosen_step_is_never_predicted_worse_than_the_lr_only_step",)),
    Trap("autopilot_cuts_fast_on_noise", EE + "integrations/autopilot_rule.py",
         "clear = significant(rule, gap, excess, step.se, CLEAR * rule.z)", "clear = True",
         ("tests/test_autopilot_rule.py::test_pure_noise_at_the_target_leaves_m_near_1_and_pushes_nothing[False]",)),
    Trap("example_ignores_the_world_seed", "examples/entropy_autopilot.py",
         'world_model(tmp / f"toy{world}", world)', 'world_model(tmp / f"toy{world}")',
         ("tests/test_entropy_autopilot_example.py::test_another_world_is_another_model",)),
    Trap("autopilot_measures_nothing", EE + "integrations/autopilot_rule.py",
         "untouched = measure(1.0, 0.0)", "untouched = Estimate(0.0, 0.0)",
         ("tests/test_autopilot_measured.py::test_a_curved_step_lands_nearer_the_wanted_change_than_first_order",)),
    Trap("autopilot_rests_on_a_nan_measurement", EE + "integrations/autopilot_rule.py",
         "    measure = finite(measure)\n", "",
         ("tests/test_autopilot_measured.py::test_a_measurement_that_is_not_finite_is_an_error_not_a_rest",)),
    Trap("autopilot_measured_choice_without_resting", EE + "integrations/autopilot_rule.py",
         "    tried.append((Decision(resting, 0.0, first.wanted, at_rest.value, words, rest_limit), at_rest))\n", "",
         ("tests/test_autopilot_measured.py::test_the_chosen_step_is_never_measured_worse_than_resting",)),
    Trap("autopilot_measures_without_the_term", EE + "integrations/steered_step.py",
         "displacement(steerable, multiplier, kappa),\n", "displacement(steerable, multiplier, 0.0),\n",
         ("tests/test_autopilot.py::test_the_autopilot_steers_the_real_step_and_survives_a_resume",)),
    Trap("realised_reused_when_the_step_differs", EE + "integrations/trainer_step.py",
         "before_step = step_ok and pending.measured is not None", "before_step = pending.measured is not None",
         ("tests/test_autopilot.py::test_a_step_taken_other_than_decided_is_flagged_and_measured_again",)),
    Trap("autopilot_realised_from_the_untouched_step", EE + "integrations/autopilot.py",
         "measured.get((decision.multiplier, decision.term)),", "measured.get((1.0, 0.0)),",
         ("tests/test_autopilot.py::test_the_autopilot_steers_the_real_step_and_survives_a_resume",)),
    Trap("clear_cut_at_three_noise_sds", EE + "integrations/autopilot_rule.py", "CLEAR = 2.0", "CLEAR = 1.5",
         ("tests/test_autopilot_rule.py::test_pure_noise_at_the_target_leaves_m_near_1_and_pushes_nothing",)),
    Trap("oracle_direction_not_orthogonal_to_the_reward", EE + "testing/oracle_hold.py",
         "alpha = _dot(grad_R, PH) / _dot(grad_R, PR)", "alpha = 0.0",
         ("tests/test_oracle_hold.py::test_the_direction_raises_the_entropy_and_is_blind_to_the_reward",)),
    Trap("oracle_preconditioner_without_bias_correction", EE + "testing/oracle_hold.py",
         ' / (1 - beta2 ** int(state["step"]))', "",
         ("tests/test_oracle_hold.py::test_the_preconditioner_is_the_one_torch_adamw_just_divided_by",)),
    Trap("oracle_line_search_not_bisected", EE + "testing/oracle_hold.py",
         "low, high = (mid, high) if side * off(mid) < 0 else (low, mid)", "pass",
         ("tests/test_oracle_hold.py::test_in_a_real_run_the_exact_entropy_stays_on_its_start",)),
    Trap("example_gain_ratio_against_the_tuned_trl_arm", "examples/entropy_autopilot.py",
         "{ratio(mean, arm, 'gain', 'none')}", "{ratio(mean, arm, 'gain', 'trl_tuned')}",
         ("tests/test_entropy_autopilot_example.py::test_the_arms_run_and_summarise",)),
    Trap("example_world_seed_on_the_embedded_model", "examples/entropy_autopilot.py",
         'if args.world != "toy" and args.world_seed is not None:', "if False:",
         ("tests/test_entropy_autopilot_example.py::test_the_arms_run_and_summarise",)),
    Trap("example_oracle_arm_on_the_embedded_model", "examples/entropy_autopilot.py",
         'valid = ARMS + (TOY_ONLY if args.world == "toy" else ())', "valid = ARMS + TOY_ONLY",
         ("tests/test_entropy_autopilot_example.py::test_the_arms_run_and_summarise",)),
    Trap("entropy_filter_drift_never_corrected", EE + "integrations/entropy_filter.py",
         "track.drift + k1 * innovation", "track.drift",
         ("tests/test_autopilot_rule.py::test_the_filter_is_the_least_squares_estimate_of_the_whole_history",)),
    Trap("entropy_filter_steps_add_no_uncertainty", EE + "integrations/entropy_filter.py",
         "(p00, p01, p11 + variance)", "(p00, p01, p11)",
         ("tests/test_autopilot_rule.py::test_the_filter_is_the_least_squares_estimate_of_the_whole_history",
          "tests/test_autopilot_rule.py::test_the_filter_beats_fresh_entropy_alone_at_small_batches")),
    Trap("autopilot_term_subtracted", EE + "integrations/steered_step.py",
         "p.add_(displacement[name].to(p))", "p.sub_(displacement[name].to(p))",
         ("tests/test_autopilot.py::test_the_autopilot_steers_the_real_step_and_survives_a_resume",)),
    Trap("autopilot_scheduler_lr_not_restored", EE + "integrations/autopilot.py",
         'group["lr"] = lr\n', 'pass\n',
         ("tests/test_autopilot.py::test_the_autopilot_steers_the_real_step_and_survives_a_resume",)),
    Trap("autopilot_state_not_restored_on_resume", EE + "integrations/autopilot.py",
         'self.multiplier, self.aimed_at = float(saved["multiplier"]), saved.get("aimed_at")', "pass",
         ("tests/test_autopilot.py::test_the_autopilot_steers_the_real_step_and_survives_a_resume",)),
    Trap("fp16_not_refused", EE + "integrations/representable.py",
         'if getattr(args, "fp16", False):', "if False:",
         ("tests/test_autopilot.py::test_what_the_prediction_cannot_represent_is_refused_in_one_line",)),
    Trap("optimizer_checked_on_accelerates_wrapper", EE + "integrations/representable.py",
         'while getattr(optimizer, "optimizer", None) is not None:', "while False:",
         ("tests/test_autopilot.py::test_the_optimizer_is_checked_by_type_under_accelerates_wrapper",)),
    Trap("step_far_from_the_prediction_not_flagged", EE + "integrations/representable.py",
         "return step_error <= 1e-3 * largest_step + 1e-6 * max(largest_param, 1.0)", "return True",
         ("tests/test_autopilot.py::test_a_step_far_from_the_prediction_is_flagged",)),
    # ---- rewards silently zero
    Trap("gold_answers_dropped_with_replacement_sampling", EE + "compat/sequence_processor.py",
         "examples=examples, **kwargs)", "**kwargs)",
         ("tests/test_seed_sequence_processor.py::test_replacement_sampling_keeps_gold_answers_and_counts",)),
    Trap("gold_answers_dropped_in_probe_batches", EE + "probe/sampling.py",
         "list(seqs.responses_text[b]), ex, completion_ids",
         "list(seqs.responses_text[b]), chosen[0], completion_ids",
         ("tests/test_traps_targets.py::test_probe_batches_pass_each_prompts_gold_answer_to_the_reward",)),
    Trap("reward_failure_becomes_zero", EE + "data/rewards/calling.py",
         "raise RewardError(f\"reward '{name}' raised {exception_line(exc)}{where}\") from exc",
         "values = [0.0] * len(responses)",
         ("tests/test_rewards.py::test_a_raising_reward_is_one_line_naming_reward_exception_and_prompt[probe]",)),
    # ---- tolerances that survive another CPU's kernels must still see a bug: a run recorded on another CPU
    # (compared within fp32 rounding) and the calibration bounds on z (rms in [0.4, 1.8], every |z| < 4.5)
    Trap("jackknife_without_n_minus_1_over_n", EE + "estimators/jackknife.py",
         "return float(math.sqrt((n - 1) / n * np.sum((theta - theta.mean()) ** 2)))",
         "return float(math.sqrt(np.sum((theta - theta.mean()) ** 2)))",
         ("tests/test_sampler_e2e.py::test_fp32_sampler_with_integer_rows_reproduces_the_code_before_the_correction",)),
    Trap("realised_change_without_importance_weights", EE + "estimators/realised_change.py",
         "w, t = weights_from_log(side.logw), as_float64(side.T)",
         "w, t = np.ones_like(as_float64(side.logw)), as_float64(side.T)",
         ("tests/test_realised_change.py::test_importance_realised_change_is_calibrated_against_enumeration",)),
    Trap("realised_change_ignores_sampler_weights", EE + "estimators/realised_change.py",
         "[w * as_float64(side.h_other), w * d, as_float64(side.h_own), d], side.sampler_weights)",
         "[w * as_float64(side.h_other), w * d, as_float64(side.h_own), d], None)",
         ("tests/test_sampler_realised.py::test_corrected_realised_change_is_calibrated_and_uncorrected_is_not",)),
    Trap("adamw_step_without_weight_decay", EE + "estimators/update_direction.py",
         "v = v.sub_(_as(theta, gn, dtype), alpha=h.weight_decay)", "v = v",
         ("tests/test_framework_checkpoints.py::test_probe_load_rebuilds_verls_next_adamw_step",)),
    # ---- docs that no longer match the code: a comment naming a module that was renamed
    Trap("stale_module_name_in_a_comment", EE + "config/sections.py",
         "recognised at load time by checkpoint.layout.resolve_checkpoint;",
         "recognised at load time by checkpoint_layout.resolve_checkpoint;",
         ("tests/test_docs_names.py::test_names_in_docstrings_comments_and_messages_exist",)),
    # ---- the field's entropy proxies and their leave-one-out scale
    Trap("proxy_covariance_ignores_the_weights", EE + "estimators/entropy_proxies.py",
         "return _mean((x - _mean(x, weights)) * (y - _mean(y, weights)), weights)",
         "return _mean((x - _mean(x, None)) * (y - _mean(y, None)), weights)",
         ("tests/test_entropy_proxies.py::test_cui_forms_equal_the_exact_entropy_derivative_of_a_softmax_step[0]",)),
    Trap("s_star_sign_of_log_p", EE + "estimators/entropy_proxies.py",
         "return np.exp(logp) * (entropy + logp)", "return np.exp(logp) * (entropy - logp)",
         ("tests/test_entropy_proxies.py::test_s_star_is_minus_the_entropy_derivative_along_the_sampled_logit",)),
    Trap("steer_omega_sign_flipped", EE + "estimators/entropy_proxies.py",
         "return -_mean(steer_omega_tokens(u.advantage, u.logp, u.entropy), u.weights)",
         "return _mean(steer_omega_tokens(u.advantage, u.logp, u.entropy), u.weights)",
         ("tests/test_entropy_proxies.py::test_steer_sign_matches_the_exact_entropy_change",)),
    Trap("proxy_plotted_unscaled", EE + "sweep/plots.py",
         "[(c * x, y, se) for x, y, se in pts]", "[(x, y, se) for x, y, se in pts]",
         ("tests/test_sweep_plots.py",)),
    Trap("loo_scale_keeps_the_left_out_pair", EE + "sweep/stats.py",
         "c = fitted_scale(x[others], y[others], se[others])", "c = fitted_scale(x, y, se)",
         ("tests/test_sweep_stats.py::test_loo_scale_against_a_brute_force_loop",)),
    # ---- what-if: the paired difference and the variant's own direction
    Trap("what_if_difference_unpaired_on_E", EE + "estimators/what_if.py",
         "se_e = e_stat.se(variant.a - baseline.a, variant.r - baseline.r)",
         "se_e = math.hypot(e_stat.se(variant.a, variant.r), e_stat.se(baseline.a, baseline.r))",
         ("tests/test_what_if.py::test_paired_se_matches_brute_force_jackknife",)),
    Trap("what_if_variant_steps_with_the_baseline_options", EE + "probe/what_if.py",
         "est = ctx.estimate(config, probe_step(config.step_options(), ctx.policy, grads.total), grads)\n"
         "    diff = paired_difference(est, baseline, ctx.e_stat)",
         "est = ctx.estimate(config, ctx.res.v, grads)\n    diff = paired_difference(est, baseline, ctx.e_stat)",
         ("tests/test_what_if.py::test_each_variant_equals_a_separate_run",)),
    Trap("report_what_if_shows_the_unpaired_se", EE + "report/html_what_if.py",
         'return [_cell(plus_minus(diff, se)), num_cell(z, "+.2f")]',
         'return [_cell(plus_minus(diff, row.get("se"))), num_cell(z, "+.2f")]',
         ("tests/test_report_html.py::test_what_if_values_are_escaped_and_an_exact_zero_is_named",)),
    # ---- checkpoint loading read top to bottom; data/ and policy/ one way (tests/test_checkpoint_load_order.py)
    Trap("tokenizer_loaded_twice_for_its_record", EE + "checkpoint/load.py",
         'info["tokenizer"] = tokenizer_entry', 'info["tokenizer"] = load_policy_tokenizer(ck, files.tokenizer_dir, base)[1]',
         ("tests/test_checkpoint_load_order.py::test_own_checkpoint_loads_step_by_step",)),
    Trap("tokenizer_before_the_adapter", EE + "checkpoint/load.py",
         "        model = load_model(ck, read.adapter_dir, base, device_map or ck.device_map, runtime_dtype)\n"
         "    tokenizer, tokenizer_entry = load_policy_tokenizer(ck, files.tokenizer_dir, base)\n",
         "        tokenizer, tokenizer_entry = load_policy_tokenizer(ck, files.tokenizer_dir, base)\n"
         "        model = load_model(ck, read.adapter_dir, base, device_map or ck.device_map, runtime_dtype)\n",
         ("tests/test_checkpoint_load_order.py::test_own_checkpoint_loads_step_by_step",)),
    Trap("base_model_imports_layout_again", EE + "checkpoint/base_model.py",
         "from .file_names import ADAPTER_CONFIG_FILE", "from .layout import ADAPTER_CONFIG_FILE",
         ("tests/test_checkpoint_load_order.py::test_no_import_circle_in_checkpoint",)),
    Trap("data_imports_policy_again", EE + "data/rewards/sequence_rewards.py",
         "from entropy_experiments.data.batch import Batch, completion_ids",
         "from entropy_experiments.data.batch import Batch\nfrom entropy_experiments.policy.sequences import completion_ids",
         ("tests/test_checkpoint_load_order.py::test_data_never_imports_policy",)),
    # ---- a user's trial: rewards from the working directory, the report's checkpoint, --what-if's "did you mean"
    Trap("reward_not_looked_for_in_the_working_directory", EE + "data/rewards/registry.py",
         "if top is None or not _in_working_directory(top):", "if True:",
         ("tests/test_rough_edges.py::test_reward_module_in_the_working_directory_is_imported_from_there",)),
    Trap("working_directory_first_on_the_import_path", EE + "data/rewards/registry.py",
         "sys.path.append(os.getcwd())", "sys.path.insert(0, os.getcwd())",
         ("tests/test_rough_edges.py::test_working_directory_never_shadows_an_installed_module",)),
    Trap("report_checkpoint_from_name_or_path_only", EE + "report/summary.py",
         'value = value.get("name") or value.get("path") or _checkpoint_directory(value)',
         'value = value.get("name") or value.get("path")',
         ("tests/test_report_html.py::test_header_names_the_checkpoint_results_json_records[trainer]",)),
    Trap("report_checkpoint_is_the_own_layouts_model_dir", EE + "report/summary.py",
         "return str(PurePath(adapter).parent) if own else adapter", "return adapter",
         ("tests/test_report_html.py::test_header_names_the_checkpoint_results_json_records[own]",)),
    Trap("what_if_key_without_did_you_mean", EE + "probe/what_if.py",
         '(unknown_key_problem(key) or "not an objective key "', '(None or "not an objective key "',
         ("tests/test_what_if.py::test_misspelt_what_if_key_gets_the_did_you_mean_of_set[objective.entropy_coeff]",)),
    Trap("solve_takes_an_extra_u_backward", EE + "probe/what_if.py",
         "for c in (0.0, 1.0)}", "for c in (0.0, 0.5, 1.0)}",
         ("tests/test_what_if.py::test_what_if_passes_are_the_ones_the_user_guide_prices",)),
    # ---- the sweep's calibration (sweep/calibration.py, rows.py, stats.py; the proxies' lr, paired z, Fisher-z)
    Trap("proxy_own_fit_without_lr", EE + "sweep/calibration.py",
         'xs.append(pred["delta_h1"] * (row["lr"] if name in PROXIES else 1.0))', 'xs.append(pred["delta_h1"])',
         ("tests/test_sweep_stats.py::test_a_proxy_scale_is_the_same_under_a_constant_and_a_decaying_lr",)),
    Trap("proxy_interval_without_lr", EE + "sweep/rows.py",
         'per_step = 1.0 if name not in PROXIES else row_from["lr"]', "per_step = 1.0",
         ("tests/test_sweep_stats.py::test_a_proxy_scale_is_the_same_under_a_constant_and_a_decaying_lr",)),
    Trap("fisher_z_with_n_minus_2", EE + "sweep/stats.py",
         "s = float(np.sqrt((1.06 if rank else 1.0) / (n - 3)))", "s = float(np.sqrt((1.06 if rank else 1.0) / (n - 2)))",
         ("tests/test_sweep_stats.py::test_calibration_on_many_rows_matches_an_independent_implementation",)),
    Trap("predictor_residual_at_half_eta", EE + "estimators/predictors.py",
         "est = paired_residual(self.logw, self.h_new, self.h, self.T, pieces[0], pieces[1], self.eta,",
         "est = paired_residual(self.logw, self.h_new, self.h, self.T, pieces[0], pieces[1], self.eta * 0.5,",
         ("tests/test_predictors.py::test_no_momentum_residual_is_paired_with_delta_h_on_the_same_e",)),
    Trap("predictor_residual_on_the_unit_lr", EE + "estimators/predictors.py",
         "entry, scale = residual_entry(est), learning_rate / self.eta", "entry, scale = residual_entry(est), 1.0",
         ("tests/test_predictors.py::test_no_momentum_residual_is_paired_with_delta_h_on_the_same_e",)),
    Trap("sweep_displacement_only_with_predictors", EE + "sweep/runner.py",
         "wanted = config.predictors.enabled or config.predictors.displacement", "wanted = config.predictors.enabled",
         ("tests/test_sweep_default.py::test_a_default_sweep_reports_the_displacement",)),
    Trap("sweep_adamw_step_lost_beside_the_displacement", EE + "sweep/rows.py",
         'if not set(found) - {"displacement"}:', "if not found:",
         ("tests/test_sweep_default.py::test_a_default_sweep_reports_the_displacement",)),
    Trap("proxies_with_centred_rewards", EE + "probe/recipe.py",
         "predictors = {**later.predictors, **u_proxy_entries(engine, U, advantages)}",
         "predictors = {**later.predictors, **u_proxy_entries(engine, U, U.advantages.reshape(-1).tolist())}",
         ("tests/test_entropy_proxies.py::test_probe_results_carry_the_proxies_of_its_own_U",)),
    # ---- what-if error bars: a missing SE_U, few U groups, the solved interval's level (tests/test_what_if_intervals.py)
    Trap("what_if_total_is_se_e_alone_without_se_u", EE + "estimators/what_if.py",
         "        return jackknife.se_total(self.se_E, self.se_U)\n",
         "        return jackknife.se_total(self.se_E, self.se_U) if math.isfinite(self.se_U) else self.se_E\n",
         ("tests/test_what_if_intervals.py::test_a_missing_se_u_leaves_the_total_missing",
          "tests/test_what_if_intervals.py::test_a_what_if_with_one_u_group_prints_no_finite_total_se")),
    Trap("solve_interval_at_one_se", EE + "estimators/what_if.py",
         "return t_quantile(level, self.df) * self.se if", "return self.se if",
         ("tests/test_what_if_intervals.py::test_solved_interval_covers_the_root_at_its_level_over_seeds",)),
    Trap("solve_interval_se_of_the_root_at_both_ends", EE + "estimators/solve_interval.py",
         "points.append((c, there))", "points.append((c, points[0][1]))",
         ("tests/test_what_if_intervals.py::test_interval_ends_use_the_se_evaluated_there",)),
    Trap("solve_interval_not_checked_beyond_its_ends", EE + "estimators/solve_interval.py",
         "back = _outside_point(f, target, root, end, side)", "back = None",
         ("tests/test_what_if_intervals.py::test_a_set_that_is_not_one_interval_is_said_so",)),
    Trap("t_quantile_is_the_normals", EE + "estimators/student_t.py",
         "if df >= NORMAL_DF:", "if df >= 1.0:", ("tests/test_what_if_intervals.py::test_t_quantile_matches_scipy",)),
    Trap("solve_allowed_with_one_u_group", EE + "probe/what_if.py",
         "    if groups < 2:\n", "    if groups < 1:\n",
         ("tests/test_what_if_intervals.py::test_solve_without_two_u_groups_is_refused",)),
    Trap("few_u_groups_not_warned", EE + "estimators/error_bars.py",
         "if len(u_groups) < FEW_U_GROUPS:", "if len(u_groups) < 2:",
         ("tests/test_what_if_intervals.py::test_few_u_groups_warn_and_show_their_degrees_of_freedom",)),
    Trap("se_u_df_is_the_group_count", EE + "estimators/error_bars.py",
         "U_df = float(len(u_groups) - 1) if", "U_df = float(len(u_groups)) if",
         ("tests/test_what_if_intervals.py::test_few_u_groups_warn_and_show_their_degrees_of_freedom",)),
    # ---- the callbacks under several processes (integrations/ranks.py)
    Trap("ddp_every_rank_draws_all_of_E", EE + "integrations/trainer_step.py",
         'config.seed + 1, what="E"), dist)', 'config.seed + 1, what="E"), SINGLE)',
         ("tests/test_trl_ddp.py::test_rows_equal_one_process_on_the_same_union_E",)),
    Trap("ddp_realised_rows_misaligned", EE + "integrations/ranks.py",
         "base.subset(rows_mine)) if local_E", "base.subset(rows_mine[::-1])) if local_E",
         ("tests/test_trl_ddp.py::test_rows_equal_one_process_on_the_same_union_E",)),
    Trap("ddp_every_rank_writes_rows", EE + "integrations/trl_callback.py",
         "        self.rows.append(row)\n        if not ranks.writes(self.dist):\n            return\n",
         "        self.rows.append(row)\n",
         ("tests/test_trl_ddp.py::test_rows_equal_one_process_on_the_same_union_E",)),
    Trap("ddp_decision_checksums_ignored", EE + "integrations/ranks.py",
         "if len(set(checksums)) == 1:", "if len(set(checksums)) >= 1:",
         ("tests/test_trl_ddp.py::test_a_decision_off_by_one_ulp_on_one_rank_stops_both",)),
    Trap("ddp_autopilot_decision_unchecked", EE + "integrations/autopilot.py",
         '        ranks.agree(self.dist, self.decision(), f"{KEY}: step {step}")\n', "",
         ("tests/test_trl_ddp.py::test_a_decision_off_by_one_ulp_on_one_rank_stops_both",)),
    Trap("ddp_checksum_ignores_tensor_bits", EE + "integrations/ranks.py",
         "t.view(torch.uint8).numpy().tobytes()", 'b""',
         ("tests/test_trl_ddp.py::test_the_checksum_sees_one_ulp_and_tensor_bits",)),
    Trap("ddp_deepspeed_not_refused", EE + "integrations/ranks.py",
         'getattr(trainer, "is_deepspeed_enabled", False)', "False",
         ("tests/test_trl_ddp.py::test_sharded_launch_modes_are_refused_in_one_line",)),
    Trap("ddp_tf_chunks_as_large_as_E", EE + "integrations/ranks.py",
         "config.generation.tf_batch_size <= share", "config.generation.tf_batch_size >= 1",
         ("tests/test_trl_ddp.py::test_every_rank_scores_a_share_of_E",)),
    # ---- comments tell why, not history (tests/test_no_history_in_code.py)
    Trap("history_phrase_in_a_comment", EE + "estimators/jackknife.py",
         "    # sums = (A, B, Σh, ΣT): (A − Ĥ·B)/ΣT",
         "    # hashed as before; sums = (A, B, Σh, ΣT): (A − Ĥ·B)/ΣT",
         (("tests/test_no_history_in_code.py::test_comments_and_docstrings_tell_why_not_history"
           "[entropy_experiments/estimators/jackknife.py]"),)),
    Trap("history_check_misses_dates", "tests/test_no_history_in_code.py",
         '"a date": r"\\b(?:19|20)\\d\\d-[01]\\d-[0-3]\\d\\b",', '"a date": r"(?!x)x",',
         ("tests/test_no_history_in_code.py::test_history_phrasing_is_flagged",)),
    # ---- ΔH that sees first order, the second order's window, token dH errors (tests/test_first_order_check.py,
    #      tests/test_token_error.py)
    Trap("second_order_pairs_not_in_true", EE + "config/probe_config.py",
         'pairs = list(so.eta_list) if so.enabled and so.method == "finite_difference" else []', "pairs = []",
         ("tests/test_first_order_check.py::test_second_order_passes_are_true_rows_equal_to_the_exact_change",)),
    Trap("symmetric_residual_slope_over_eta", EE + "estimators/paired.py",
         "return float((whp / wdp - whm / wdm) / (2 * eta) - (a_sum", "return float((whp / wdp - whm / wdm) / eta - (a_sum",
         ("tests/test_first_order_check.py::test_second_order_passes_are_true_rows_equal_to_the_exact_change",)),
    Trap("rounding_floor_from_the_smallest_eta", EE + "estimators/rounding_floor.py",
         "return max(small, key=lambda e: (abs(e), e)), pair", "return min(small, key=abs), pair",
         ("tests/test_first_order_check.py::test_rounding_floor_warns_where_delta_h_is_forced_under_it",)),
    Trap("rounding_floor_never_warned", EE + "probe/beyond.py",
         "    if floor is None:\n        return []\n    F = floor", "    if floor is not None:\n        return []\n    F = floor",
         ("tests/test_first_order_check.py::test_rounding_floor_warns_where_delta_h_is_forced_under_it",)),
    Trap("window_spread_not_halved", EE + "estimators/second_difference.py",
         "spread = float(np.std((plus - minus) / 2.0))", "spread = float(np.std(plus - minus))",
         ("tests/test_first_order_check.py::test_window_diagnostics_of_the_reported_pair",)),
    Trap("token_error_shrunk", EE + "estimators/token_derivatives.py",
         "return [(c - f).abs() for c, f in zip(central, shifted)]",
         "return [(c - f).abs() * 0.01 for c, f in zip(central, shifted)]",
         ("tests/test_token_error.py::test_every_token_within_its_stated_error_or_a_warning",)),
    # ---- results.json schema version and the plain config hash (tests/test_config.py, tests/test_results.py,
    #      tests/test_run_dir.py, tests/test_errors_cli.py); one name per E pass (tests/test_e_pass_names.py)
    Trap("config_hash_drops_a_section", EE + "config/probe_config.py",
         'd = self.model_dump(mode="json", exclude=set(UNHASHED_SECTIONS))',
         'd = self.model_dump(mode="json", exclude=set(UNHASHED_SECTIONS) | {"sampler"})',
         ("tests/test_config.py::test_config_hash_is_the_sha256_of_the_canonical_config",)),
    Trap("schema_version_not_required", EE + "report/results_schema.py",
         '    "schema_version": None,\n    "deltaH1": None,', '    "deltaH1": None,',
         ("tests/test_results.py::test_results_json_carries_the_schema_version",)),
    Trap("load_results_not_upgraded", EE + "report/results_schema.py",
         "    return upgrade_results(results)", "    return results",
         ("tests/test_results.py::test_a_version_1_results_json_reads_under_the_current_names",)),
    Trap("v1_timing_keys_kept", EE + "report/results_schema.py",
         'out["timing"] = _renamed(out["timing"], V1_TIMING_KEYS)', 'out["timing"] = dict(out["timing"])',
         ("tests/test_results.py::test_a_version_1_results_json_reads_under_the_current_names",)),
    Trap("v1_central_difference_read_as_backward_hooks", EE + "report/results_schema.py",
         'if method == "backward_hooks" and consistency.get("r_method") == "central_difference":',
         'if method == "central_difference":',
         ("tests/test_results.py::test_a_version_1_e_pass_is_read_off_its_consistency",)),
    Trap("resume_of_unversioned_run_dir_allowed", EE + "report/results_schema.py",
         'version = (meta or {}).get("schema_version", 1)', 'version = (meta or {}).get("schema_version", SCHEMA_VERSION)',
         ("tests/test_run_dir.py::test_resume_of_a_directory_of_another_schema_version_is_refused",
          "tests/test_errors_cli.py::test_bad_input_is_one_clean_line_and_exit_2[resume_other_schema]")),
    Trap("sweep_resume_of_another_schema_allowed", EE + "sweep/sweep_dir.py",
         "            refuse_other_schema(meta, path)\n", "",
         ("tests/test_run_dir.py::test_resume_of_a_directory_of_another_schema_version_is_refused",)),
    Trap("e_pass_reports_the_pieces_method", EE + "probe/recipe.py",
         "e_pass=e_pass.name,", 'e_pass="jvp" if e_pass.name == "jvp" else "backward_hooks",',
         ("tests/test_e_pass_names.py::test_results_json_records_the_name_of_the_pass_the_config_selects",)),
    Trap("e_pass_class_name_drifts", EE + "probe/e_pass.py",
         'name: ClassVar[str] = "two_pass"', 'name: ClassVar[str] = "scored"',
         ("tests/test_e_pass_names.py::test_the_class_and_the_config_value_are_the_strategys_name",)),
]

# Appended to the scratch tests/conftest.py: records which entropy_experiments the run imported.
IMPORT_PROBE = """

import entropy_experiments as _trap_pkg  # scripts/traps.py: which copy was imported?

with open(os.path.join(os.environ["TRAPS_SCRATCH"], "imported_from.txt"), "w") as _f:
    _f.write(_trap_pkg.__file__)
"""


def check_traps(traps: list[Trap]) -> list[str]:
    """Every old text exactly once in the repository file; names unique. Returns the problems."""
    problems = []
    if len({t.name for t in traps}) != len(traps):
        problems.append("trap names are not unique")
    for trap in traps:
        path = ROOT / trap.path
        if not path.is_file():
            problems.append(f"{trap.name}: {trap.path} does not exist")
            continue
        count = path.read_text().count(trap.old)
        if count != 1:
            problems.append(f"{trap.name}: old text found {count} times in {trap.path} (must be exactly once): "
                            f"{trap.old!r}")
        if not trap.tests:
            problems.append(f"{trap.name}: no tests listed")
    return problems


def make_scratch(parent: Path, trap: Trap | None) -> Path:
    """A copy of the package + tests under `parent`, with `trap` applied (None: unpatched)."""
    scratch = Path(tempfile.mkdtemp(prefix=(trap.name if trap else "baseline") + "-", dir=parent))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for item in COPIED:
        src = ROOT / item
        if src.is_dir():
            shutil.copytree(src, scratch / item, ignore=ignore)
        else:
            shutil.copy2(src, scratch / item)
    conftest = scratch / "tests" / "conftest.py"
    conftest.write_text(conftest.read_text() + IMPORT_PROBE)
    if trap is not None:
        target = scratch / trap.path
        text = target.read_text()
        if text.count(trap.old) != 1:
            raise SystemExit(f"traps: {trap.name}: old text not found exactly once in the scratch {trap.path}")
        target.write_text(text.replace(trap.old, trap.new))
    return scratch


def run_pytest(scratch: Path, tests: list[str], stop_first: bool) -> tuple[int | None, str, float]:
    """(pytest exit code or None on timeout, output tail, seconds) for `tests` run inside `scratch`."""
    env = {**os.environ, "PYTHONPATH": str(scratch), "TRAPS_SCRATCH": str(scratch), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["-x"] if stop_first else []), *tests]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, check=False, cwd=scratch, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"")
        return None, (out.decode() if isinstance(out, bytes) else out)[-2000:], time.monotonic() - start
    return proc.returncode, (proc.stdout + proc.stderr)[-2000:], time.monotonic() - start


def imported_from_scratch(scratch: Path) -> str | None:
    """None if the run imported the scratch copy, else what went wrong."""
    marker = scratch / "imported_from.txt"
    if not marker.is_file():
        return "the scratch conftest never ran"
    where = Path(marker.read_text()).resolve()
    return None if where.is_relative_to(scratch.resolve()) else f"imported {where}, not the scratch copy"


def run_one(parent: Path, trap: Trap | None, tests: list[str]) -> dict:
    """Apply `trap` in a fresh scratch copy, run its tests, classify the outcome."""
    scratch = make_scratch(parent, trap)
    rc, tail, seconds = run_pytest(scratch, tests, stop_first=trap is not None)
    wrong_import = imported_from_scratch(scratch)
    if wrong_import:
        status, why = "ERROR", wrong_import
    elif rc is None:
        status, why = "ERROR", f"timed out after {TIMEOUT_S} s"
    elif trap is None:
        status, why = ("PASSED", "") if rc == 0 else ("FAILED", f"pytest exit code {rc}")
    elif rc == 1:
        status, why = "CAUGHT", ""
    elif rc == 0:
        status, why = "SURVIVED", "the listed tests pass with the bug in place"
    else:
        status, why = "ERROR", f"pytest exit code {rc} (collection or usage error)"
    shutil.rmtree(scratch, ignore_errors=True)
    return {"name": trap.name if trap else "(baseline, unpatched)", "path": trap.path if trap else "-",
            "status": status, "why": why, "seconds": seconds, "tail": tail}


def print_table(rows: list[dict], total_s: float) -> None:
    width = max(len(r["name"]) for r in rows)
    pwidth = max(len(r["path"]) for r in rows)
    print(f"\n{'trap':<{width}}  {'file':<{pwidth}}  {'result':<8}  {'time':>6}")
    print("-" * (width + pwidth + 22))
    for r in rows:
        print(f"{r['name']:<{width}}  {r['path']:<{pwidth}}  {r['status']:<8}  {r['seconds']:5.1f}s"
              + (f"  ({r['why']})" if r["why"] else ""))
    counts = {s: sum(r["status"] == s for r in rows) for s in ("CAUGHT", "SURVIVED", "ERROR")}
    print(f"\n{counts['CAUGHT']} caught, {counts['SURVIVED']} survived, {counts['ERROR']} errors; "
          f"total {total_s:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these traps")
    parser.add_argument("--jobs", type=int, default=2, help="parallel pytest runs (default 2)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unpatched run of the listed tests")
    parser.add_argument("--list", action="store_true", help="print the traps and exit")
    args = parser.parse_args(argv)
    traps = [t for t in TRAPS if not args.only or t.name in args.only]
    unknown = set(args.only or []) - {t.name for t in TRAPS}
    problems = check_traps(TRAPS) + [f"unknown trap {name!r}" for name in sorted(unknown)]
    if problems:
        print("traps: the trap list is out of sync with the code:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    if args.list:
        for t in traps:
            print(f"{t.name:<48} {t.path:<45} {' '.join(t.tests)}")
        return 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="traps-") as parent:
        jobs = [] if args.no_baseline else [(None, sorted({i for t in traps for i in t.tests}))]
        jobs += [(t, list(t.tests)) for t in traps]
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            rows = list(pool.map(lambda job: run_one(Path(parent), *job), jobs))
    for r in rows:
        if r["status"] not in ("CAUGHT", "PASSED"):
            print(f"\n==== {r['name']}: {r['status']} — last output:\n{r['tail']}", file=sys.stderr)
    print_table(rows, time.monotonic() - start)
    return 0 if all(r["status"] in ("CAUGHT", "PASSED") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
