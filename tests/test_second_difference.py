"""second_order.method: finite_difference — d2 from the ΔH(±η) passes (estimators/second_difference.py).

- its jackknife SE against the delete-one loop written out by hand on four sequences;
- the bias estimate against a statistic whose fourth-order term is known;
- on the enumerable toy model: d2 against the exact d²H/dη² (float64 enumeration) within SE + bias bound, and
  against the nested-jvp d2 on the same E, from the ΔH passes' η and from passes of its own at the default η;
- on the tiny model at the default η, with no ΔH passes at all: within a tenth of the jvp's SE of the jvp's d2;
- the config: an η must be > 0 and finite; the keys added later leave existing config hashes unchanged.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from entropy_experiments.config import config_from_dict
from entropy_experiments.errors import ConfigError
from entropy_experiments.estimators.second_difference import finite_difference_report, second_difference
from entropy_experiments.estimators.second_order import second_derivative
from entropy_experiments.estimators.sequence_scores import second_order_sums, units_of
from entropy_experiments.testing.tiny_model import build_toy_enumerable_dir
from tests.probe_helpers import make_probe, write_prompts
from tests.test_probe import TOY_PROMPTS, _exact_entropy, _shifted


def test_jackknife_se_written_out_by_hand():
    # four sequences, each its own unit, per_token; the weights exp(log w) written out
    lw_p, hp = [0.1, -0.2, 0.05, 0.0], [2.0, 1.5, 3.1, 0.9]
    lw_m, hm = [-0.1, 0.25, -0.04, 0.01], [1.9, 1.7, 2.8, 1.0]
    h, T, eta = [2.1, 1.6, 3.0, 1.0], [2.0, 2.0, 3.0, 1.0], 0.5

    def stat(keep):
        wp = [math.exp(x) for x in lw_p]
        wm = [math.exp(x) for x in lw_m]
        hat_p = sum(wp[i] * hp[i] for i in keep) / sum(wp[i] * T[i] for i in keep)
        hat_m = sum(wm[i] * hm[i] for i in keep) / sum(wm[i] * T[i] for i in keep)
        hat_0 = sum(h[i] for i in keep) / sum(T[i] for i in keep)
        return (hat_p - 2 * hat_0 + hat_m) / eta ** 2

    reps = [stat([j for j in range(4) if j != i]) for i in range(4)]
    mean = sum(reps) / 4
    se = math.sqrt(3 / 4 * sum((r - mean) ** 2 for r in reps))
    est = second_difference(lw_p, hp, lw_m, hm, h, T, eta, normalize="per_token")
    assert est.value == pytest.approx(stat(range(4)), rel=1e-12)
    assert est.se == pytest.approx(se, rel=1e-10)
    # grouped units: (0, 1) and (2, 3) — two replicates, each leaving one pair out
    grouped = second_difference(lw_p, hp, lw_m, hm, h, T, eta, normalize="per_token", units=[0, 0, 1, 1])
    reps = [stat([2, 3]), stat([0, 1])]
    assert grouped.se == pytest.approx(math.sqrt(1 / 2 * sum((r - sum(reps) / 2) ** 2 for r in reps)), rel=1e-10)


def test_bias_estimate_of_the_fourth_order_term():
    """Per-sequence log-weights 0 and entropies h_i + c_i η² + q_i η⁴ (per_sequence): Ĥ(η) is exactly
    mean h + η² mean c + η⁴ mean q, so d2(η) = 2 mean c + 2 η² mean q and the bias of d2(η₁) is 2 η₁² mean q."""
    rng = np.random.default_rng(0)
    N = 20
    h, c, q = rng.uniform(1, 2, N), rng.normal(0, 1, N), rng.normal(1, 0.1, N)
    per_eta = {s * e: {"logw": np.zeros(N), "h_new": h + c * e ** 2 + q * e ** 4} for e in (0.1, 0.2) for s in (1, -1)}
    report = finite_difference_report(per_eta, h, np.ones(N), normalize="per_sequence")
    exact = 2 * c.mean()
    # the largest η is reported (least rounding); its bias estimate is its fourth-order term exactly here
    assert report["eta"] == 0.2 and [r["eta"] for r in report["per_eta"]] == [0.1, 0.2]
    assert report["d2"] - exact == pytest.approx(2 * q.mean() * 0.2 ** 2, rel=1e-6)
    assert report["bias_estimate"] == pytest.approx(2 * q.mean() * 0.2 ** 2, rel=1e-6)
    # the smaller η: the same expression (which error dominates the difference, truncation or rounding, is unknown)
    assert report["per_eta"][0]["bias_estimate"] == pytest.approx(2 * q.mean() * 0.2 ** 2, rel=1e-6)
    rounding = {s * e: {"logw": np.zeros(N), "h_new": h + c * e ** 2 + 1e-3 * (e == 0.1)}
                for e in (0.1, 0.2) for s in (1, -1)}  # a constant error of 1e-3 in ΔH(±0.1) alone: d2 off by 0.2
    noisy = finite_difference_report(rounding, h, np.ones(N), normalize="per_sequence")
    assert noisy["d2"] == pytest.approx(2 * c.mean(), rel=1e-9)  # d2(0.2) is exact; d2(0.1) is 0.2 off
    assert noisy["bias_estimate"] == pytest.approx(0.2 * 0.2 ** 2 / (0.2 ** 2 - 0.1 ** 2), rel=1e-6)
    assert noisy["per_eta"][0]["d2"] - 2 * c.mean() == pytest.approx(0.2, rel=1e-6)
    one = finite_difference_report({e: per_eta[e] for e in (0.1, -0.1)}, h, np.ones(N), normalize="per_sequence")
    assert one["eta"] == 0.1 and one["bias_estimate"] is None
    with pytest.raises(ValueError, match="needs ΔH at"):
        finite_difference_report({0.1: per_eta[0.1]}, h, np.ones(N), normalize="per_sequence")


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return build_toy_enumerable_dir(tmp_path_factory.mktemp("toy"))


@pytest.mark.e2e
@pytest.mark.parametrize(("normalize", "etas"), [("per_token", [1e-2, 2e-2]), ("per_sequence", [1e-2, 2e-2]),
                                                 ("per_token", [3e-4, 1e-3])])  # the last: its own passes, flagged
def test_finite_difference_on_enumerable_model(toy_dir, tmp_path, normalize, etas):
    """d2 from the ΔH(±η) passes (second_order.eta_list = the importance η) or from passes of its own (3e−4 and
    1e−3: on this model 3e−4 is rounding-bound, so the bias estimate exceeds the SE and results.json warns)
    against the exact d²H/dη² and against the nested-jvp d2 on the same E."""
    max_new = 3
    second = {"enabled": True, "method": "finite_difference", **({"eta_list": etas} if etas else {})}
    probe = make_probe(toy_dir, write_prompts(tmp_path / "toy.jsonl", TOY_PROMPTS), {
        "seed": 5, "batch_config": {"B_E": 3000, "B_U": 8, "G": 4},
        "generation": {"max_new_tokens": max_new, "gen_batch_size": 1024, "tf_batch_size": 1024},
        "estimator": {"normalize": normalize, "microbatch_size": 1024}, "predictors": {"enabled": False},
        "importance": {"eta_list": [1e-2, 2e-2], "symmetric": True},
        "second_order": second})
    captured = {}
    outcome = probe.run(on_batches=lambda E, U: captured.update(E=E))
    results, E, v = outcome.results, captured["E"], outcome.update_vector
    model64 = copy.deepcopy(probe.model).double()
    params = {n: p.detach() for n, p in model64.named_parameters()}

    def H(s):
        return _exact_entropy(model64, _shifted(params, v, s), probe.tokenizer, TOY_PROMPTS, 1.0,
                              normalize, max_new)

    eps = 1e-2
    exact_d2 = (H(eps) - 2 * H(0.0) + H(-eps)) / eps ** 2
    sums = second_order_sums(probe.engine, E, v)
    jvp = second_derivative(*(sums[k] for k in ("s", "s2", "dh", "d2h", "h", "T")), normalize=normalize,
                            units=units_of(E.num_prompts, E.num_responses_per_prompt))
    so = results["second_order"]
    bias = so["bias_estimate"] or 0.0  # null with one η (the default)
    print(f"\nfinite difference d2 {so['d2']:.5g} ± {so['se']:.2g} (bias ≤ {so['bias_estimate']}, η {so['eta']:g}), "
          f"jvp {jvp.value:.5g} ± {jvp.se:.2g}, exact {exact_d2:.5g}; per η {so['per_eta']}")
    assert so["method"] == "finite_difference" and so["eta"] in probe.config.second_order.eta_list
    assert (so["bias_estimate"] is None) == (len(probe.config.second_order.eta_list) == 1)
    assert abs(so["d2"] - exact_d2) < 4 * so["se"] + bias, (so, exact_d2)
    assert so["se"] < 0.5 * abs(exact_d2), "the test must be sharp enough to mean something"
    # the same E: the two methods differ by the O(η²) term and rounding only, far inside the SEs
    assert abs(so["d2"] - jvp.value) < min(so["se"], jvp.se), (so["d2"], jvp)
    assert so["se"] == pytest.approx(jvp.se, rel=0.2)
    flagged = so["bias_estimate"] is not None and not so["bias_estimate"] <= so["se"]  # recorded, not only logged
    assert any(w.startswith("second_order: d2 at η") for w in results["warnings"]) is flagged, (so, flagged)
    row = results["true"][0]
    assert row["second_order_prediction"] == pytest.approx(
        row["eta"] * results["x_hat_dot_v"] + 0.5 * row["eta"] ** 2 * so["d2"])


def _toy_config(**sections) -> dict:
    return {"checkpoint": {"base_model": "unused"}, **sections}


@pytest.mark.parametrize("etas", [[0.0], [-1e-3], [float("inf")], []])
def test_finite_difference_eta_must_be_positive_and_finite(etas):
    with pytest.raises((ConfigError, ValueError), match="eta_list"):
        config_from_dict(_toy_config(second_order={"eta_list": etas}))
    for importance in ({"symmetric": False}, {"enabled": False}):  # its own ±η passes: no ΔH pass needed
        assert config_from_dict(_toy_config(importance=importance)).second_order.method == "finite_difference"


@pytest.mark.parametrize("extra", [{}, {"importance": {"symmetric": False}}, {"second_order": {"enabled": False}}])
def test_method_key_enters_the_config_hash(extra):
    """second_order.method is hashed like every key: jvp and finite_difference hash apart, the default
    (finite_difference) stated or not hashes alike."""
    def config(**second_order):
        return config_from_dict(_toy_config(**{**extra, "second_order": {**extra.get("second_order", {}),
                                                                        **second_order}}))

    jvp, finite = config(method="jvp").config_hash(), config(method="finite_difference").config_hash()
    assert jvp != finite
    assert finite == config_from_dict(_toy_config(**extra)).config_hash()


@pytest.mark.e2e
def test_default_finite_difference_on_the_tiny_model_against_the_jvp(tiny_model_dir, tmp_path):
    """The default second order (finite_difference at the default η, its own ±η passes: importance off) against the
    exact nested jvp on the same E: the two differ by the O(η²) term and rounding only, which docs/maths.md §10
    states is small against the SE; here within a tenth of the jvp's SE, and the SEs agree. With a second η the
    run's own bias estimate says the same."""
    from entropy_experiments.estimators.delta_h import DeltaH
    from entropy_experiments.probe import beyond, recipe
    from tests.probe_helpers import SHORT_PROMPTS

    probe = make_probe(tiny_model_dir, write_prompts(tmp_path / "p.jsonl", SHORT_PROMPTS), {
        "batch_config": {"B_E": 32, "B_U": 4, "G": 2}, "generation": {"max_new_tokens": 16},
        "importance": {"enabled": False}})
    E, U, _ = probe.sample(B_E=32, B_U=4, G=2)
    res = recipe.estimate_phase(probe.config, probe.policy, E, U, recipe.WarningLog()).delta_h1
    fd = beyond.second_order_phase(probe.config, probe.policy, E, res, DeltaH.not_measured())
    jvp_config = probe.config.model_copy(update={"second_order": probe.config.second_order.model_copy(
        update={"method": "jvp"})})
    jvp = beyond.second_order_phase(jvp_config, probe.policy, E, res, DeltaH.not_measured())
    pair_config = probe.config.model_copy(update={"second_order": probe.config.second_order.model_copy(
        update={"eta_list": [3e-4, 1e-3]})})  # a second η: the run's own bias estimate
    pair = beyond.second_order_phase(pair_config, probe.policy, E, res, DeltaH.not_measured())
    print(f"\nfinite difference {fd['d2']:.5g} ± {fd['se']:.3g} at η {fd['eta']:g}; with 3e-4 too: bias ≤ "
          f"{pair['bias_estimate']:.2g}; jvp {jvp['d2']:.5g} ± {jvp['se']:.3g}; per η {pair['per_eta']}")
    assert fd["method"] == "finite_difference" and jvp["method"] == "jvp"
    assert fd["eta"] == 1e-3 and len(fd["per_eta"]) == 1 and fd["bias_estimate"] is None  # the default: one η
    assert pair["d2"] == fd["d2"] and len(pair["per_eta"]) == 2  # the larger η is reported
    assert abs(fd["d2"] - jvp["d2"]) < 0.1 * jvp["se"], (fd, jvp)
    assert pair["bias_estimate"] < 0.1 * jvp["se"]
    assert fd["se"] == pytest.approx(jvp["se"], rel=0.1)
