"""pydantic validation errors -> one-line `ConfigError` naming the dotted key and the bad value."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from entropy_experiments.errors import ConfigError, closest_match

from .probe_config import ProbeConfig
from .sections import section_type


def show_value(value: Any) -> str:
    """A value as the user wrote it in YAML (strings quoted), cut to a readable length."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None:
        text = "null"
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_EXPECTED = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "model_type": "expected a mapping",
    "dict_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "finite_number": "must be a finite number",
}
_BOUNDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def _dotted(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _section_model(loc: tuple) -> type[BaseModel] | None:
    """The model class that holds the key at `loc` (ProbeConfig for a top-level key)."""
    model: type[BaseModel] | None = ProbeConfig
    for part in loc[:-1]:
        model = section_type(model, part) if isinstance(part, str) else None
        if model is None:
            return None
    return model


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key path of `model`, sections included."""
    keys = []
    for name in model.model_fields:
        keys.append(prefix + name)
        sub = section_type(model, name)
        if sub is not None:
            keys.extend(_all_keys(sub, prefix + name + "."))
    return keys


def _unknown_key_message(loc: tuple) -> str:
    path = _dotted(loc)
    model = _section_model(loc)
    prefix = path[: -len(str(loc[-1]))]
    valid = list(model.model_fields) if model is not None else []
    hint = closest_match(str(loc[-1]), valid)
    if hint is not None:
        return f"unknown key '{path}' (did you mean '{prefix}{hint}'?)"
    # The right key in the wrong section is a common slip: point at where it lives.
    elsewhere = [k for k in _all_keys(ProbeConfig) if k.rsplit(".", 1)[-1] == str(loc[-1])]
    if elsewhere:
        return f"unknown key '{path}' (did you mean '{elsewhere[0]}'?)"
    return f"unknown key '{path}' (valid keys: {', '.join(valid)})"


def unknown_key_problem(dotted: str) -> str | None:
    """`--set`'s message for a dotted key the config does not have ("unknown key … (did you mean …?)"); None for
    one it has. Every command-line option that names a config key says it in these words."""
    if dotted in _all_keys(ProbeConfig):
        return None
    return _unknown_key_message(tuple(dotted.split(".")))


def _error_message(err: dict[str, Any]) -> str:
    kind, loc, ctx = err["type"], tuple(err["loc"]), err.get("ctx") or {}
    path = _dotted(loc)
    if kind == "extra_forbidden":
        return _unknown_key_message(loc)
    if kind == "invalid_key":  # a non-string key such as `1:` can only be an unknown key
        return _unknown_key_message(loc[:-1] + (str(loc[-1]),))
    if kind in ("value_error", "assertion_error"):
        # Our validators write "<what>, got <value>"; a cross-section check names its own keys.
        reason = str(ctx.get("error", err["msg"]))
        return f"{path}: {reason}" if path else reason
    if kind in _BOUNDS:
        name, symbol = _BOUNDS[kind]
        reason = f"must be {symbol} {ctx[name]:g}"
    elif kind == "literal_error":
        reason = f"expected {ctx['expected']}"
    elif kind in ("too_short", "string_too_short"):
        reason = (
            "must not be empty" if ctx.get("min_length") == 1 else f"needs at least {ctx['min_length']} items"
        )
    else:
        reason = _EXPECTED.get(kind, err["msg"])
    return f"{path}: {reason}, got {show_value(err['input'])}"


def config_error(exc: ValidationError) -> ConfigError:
    errors = exc.errors()
    # An unknown key (often a typo) explains more than whatever else failed, so report it first.
    first = next((e for e in errors if e["type"] in ("extra_forbidden", "invalid_key")), errors[0])
    return ConfigError(_error_message(first))
