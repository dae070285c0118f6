"""The one pass along v (probe/tangent.py) shared by the second order and the token attribution, against the
separate passes it replaces, in the same process on the tiny model:

- d2 from the shared order-2 pass is bit for bit the d2 of the second order's own pass;
- the token attribution from the shared order-2 pass is bit for bit the attribution of a separate order-2 pass,
  and within fp32 rounding of the order-1 pass it used to make (two AD paths through fp32 forwards);
- without the second order by jvp the shared pass is order 1 and the attribution's numbers are bit for
  bit those of the order-1 pass (`score_E`);
- the whole probe with the second order by jvp makes ONE pass along v where it made two.
"""

from __future__ import annotations

import numpy as np
import pytest

from entropy_experiments.probe import beyond, recipe
from entropy_experiments.probe.attribution import e_token_attribution, token_rows
from entropy_experiments.probe.e_pass import score_E
from entropy_experiments.probe.tangent import TangentAlongV, tangent_order, tangent_phase
from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def estimated(tiny_model_dir, tmp_path_factory):
    """(probe set-up, E, U, the δH₁ result) of the tiny model, E scored without jvp (backward-hook pieces)."""
    data = write_prompts(tmp_path_factory.mktemp("tangent") / "prompts.jsonl", SHORT_PROMPTS)
    probe = make_probe(tiny_model_dir, data, {"batch_config": {"B_E": 8, "B_U": 4, "G": 2},
                                               "second_order": {"method": "jvp"}, "importance": {"enabled": False}})
    E, U, _ = probe.sample(B_E=8, B_U=4, G=2)
    res = recipe.estimate_phase(probe.config, probe.policy, E, U, recipe.WarningLog()).delta_h1
    assert res.scores.d_entropy is None, "the test needs an E pass without jvp scores"
    return probe, E, U, res


def _config(probe, **second_order):
    d = probe.config.to_dict()
    d["second_order"].update(second_order)
    return type(probe.config).model_validate(d)


def _attribution(probe, E, res, scores) -> tuple[dict, dict]:
    return e_token_attribution(probe.policy, E, res, token_rows(probe.config, res, scores, None))


def test_shared_order_two_pass_gives_the_second_orders_own_d2_bit_for_bit(estimated):
    probe, E, _, res = estimated
    tangent = tangent_phase(probe.config, probe.policy, E, res)
    assert tangent.order == 2 and tangent.sums is not None
    shared = beyond.second_order_phase(probe.config, probe.policy, E, res, None, sums_along_v=tangent.sums)
    own = beyond.second_order_phase(probe.config, probe.policy, E, res, None)
    assert shared == own and shared["d2"] != 0


def test_attribution_from_the_shared_pass_against_the_separate_passes(estimated):
    probe, E, _, res = estimated
    tangent = tangent_phase(probe.config, probe.policy, E, res)
    again = tangent_phase(probe.config, probe.policy, E, res)  # a separate order-2 pass: same numbers
    shared, columns = _attribution(probe, E, res, tangent.scores)
    separate, columns_again = _attribution(probe, E, res, again.scores)
    assert shared == separate and all(np.array_equal(columns[k], columns_again[k]) for k in ("H", "dH"))
    first = score_E(probe.config, probe.policy, E, res.v)  # the order-1 pass the attribution used to make
    _, columns_first = _attribution(probe, E, res, first)
    for key in ("H", "dH"):
        scale = float(np.abs(columns_first[key]).max())
        assert scale > 0
        np.testing.assert_allclose(columns[key], columns_first[key], rtol=1e-4, atol=1e-5 * scale)


def test_order_one_pass_without_the_jvp_second_order_is_the_attributions_own(estimated):
    probe, E, _, res = estimated
    config = _config(probe, enabled=False)  # (or method finite_difference: no order-2 pass either)
    assert tangent_order(config, res) == 1
    tangent = tangent_phase(config, probe.policy, E, res)
    assert tangent.sums is None
    shared, columns = _attribution(probe, E, res, tangent.scores)
    own, own_columns = _attribution(probe, E, res, score_E(config, probe.policy, E, res.v))
    assert shared == own and all(np.array_equal(columns[k], own_columns[k]) for k in ("H", "dH"))
    off = config.model_copy(update={"output": config.output.model_copy(update={"token_attribution": False})})
    assert tangent_phase(off, probe.policy, E, res) == TangentAlongV()


def test_whole_probe_makes_one_pass_along_v(estimated, monkeypatch):
    probe, E, U, _ = estimated
    calls = []
    real = probe.policy.engine.teacher_force_directional

    def counting(batch, v, **kwargs):
        calls.append(kwargs.get("order", 1))
        return real(batch, v, **kwargs)

    monkeypatch.setattr(probe.policy.engine, "teacher_force_directional", counting)
    outcome = recipe.run(probe.config, policy=probe.policy, batches=(E, U))
    assert calls == [2], calls  # one order-2 pass; before, an order-2 pass and an order-1 pass
    results = outcome.results
    assert results["second_order"]["method"] == "jvp" and results["attribution"]["E_tokens"] is not None
    assert {"second_order", "attribution"} <= set(results["timing"])
