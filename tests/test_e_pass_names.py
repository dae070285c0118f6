"""One name per E pass strategy (probe/e_pass.py): for every strategy of the registry `E_PASSES`, its class, the
config value that selects it and the value results.json records (`e_pass`) are the same word. Derived from the
registry, so a strategy added or renamed is checked without editing this file; the results.json value comes from
a real probe run on the tiny model with that config value set."""

from __future__ import annotations

import copy
import re
import typing

import pytest

from entropy_experiments.config import ProbeConfig, config_from_dict
from entropy_experiments.probe import recipe
from entropy_experiments.probe.e_pass import E_PASSES
from entropy_experiments.probe.results import WarningLog
from tests.run_helpers import make_run_setup


def config_values(dotted: str) -> tuple:
    """The values the config key `section.key` accepts (its Literal)."""
    section, key = dotted.split(".")
    annotation = ProbeConfig.model_fields[section].annotation.model_fields[key].annotation
    return typing.get_args(annotation)


def words(class_name: str) -> str:
    """CamelCase → snake_case: BackwardHooksPass → backward_hooks_pass."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", class_name).lower()


@pytest.mark.parametrize("name", sorted(E_PASSES))
def test_the_class_and_the_config_value_are_the_strategys_name(name):
    cls = E_PASSES[name]
    assert cls.name == name
    assert words(cls.__name__) in (name, f"{name}_pass")  # the class is the name, with "Pass" unless it ends so
    if cls.config_key is not None:
        assert name in config_values(cls.config_key), (cls.config_key, config_values(cls.config_key))
    else:  # chosen where no pieces are wanted: no key names it, and none may name it otherwise
        assert not any(name in config_values(c.config_key) for c in E_PASSES.values() if c.config_key)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model_dir):
    """(config dict with the later phases off, policy, E, U) of the tiny model (no predictors: central_difference
    takes r_i along v alone)."""
    _, d = make_run_setup(tmp_path_factory.mktemp("e_pass"), tiny_model_dir, estimator={"microbatch_size": 4},
                          batch_config={"B_E": 8}, importance={"eta_list": [1.0e-4]},
                          second_order={"enabled": False}, predictors={"enabled": False},
                          output={"token_attribution": False})
    config = config_from_dict(d)
    policy = recipe.load_phase(config, recipe.SINGLE, WarningLog())
    samples = recipe.sample_phase(config, policy.engine)
    return d, policy, samples.E, samples.U


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(E_PASSES))
def test_results_json_records_the_name_of_the_pass_the_config_selects(tiny, name):
    """The strategy's config value set (for the pass no key names: error bars off, so no pieces are wanted), the
    run's results.json `e_pass` is that word."""
    d, policy, E, U = tiny
    d = copy.deepcopy(d)
    key = E_PASSES[name].config_key
    if key is None:
        d["variance"] = {**d.get("variance", {}), "enabled": False}
    else:
        section, field = key.split(".")
        d[section] = {**d.get(section, {}), field: name}
    results = recipe.run(config_from_dict(d), policy=policy, batches=(E, U)).results
    assert results["e_pass"] == name
