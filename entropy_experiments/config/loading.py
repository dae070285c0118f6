"""Reading configs: YAML files, `--set key=value` overrides, legacy key aliases, packaged configs.

YAML is read with PyYAML's safe loader, patched so that `1e-5` is a float as in YAML 1.2 (plain
PyYAML follows YAML 1.1 and reads `1e-5` as the *string* "1e-5", a classic trap for learning rates).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from entropy_experiments.errors import ConfigError, closest_match

from .messages import config_error, show_value
from .probe_config import ProbeConfig
from .sections import section_type

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"

# Legacy keys still accepted in user configs. Old dotted key -> canonical dotted key; None means
# "accepted and dropped" (generation.do_sample must be true: the probe always samples;
# generation.num_return_sequences is superseded by batch_config.G and by G = 1 on E).
# `probe_rework:` and the seed code's `sampling:` are other spellings of the `sampler:` section, kept so that
# configs written for them still load.
LEGACY_KEYS: dict[str, str | None] = {
    "checkpoint.model_config_path": "checkpoint.base_model",
    "probe_rework.use_sequence_processor_sampling": "sampler.batched",
    "sampling.use_sequence_processor": "sampler.batched",
    "generation.do_sample": None,
    "generation.num_return_sequences": None,
    "estimator.max_grad_norm": "objective.max_grad_norm",
}


# ----------------------------------------------------------------------------------------------
# YAML reading
# ----------------------------------------------------------------------------------------------


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (`1e-5`) and an error on duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges may legitimately repeat keys
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable key; the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)


# Copy the resolver table before adding to it, so that yaml.SafeLoader itself is left untouched.
_YamlLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)


def _yaml_error_detail(exc: yaml.YAMLError) -> str:
    """`line N: problem` from a PyYAML error, on one line."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def _read_yaml_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    try:
        data = _yaml_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML ({_yaml_error_detail(exc)})") from None
    if data is None:  # an empty file means "all defaults"
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------------------------
# Overrides and legacy keys (operate on the raw dict before validation)
# ----------------------------------------------------------------------------------------------

_OVERRIDE_RE = re.compile(r"\s*([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\s*=(.*)", re.DOTALL)


def _apply_override(raw: dict[str, Any], spec: str) -> None:
    """Set one `section.key=value` (value parsed as YAML) in `raw`, in place."""
    match = _OVERRIDE_RE.fullmatch(spec) if isinstance(spec, str) else None
    if match is None:
        raise ConfigError(f"--set expects section.key=value, got {spec!r}")
    key, text = match.group(1), match.group(2)
    try:
        value = _yaml_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"--set {key}: value is not valid YAML ({_yaml_error_detail(exc)}), got {text!r}"
        ) from None
    # An override names the canonical key or a legacy one; either way it replaces both spellings in
    # the file, so that `--set checkpoint.base_model=X` wins over a file's `model_config_path`.
    canonical = LEGACY_KEYS.get(key) or key  # a dropped legacy key stays as is, so its check still runs
    for old, new in LEGACY_KEYS.items():
        if new == canonical or old == key:
            _pop_path(raw, old)
    *parents, leaf = canonical.split(".")
    node, model = raw, ProbeConfig
    for i, part in enumerate(parents):
        child = node.get(part)
        known_scalar = model is not None and part in model.model_fields and section_type(model, part) is None
        if known_scalar or (child is not None and not isinstance(child, dict)):
            raise ConfigError(f"--set {spec.strip()}: '{'.'.join(parents[: i + 1])}' is not a section")
        if child is None:  # unknown names are created here and reported by validation
            child = node[part] = {}
        node, model = child, (section_type(model, part) if model is not None else None)
    node[leaf] = value


def _pop_path(raw: dict[str, Any], dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    node: Any = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(leaf, None)


def _resolve_legacy_keys(raw: dict[str, Any]) -> None:
    """Map legacy keys (`LEGACY_KEYS`) onto canonical ones in place; error on conflicting values."""
    given_as: dict[str, str] = {}  # canonical key -> the legacy key that set it (for the conflict message)
    for old, new in LEGACY_KEYS.items():
        old_section, old_key = old.split(".")
        section = raw.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        value = section.pop(old_key)
        if new is None:
            if old == "generation.do_sample" and value is not True:
                raise ConfigError(
                    f"generation.do_sample: the probe always samples, must be true, got {show_value(value)}"
                )
            continue
        new_section, new_key = new.split(".")
        target = raw.get(new_section)
        if target is None:
            target = raw[new_section] = {}
        if not isinstance(target, dict):
            continue  # validation reports "expected a mapping"
        if new_key in target and target[new_key] != value:
            raise ConfigError(f"{old} ({show_value(value)}) conflicts with {given_as.get(new, new)} "
                              f"({show_value(target[new_key])}); give only {new}")
        target[new_key] = value
        given_as.setdefault(new, old)

    # Sections that exist only in legacy configs (`sampling`, `probe_rework`) must be empty once their keys moved.
    for section_name in sorted({old.split(".")[0] for old in LEGACY_KEYS} - set(ProbeConfig.model_fields)):
        if section_name not in raw:
            continue
        leftover = raw.pop(section_name)
        if leftover is None or leftover == {}:
            continue
        known = [old.split(".")[1] for old in LEGACY_KEYS if old.startswith(section_name + ".")]
        if not isinstance(leftover, dict):
            raise ConfigError(f"{section_name}: expected a mapping, got {show_value(leftover)}")
        bad = str(next(iter(leftover)))
        hint = closest_match(bad, known)
        raise ConfigError(
            f"unknown key '{section_name}.{bad}'"
            + (f" (did you mean '{section_name}.{hint}'?)" if hint else f" (valid keys: {', '.join(known)})")
        )


def _fill_empty_sections(raw: dict[str, Any], model: type[BaseModel]) -> None:
    """Treat `section:` with nothing under it (YAML null) as an empty section, recursively."""
    for name in model.model_fields:
        sub = section_type(model, name)
        if sub is None or name not in raw:
            continue
        if raw[name] is None:
            raw[name] = {}
        if isinstance(raw[name], dict):
            _fill_empty_sections(raw[name], sub)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def config_from_dict(d: dict[str, Any]) -> ProbeConfig:
    """Validate a raw config mapping (legacy keys allowed) into a ProbeConfig. `d` is not modified."""
    if not isinstance(d, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(d).__name__}")
    raw = copy.deepcopy(d)
    _resolve_legacy_keys(raw)
    _fill_empty_sections(raw, ProbeConfig)
    try:
        return ProbeConfig.model_validate(raw)
    except ValidationError as exc:
        raise config_error(exc) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ProbeConfig:
    """Read a YAML config (None: all defaults), apply `section.key=value` overrides, validate.

    Override values are YAML: `generation.top_p=0.9`, `importance.eta_list=[1e-5, 2e-5]`,
    `precision.tf_nograd.autocast=false`, `learning_rate=1e-5`.
    """
    raw = {} if path is None else _read_yaml_file(Path(path))
    for spec in overrides or []:
        _apply_override(raw, spec)
    return config_from_dict(raw)


def packaged_config_path(name: str) -> Path:
    """Path of a config shipped with the package: entropy_experiments/configs/<name>.yaml."""
    stem = name.removesuffix(".yaml")
    path = CONFIGS_DIR / f"{stem}.yaml"
    if not path.is_file():
        available = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
        hint = closest_match(stem, available)
        raise ConfigError(
            f"no packaged config '{name}'"
            + (f" (did you mean '{hint}'?)" if hint else "")
            + f"; available: {', '.join(available)}"
        )
    return path
