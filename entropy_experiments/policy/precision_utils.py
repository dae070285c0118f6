"""Precision profiles for the scoring paths (docs/maths.md §7).

The probe measures entropy changes of order 1e-6 per unit learning rate, so every scoring pass runs
with fp32 runtime parameters, autocast off, TF32 off, and (by default) the vocabulary-sized softmax
maths in float64. This module holds the typed profiles, the global torch switches and the forward
context used by both teacher-forcing paths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from entropy_experiments.errors import ConfigError, closest_match

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "float64": torch.float64, "fp64": torch.float64,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def str_to_dtype(name: str | torch.dtype, *, key: str = "dtype") -> torch.dtype:
    """'float32' | 'fp32' | 'bfloat16' | ... (or a torch.dtype) → torch.dtype; ConfigError naming `key` otherwise."""
    if isinstance(name, torch.dtype):
        return name
    dtype = _DTYPES.get(str(name).lower().removeprefix("torch."))
    if dtype is None:
        raise ConfigError(f"{key}: unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return dtype


@dataclass
class ForwardProfile:
    """One forward path's settings. `cast_params` is used by the override path, `cast_logits_fp32` by TF."""

    autocast: bool = False
    dtype: str = "float32"
    cast_params: bool = True
    cast_logits_fp32: bool = True


@dataclass
class PrecisionConfig:
    """The `precision` config section (keys as in config/sections.py); unknown keys are refused."""

    func_override: ForwardProfile = field(default_factory=ForwardProfile)
    tf_nograd: ForwardProfile = field(default_factory=ForwardProfile)
    tf_withgrad: ForwardProfile = field(default_factory=ForwardProfile)
    allow_tf32: bool = False
    matmul_precision: str = "highest"
    entropy_fp64: bool = True
    runtime_dtype: str = "fp32"
    token_chunk_size: int | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> PrecisionConfig:
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in known:
                hint = closest_match(key, known)
                raise ConfigError(f"unknown key 'precision.{key}'" + (f" (did you mean 'precision.{hint}'?)" if hint else ""))
            if key in ("func_override", "tf_nograd", "tf_withgrad"):
                kwargs[key] = _profile_from(value, f"precision.{key}")
            else:
                kwargs[key] = value
        cfg = cls(**kwargs)
        if cfg.matmul_precision not in ("highest", "high", "medium"):
            raise ConfigError(f"precision.matmul_precision: must be highest|high|medium, got {cfg.matmul_precision!r}")
        for name in ("func_override", "tf_nograd", "tf_withgrad"):
            str_to_dtype(getattr(cfg, name).dtype, key=f"precision.{name}.dtype")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _profile_from(value: Any, key: str) -> ForwardProfile:
    if isinstance(value, ForwardProfile):
        return value
    if hasattr(value, "model_dump"):  # a pydantic sub-model of ProbeConfig
        value = value.model_dump()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    known = {f.name for f in fields(ForwardProfile)}
    for k in value:
        if k not in known:
            hint = closest_match(k, known)
            raise ConfigError(f"unknown key '{key}.{k}'" + (f" (did you mean '{key}.{hint}'?)" if hint else ""))
    return ForwardProfile(**dict(value))


def apply_global_precision(cfg: PrecisionConfig | Mapping[str, Any]) -> None:
    """Set torch's process-wide matmul switches: TF32 on/off and float32 matmul precision.

    Note these are global to the process (torch offers no scoped version); TF32 only matters on
    Ampere+ GPUs, and 'highest' keeps CPU/GPU fp32 matmuls at full precision.
    """
    if not isinstance(cfg, PrecisionConfig):
        cfg = PrecisionConfig.from_dict(cfg)
    torch.backends.cuda.matmul.allow_tf32 = bool(cfg.allow_tf32)
    torch.backends.cudnn.allow_tf32 = bool(cfg.allow_tf32)
    torch.set_float32_matmul_precision(cfg.matmul_precision)


@contextlib.contextmanager
def forward_precision_ctx(autocast: bool, dtype: str | torch.dtype, device_type: str = "cpu") -> Iterator[None]:
    """Autocast to `dtype` when `autocast` is true; otherwise explicitly disable any enclosing autocast.

    Disabling (rather than doing nothing) matters: a caller's autocast region would otherwise leak
    bf16 matmuls into the scoring forward.
    """
    if autocast:
        with torch.autocast(device_type=device_type, dtype=str_to_dtype(dtype)):
            yield
    else:
        with torch.autocast(device_type=device_type, enabled=False):
            yield
