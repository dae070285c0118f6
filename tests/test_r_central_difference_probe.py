"""variance.r_method central_difference through the probe (docs/maths.md §6), against the exact pieces of the
second backward (variance.r_method backward) on the same tiny model, E and U:

* δH₁ is the same number (X̂ from one backward of L_X vs the two of `one_pass_sums`: 1e-5), so is δH₁ from the
  pieces (r cancels in A − Ĥ·B) and the pieces' check against X̂·v still runs;
* SE_E moves by ≤ 1 % of itself (r_i from the ΔH(±η) passes at η = 1e-4 here: docs/scaling.md measures
  ≤ 1e-3 relative), with and without the sampler correction's weights (E drawn at another temperature,
  tests/sampler_toy.py), and the paired residuals' SEs likewise;
* r_i from a pair of passes of its own (variance.r_eta not among the ΔH η, or importance off);
* the competing predictors' directions keep the L_β backward (it gives their r' exactly and is cheaper than two
  passes per direction): every predictor's SE_E is the exact one, and a warning says so;
* a config that cannot run it is refused with one line naming the key.
"""

from __future__ import annotations

import copy

import pytest

from entropy_experiments.config import config_from_dict
from entropy_experiments.errors import ConfigError
from entropy_experiments.probe import recipe
from entropy_experiments.probe.results import WarningLog
from entropy_experiments.report.results_schema import V1_TIMING_KEYS
from tests.run_helpers import make_run_setup
from tests.sampler_toy import draw_from_sampler

ETAS = [1.0e-5, 1.0e-4, 1.0e-3]  # r_i by default at 1e-4: the largest ≤ R_ETA_MAX


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model_dir):
    """(config dict, policy, E, U, E drawn by a sampler at temperature 2)."""
    _, d = make_run_setup(tmp_path_factory.mktemp("rcd"), tiny_model_dir, estimator={"microbatch_size": 4},
                          batch_config={"B_E": 12}, importance={"eta_list": ETAS}, output={"token_attribution": False})
    config = config_from_dict(d)
    policy = recipe.load_phase(config, recipe.SINGLE, WarningLog())
    samples = recipe.sample_phase(config, policy.engine)
    model64 = copy.deepcopy(policy.trainable.model).double()
    E_s = draw_from_sampler(samples.E, model64, policy.tokenizer, temperature=2.0,
                            max_new=config.generation.max_new_tokens, seed=5)
    return d, policy, samples.E, samples.U, E_s


def _results(tiny, E=None, **sections) -> dict:
    d, policy, E0, U, _ = tiny
    d = copy.deepcopy(d)
    for section, values in sections.items():
        d[section] = {**d.get(section, {}), **values}
    return recipe.run(config_from_dict(d), policy=policy, batches=(E if E is not None else E0, U)).results


def _assert_close_to_exact(exact: dict, lean: dict, eta: float) -> None:
    assert exact["consistency"]["r_method"] == "backward" and exact["consistency"]["r_eta"] is None
    assert lean["consistency"]["r_method"] == "central_difference" and lean["consistency"]["r_eta"] == eta
    assert exact["e_pass"] == "backward_hooks" and lean["e_pass"] == "central_difference"
    # rel 1e-4: the two E passes add in different orders (1.4e-5 apart on torch's scalar kernels, ATEN_CPU_CAPABILITY
    # default); a wrong r_i moves δH₁ by percents
    assert lean["deltaH1"] == pytest.approx(exact["deltaH1"], rel=1e-4)
    assert lean["consistency"]["deltaH1_from_pieces"] == pytest.approx(exact["consistency"]["deltaH1_from_pieces"],
                                                                       rel=1e-4)
    assert lean["consistency"]["relative_difference"] < 1e-4
    assert abs(lean["se"]["E"] - exact["se"]["E"]) <= 1e-2 * exact["se"]["E"]
    assert lean["se"]["U"] == pytest.approx(exact["se"]["U"], rel=1e-4)


@pytest.mark.e2e
@pytest.mark.parametrize("sampler", [False, True], ids=["policy_E", "sampler_E"])
def test_central_difference_pieces_match_the_exact_pieces(tiny, sampler):
    E = tiny[4] if sampler else None
    off = {"predictors": {"enabled": False}}
    exact = _results(tiny, E, variance={"r_method": "backward"}, **off)
    lean = _results(tiny, E, variance={"r_method": "central_difference"}, **off)
    _assert_close_to_exact(exact, lean, 1.0e-4)
    assert "delta_h" in lean["timing"] and "r_central_difference" not in lean["timing"]
    for e_row, l_row in zip(exact["true"], lean["true"], strict=True):  # ΔH(η) and its paired residual
        assert l_row["deltaH_true"] == pytest.approx(e_row["deltaH_true"], rel=1e-3, abs=1e-9)
        assert l_row["residual"]["se"] == pytest.approx(e_row["residual"]["se"], rel=1e-2)


@pytest.mark.e2e
def test_a_pair_of_its_own_when_the_eta_is_no_delta_h_pass(tiny):
    off = {"predictors": {"enabled": False}}
    exact = _results(tiny, variance={"r_method": "backward"}, **off)
    lean = _results(tiny, variance={"r_method": "central_difference", "r_eta": 3.0e-5}, **off)
    _assert_close_to_exact(exact, lean, 3.0e-5)
    assert lean["timing"]["r_central_difference"] > 0
    assert not set(V1_TIMING_KEYS) & set(lean["timing"])  # the phases' names only
    assert {"sample", "update_direction", "e_pass_backward", "error_bars", "r_central_difference", "delta_h1_total",
            "delta_h", "second_order", "attribution"} <= set(lean["timing"])
    alone = _results(tiny, variance={"r_method": "central_difference", "r_eta": 3.0e-5},
                     importance={"enabled": False}, second_order={"enabled": False}, **off)
    assert alone["se"]["E"] == pytest.approx(lean["se"]["E"], rel=1e-6)
    assert alone["true"] == []


@pytest.mark.e2e
@pytest.mark.parametrize("sampler", [False, True], ids=["policy_E", "sampler_E"])
def test_predictors_keep_the_exact_pieces(tiny, sampler):
    E = tiny[4] if sampler else None
    exact = _results(tiny, E, variance={"r_method": "backward"})
    lean = _results(tiny, E, variance={"r_method": "central_difference"})
    assert lean["consistency"]["r_method"] == "backward"
    assert any("variance.r_method central_difference" in w for w in lean["warnings"])
    assert lean["se"]["E"] == pytest.approx(exact["se"]["E"], rel=1e-9)
    for name, entry in exact["predictors"].items():
        if entry.get("se_E") is not None:
            assert lean["predictors"][name]["se_E"] == pytest.approx(entry["se_E"], rel=1e-9), name


@pytest.mark.parametrize(("sections", "key"), [
    ({"importance": {"enabled": False}}, "variance.r_eta"),
    ({"importance": {"eta_list": [1e-3, 1e-2]}}, "variance.r_eta"),
    ({"importance": {"symmetric": False}}, "variance.r_eta"),
    ({"estimator": {"baseline": "loo_position"}}, "estimator.baseline"),
    ({"variance": {"directional": "jvp"}}, "variance.directional"),
])
def test_a_config_that_cannot_run_it_is_refused_naming_the_key(tiny, sections, key):
    d = copy.deepcopy(tiny[0])
    d["second_order"] = {"enabled": False}
    d["variance"] = {"r_method": "central_difference"}
    for section, values in sections.items():
        d[section] = {**d.get(section, {}), **values}
    with pytest.raises(ConfigError) as err:
        config_from_dict(d)
    line = str(err.value)
    assert key in line and "\n" not in line.strip()
    d["variance"]["r_method"] = "backward"
    config_from_dict(d)  # the same config with the exact pieces runs


def test_r_method_enters_the_hash(tiny):
    d = copy.deepcopy(tiny[0])
    plain = config_from_dict(d).config_hash()
    d["variance"] = {"r_method": "backward"}
    assert config_from_dict(d).config_hash() == plain
    d["variance"] = {"r_method": "central_difference"}
    assert config_from_dict(d).config_hash() != plain
