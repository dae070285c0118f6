"""Tests of entropy_experiments.config: defaults, YAML round trip, overrides, legacy aliases, errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from entropy_experiments.config import (
    ProbeConfig,
    config_from_dict,
    load_config,
    packaged_config_path,
)
from entropy_experiments.errors import ConfigError


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _leaf_keys(d: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in d.items():
        if isinstance(v, dict):
            keys |= _leaf_keys(v, f"{prefix}{k}.")
        else:
            keys.add(prefix + k)
    return keys


# ------------------------------------------------------------------------------------------------
# Defaults and packaged configs
# ------------------------------------------------------------------------------------------------


def test_defaults_match_contract():
    cfg = load_config(None)
    assert cfg == ProbeConfig()
    assert cfg.seed == 42 and cfg.learning_rate is None
    assert cfg.checkpoint.base_model is None and cfg.checkpoint.dtype == "fp32"  # None: the adapter's base
    assert cfg.checkpoint.adapter_path is None and cfg.checkpoint.optimizer_path is None
    assert (cfg.batch_config.B_E, cfg.batch_config.B_U, cfg.batch_config.G) == (64, 8, 4)
    assert cfg.batch_config.E_sampling_mode == "replacement"
    assert cfg.generation.stop_strings == ["</answer>"] and cfg.generation.top_p == 1.0
    assert cfg.precision.tf_nograd.autocast is False and cfg.precision.func_override.cast_params is True
    assert cfg.precision.matmul_precision == "highest" and cfg.precision.entropy_fp64 is True
    assert cfg.sampler.batched is True
    assert cfg.estimator.update_direction == "adamw_step" and cfg.estimator.microbatch_size == 4
    assert cfg.importance.eta_list == [1e-5] and cfg.importance.symmetric is False  # one no-grad pass over E
    assert cfg.second_order.method == "finite_difference" and cfg.second_order.eta_list == [1e-3]
    assert cfg.predictors.enabled is False and cfg.output.token_attribution_method == "finite_difference"
    assert cfg.variance.u_groups is None and cfg.reward.name == "tag_pref"
    assert isinstance(cfg.distributed.timeout_s, float) and cfg.distributed.timeout_s == 600.0
    assert cfg.output.run_dir is None


def test_default_yaml_lists_every_key_with_its_default():
    path = packaged_config_path("default")
    assert load_config(path) == ProbeConfig()
    # Equality alone would pass for an empty file: also check that every key is written out.
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert _leaf_keys(raw) == _leaf_keys(ProbeConfig().to_dict())


def test_demo_yaml_is_a_meaningful_cpu_run():
    cfg = load_config(packaged_config_path("demo.yaml"))
    assert cfg.batch_config.B_E >= 12, "SE_E needs enough E sequences to mean something"
    assert cfg.batch_config.G >= 2 and cfg.batch_config.B_U >= 2, "advantages need groups; SE_U needs 2 groups"
    assert cfg.reward.name != "tag_pref", "the 135M model never answers correctly: tag_pref gives v = 0"
    assert (cfg.generation.temperature, cfg.generation.top_p) == (1.0, 1.0)
    assert cfg.checkpoint.device_map == "cpu" and cfg.checkpoint.base_model == "smollm2-135m-instruct"
    assert all(eta > 0 for eta in cfg.importance.eta_list)


def test_unknown_packaged_config():
    with pytest.raises(ConfigError, match=r"no packaged config 'dmeo' \(did you mean 'demo'\?\)"):
        packaged_config_path("dmeo")


# ------------------------------------------------------------------------------------------------
# Round trip, hash, resolution
# ------------------------------------------------------------------------------------------------


def test_yaml_round_trip_gives_equal_config_and_hash(tmp_path):
    cfg = load_config(
        None,
        [
            "checkpoint.checkpoint_path=ckpts/step_40",
            "learning_rate=3e-6",
            "importance.eta_list=[-1e-5, 2.5e-7, 1e-3]",
            "generation.stop_strings=['</answer>', '<|im_end|>']",
            "generation.top_p=0.95",
            "precision.tf_withgrad.dtype=bf16",
            "variance.u_groups=4",
            "output.run_dir=runs/x",
        ],
    )
    again = load_config(_write(tmp_path, cfg.to_yaml()))
    assert again == cfg
    assert again.config_hash() == cfg.config_hash()
    assert again.to_dict() == cfg.to_dict()


def test_checkpoint_paths_are_left_to_the_layout_resolver():
    """The config keeps what the user wrote; checkpoint.layout.resolve_checkpoint finds the files at load
    time (tests/test_checkpoint_layouts.py), so the saved config.yaml reloads to the same config."""
    cfg = config_from_dict({"checkpoint": {"checkpoint_path": "ckpts/step_40/"}})
    assert (cfg.checkpoint.adapter_path, cfg.checkpoint.optimizer_path) == (None, None)
    explicit = config_from_dict({"checkpoint": {"checkpoint_path": "c", "adapter_path": "elsewhere/adapter"}})
    assert explicit.checkpoint.adapter_path == "elsewhere/adapter" and explicit.checkpoint.optimizer_path is None
    assert config_from_dict(explicit.to_dict()) == explicit


def test_hash_ignores_output_but_not_other_sections():
    base = load_config(None)
    assert len(base.config_hash()) == 16 and int(base.config_hash(), 16) >= 0
    moved = load_config(None, ["output.run_dir=/tmp/elsewhere", "output.plot=false"])
    assert moved.config_hash() == base.config_hash()
    assert load_config(None, ["batch_config.B_E=32"]).config_hash() != base.config_hash()
    assert load_config(None, ["seed=1"]).config_hash() != base.config_hash()


def test_equivalent_spellings_normalise_to_equal_configs():
    a = config_from_dict(
        {
            "precision": {"runtime_dtype": "float32", "tf_nograd": {"dtype": "fp32"}},
            "checkpoint": {"dtype": "bfloat16"},
        }
    )
    b = config_from_dict(
        {
            "precision": {"runtime_dtype": "fp32", "tf_nograd": {"dtype": "float32"}},
            "checkpoint": {"dtype": "bf16"},
        }
    )
    assert a.precision.runtime_dtype == "fp32" and a.checkpoint.dtype == "bf16"
    assert a == b and a.config_hash() == b.config_hash()
    # An int where a float is meant is the same value: 600 and 600.0 hash alike.
    assert config_from_dict({"distributed": {"timeout_s": 600}}).config_hash() == ProbeConfig().config_hash()


def test_config_from_dict_does_not_modify_its_input():
    raw = {"checkpoint": {"model_config_path": "m"}, "sampling": {"use_sequence_processor": False}}
    snapshot = yaml.safe_dump(raw)
    config_from_dict(raw)
    assert yaml.safe_dump(raw) == snapshot


# ------------------------------------------------------------------------------------------------
# YAML reading and overrides
# ------------------------------------------------------------------------------------------------


def test_yaml_file_values_empty_sections_and_exponent_floats(tmp_path):
    text = "learning_rate: 1e-5\nimportance:\n  eta_list: [1e-6, 2E-6]\noutput:\nbatch_config:\n  B_E: 3\n"
    cfg = load_config(_write(tmp_path, text))
    # Plain PyYAML (YAML 1.1) would read 1e-5 as a string; here it is a number.
    assert cfg.learning_rate == 1e-5 and cfg.importance.eta_list == [1e-6, 2e-6]
    assert cfg.output == ProbeConfig().output and cfg.batch_config.B_E == 3
    assert load_config(_write(tmp_path, "", "empty.yaml")) == ProbeConfig()


def test_overrides_nested_lists_and_precedence(tmp_path):
    path = _write(tmp_path, "batch_config:\n  B_E: 16\ngeneration:\n  top_p: 0.9\n")
    cfg = load_config(
        path,
        [
            "batch_config.B_E=32",
            "precision.tf_nograd.autocast=true",
            "importance.eta_list=[1e-5, 2e-5]",
            "learning_rate=1e-5",
            "estimator.max_grad_norm=1",
            "reward.name=my_pkg.rewards:score",
            "checkpoint.device_map=cuda:1",
        ],
    )
    assert cfg.batch_config.B_E == 32  # the override wins over the file
    assert cfg.generation.top_p == 0.9  # the rest of the file is kept
    assert cfg.precision.tf_nograd.autocast is True and cfg.precision.tf_withgrad.autocast is False
    assert cfg.importance.eta_list == [1e-5, 2e-5]
    assert cfg.learning_rate == 1e-5 and isinstance(cfg.learning_rate, float)
    assert cfg.objective.max_grad_norm == 1.0  # estimator.max_grad_norm is the legacy alias
    assert cfg.reward.name == "my_pkg.rewards:score" and cfg.checkpoint.device_map == "cuda:1"
    assert load_config(None, ["learning_rate=1e-5", "learning_rate="]).learning_rate is None


def test_override_through_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match=r"^--set seed\.x=1: 'seed' is not a section$"):
        load_config(None, ["seed.x=1"])


# ------------------------------------------------------------------------------------------------
# Legacy aliases
# ------------------------------------------------------------------------------------------------


def test_aliases_map_onto_canonical_keys():
    cfg = config_from_dict(
        {
            "checkpoint": {"model_config_path": "Qwen/Qwen2.5-1.5B"},
            "sampling": {"use_sequence_processor": False},
            "generation": {"do_sample": True, "num_return_sequences": 8, "top_p": 1.0},
        }
    )
    assert cfg.checkpoint.base_model == "Qwen/Qwen2.5-1.5B"
    assert cfg.sampler.batched is False
    assert cfg.batch_config.G == 4  # num_return_sequences is dropped, not mapped
    assert "sampling" not in cfg.to_dict() and "model_config_path" not in cfg.to_dict()["checkpoint"]


def test_probe_rework_section_is_a_legacy_alias_of_sampler():
    cfg = config_from_dict({"probe_rework": {"use_sequence_processor_sampling": False}})
    assert cfg.sampler.batched is False and "probe_rework" not in cfg.to_dict()
    assert cfg == config_from_dict({"sampler": {"batched": False}})
    assert load_config(None, ["probe_rework.use_sequence_processor_sampling=false"]).sampler.batched is False
    with pytest.raises(ConfigError, match=r"unknown key 'probe_rework\.use_sequence_processor_samplin' "
                                          r"\(did you mean 'probe_rework\.use_sequence_processor_sampling'\?\)"):
        config_from_dict({"probe_rework": {"use_sequence_processor_samplin": False}})


@pytest.mark.parametrize("sections", [
    {},
    {"sampler": {"batched": False}, "seed": 7},
    {"objective": {"trainer": "trl", "kl_coef": 0.04, "use_bias_correction_kl": False}},
    {"batch_config": {"pool_size": 500}, "second_order": {"method": "jvp"}, "variance": {"r_method": "backward"}},
])
def test_config_hash_is_the_sha256_of_the_canonical_config(sections):
    """The hash is sha256 of the sorted compact JSON of the whole resolved config, output / distributed / what_if
    left out, every other key under its own name, each key hashed whatever its value: no key is renamed, dropped
    at a value or normalised (a run directory of another schema version is refused by its version instead)."""
    cfg = config_from_dict(sections)
    d = cfg.to_dict()
    for key in ("output", "distributed", "what_if"):
        del d[key]
    payload = json.dumps(d, sort_keys=True, separators=(",", ":"))
    assert cfg.config_hash() == hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def test_a_key_at_its_default_hashes_like_the_key_left_out():
    """A key stated at its default is the same config: the same hash; any other value changes it."""
    base = ProbeConfig().config_hash()
    assert config_from_dict({"objective": {"kl_in_reward_coef": 0.0}}).config_hash() == base
    assert config_from_dict({"objective": {"entropy_coef": 0.01}}).config_hash() != base
    assert config_from_dict({"generation": {"temperature": 0.7}}).config_hash() != base


def test_alias_and_canonical_with_the_same_value_are_accepted():
    cfg = config_from_dict({"checkpoint": {"model_config_path": "m", "base_model": "m"}})
    assert cfg.checkpoint.base_model == "m"


@pytest.mark.parametrize(
    "raw, keys",
    [
        (
            {"checkpoint": {"model_config_path": "a", "base_model": "b"}},
            ("checkpoint.model_config_path", "checkpoint.base_model", "'a'", "'b'"),
        ),
        (
            {
                "sampling": {"use_sequence_processor": True},
                "probe_rework": {"use_sequence_processor_sampling": False},
            },
            (
                "sampling.use_sequence_processor",
                "probe_rework.use_sequence_processor_sampling",
                "true",
                "false",
            ),
        ),
    ],
)
def test_alias_conflict_names_both_keys(raw, keys):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    message = str(info.value)
    assert "\n" not in message and "conflicts" in message
    for key in keys:
        assert key in message


def test_override_of_an_alias_replaces_the_files_canonical_key(tmp_path):
    path = _write(tmp_path, "checkpoint:\n  base_model: from_file\n")
    assert load_config(path, ["checkpoint.model_config_path=from_cli"]).checkpoint.base_model == "from_cli"
    path = _write(tmp_path, "checkpoint:\n  model_config_path: from_file\n", "old.yaml")
    assert load_config(path, ["checkpoint.base_model=from_cli"]).checkpoint.base_model == "from_cli"
    assert (
        load_config(
            None, ["sampling.use_sequence_processor=false"]
        ).sampler.batched
        is False
    )


def test_do_sample_false_is_an_error():
    with pytest.raises(ConfigError, match=r"^generation\.do_sample: .*must be true, got false$"):
        config_from_dict({"generation": {"do_sample": False}})


def test_unknown_key_in_seed_era_section():
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'sampling\.use_sequence_procesor' "
        r"\(did you mean 'sampling\.use_sequence_processor'\?\)",
    ):
        config_from_dict({"sampling": {"use_sequence_procesor": True}})


# ------------------------------------------------------------------------------------------------
# Errors: one line, naming the key and the value
# ------------------------------------------------------------------------------------------------

ERROR_CASES = [
    # (overrides, exact message or None, substrings that must appear)
    (["batch_config.B_E=abc"], "batch_config.B_E: expected an integer, got 'abc'", []),
    (["batch_config.B_E=true"], "batch_config.B_E: expected an integer, got true", []),
    (["batch_config.B_E=2.5"], "batch_config.B_E: expected an integer, got 2.5", []),
    (["generation.top_p=1.5"], "generation.top_p: must be in (0, 1], got 1.5", []),
    (["generation.top_p=0"], "generation.top_p: must be in (0, 1], got 0.0", []),
    (["generation.temperature=0"], "generation.temperature: must be > 0, got 0", []),
    (["generation.temperature=-1.0"], "generation.temperature: must be > 0, got -1.0", []),
    (["batch_config.B_E=0"], "batch_config.B_E: must be >= 1, got 0", []),
    (["batch_config.B_U=0"], "batch_config.B_U: must be >= 1, got 0", []),
    (["batch_config.G=1"], "batch_config.G: must be >= 2, got 1", []),
    (["generation.max_new_tokens=0"], "generation.max_new_tokens: must be >= 1, got 0", []),
    (["importance.eta_list=[]"], "importance.eta_list: must not be empty, got []", []),
    (["importance.eta_list=[1e-5, 0]"], "importance.eta_list: η must be non-zero, got 0.0", []),
    (["importance.eta_list=[1e-5, .inf]"], "importance.eta_list[1]: must be a finite number, got inf", []),
    (["learning_rate=0"], "learning_rate: must be > 0, got 0", []),
    (["learning_rate=-1e-5"], "learning_rate: must be > 0, got -1e-05", []),
    (["learning_rate=abc"], "learning_rate: expected a number, got 'abc'", []),
    (["foo"], "--set expects section.key=value, got 'foo'", []),
    (["=3"], "--set expects section.key=value, got '=3'", []),
    (["batch_config.B_EE=3"], "unknown key 'batch_config.B_EE' (did you mean 'batch_config.B_E'?)", []),
    (["batch_confg.B_E=3"], "unknown key 'batch_confg' (did you mean 'batch_config'?)", []),
    (["generation.B_E=3"], "unknown key 'generation.B_E' (did you mean 'batch_config.B_E'?)", []),
    (["generation.zzzz=3"], None, ["unknown key 'generation.zzzz'", "valid keys:", "top_p"]),
    (
        ["precision.tf_nograd.autocats=true"],
        "unknown key 'precision.tf_nograd.autocats' (did you mean 'precision.tf_nograd.autocast'?)",
        [],
    ),
    (["batch_config=5"], "batch_config: expected a mapping, got 5", []),
    (["checkpoint.dtype=fp8"], None, ["checkpoint.dtype", "'fp8'", "'fp32'"]),
    (["checkpoint.device_map=gpu"], None, ["checkpoint.device_map", "'gpu'"]),
    (["precision.func_override.dtype=int8"], None, ["precision.func_override.dtype", "'int8'"]),
    (["precision.runtime_dtype=fp16"], None, ["precision.runtime_dtype", "'fp16'", "'fp32'"]),
    (["generation.stop_strings=['']"], None, ["generation.stop_strings", "['']"]),
    (["variance.u_groups=1"], "variance.u_groups: must be >= 2, got 1", []),
    (["variance.u_groups=9"], "variance.u_groups: must be <= batch_config.B_U (8), got 9", []),
    (["seed=-1"], "seed: must be >= 0, got -1", []),
    (["objective.max_grad_norm=0"], "objective.max_grad_norm: must be > 0, got 0", []),
]


@pytest.mark.parametrize("overrides, exact, parts", ERROR_CASES, ids=[c[0][0] for c in ERROR_CASES])
def test_error_messages_are_one_line_and_name_key_and_value(overrides, exact, parts):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message and "pydantic" not in message.lower()
    if exact is not None:
        assert message == exact
    for part in parts:
        assert part in message


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="^config file not found: .*nope.yaml$"):
        load_config(missing)


@pytest.mark.parametrize(
    "text, parts",
    [
        ("batch_config:\n  B_E: [1, 2\n", ["bad.yaml", "not valid YAML", "line "]),
        ("- a\n- b\n", ["bad.yaml", "mapping", "list"]),
        ("seed: 1\nseed: 2\n", ["bad.yaml", "duplicate key 'seed'", "line 2"]),
    ],
)
def test_unreadable_yaml(tmp_path, text, parts):
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text, "bad.yaml"))
    message = str(info.value)
    assert "\n" not in message
    for part in parts:
        assert part in message


def test_first_error_prefers_unknown_keys():
    # A typo'd key explains more than the other failure, so it is the one reported.
    with pytest.raises(ConfigError, match=r"^unknown key 'batch_config\.B_EE'"):
        config_from_dict({"batch_config": {"B_U": 0, "B_EE": 3}})


@pytest.mark.parametrize(
    "raw, message",
    [
        ({1: "x"}, "unknown key '1' (valid keys: seed, learning_rate, checkpoint,"),
        ({"checkpoint": {"base_model": ""}}, "checkpoint.base_model: must not be empty, got ''"),
        (
            {"generation": {"stop_strings": "</answer>"}},
            "generation.stop_strings: expected a list, got '</answer>'",
        ),
        ({"sampling": 5}, "sampling: expected a mapping, got 5"),
    ],
)
def test_errors_from_dicts(raw, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_non_mapping_input():
    with pytest.raises(ConfigError, match="^config must be a mapping of sections, got list$"):
        config_from_dict([1, 2])  # type: ignore[arg-type]


def test_config_command_prints_the_installed_default_config_with_its_comments(tmp_path, capsys):
    """`entropy-probe config --show` prints default.yaml as installed, comments included; saved, it loads to the
    defaults. `--path` prints where it lies; `config demo` the demo's; an unknown name is one line, exit 2."""
    from entropy_experiments import cli
    from tests.run_helpers import logging_restored

    with logging_restored():
        _config_command_checks(cli, tmp_path, capsys)


def _config_command_checks(cli, tmp_path: Path, capsys) -> None:
    assert cli.main(["config", "--show"]) == 0
    shown = capsys.readouterr().out
    assert "# Every configuration key" in shown and "  pool_size: null" in shown
    assert load_config(_write(tmp_path, shown), []) == ProbeConfig()
    assert cli.main(["config"]) == 0 and capsys.readouterr().out == shown  # --show is what it does anyway
    assert cli.main(["config", "--path"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == packaged_config_path("default") and path.read_text(encoding="utf-8") == shown
    assert cli.main(["config", "demo"]) == 0
    assert capsys.readouterr().out == packaged_config_path("demo").read_text(encoding="utf-8")
    assert cli.main(["config", "nope"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: no packaged config 'nope'; available: default, demo"]
