"""Where and in which precision a model is loaded: `checkpoint.dtype` and `checkpoint.device_map`."""

from __future__ import annotations

import torch

from ..errors import ConfigError, DeviceError, closest_match

__all__ = ["resolve_device", "resolve_dtype"]

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}
_DEVICE_HINT = "use auto, cpu, cuda or cuda:N"


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"fp32" | "bf16" | "fp16"` (or the long torch names, or a torch.dtype) → torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise ConfigError(f"checkpoint.dtype: {dtype} is not supported (use fp32, bf16 or fp16)")
    key = str(dtype).lower()
    if key not in _DTYPES:
        hint = closest_match(key, list(_DTYPES))
        raise ConfigError(f"checkpoint.dtype: unknown dtype {dtype!r} (use fp32, bf16 or fp16)"
                          + (f"; did you mean {hint!r}?" if hint else ""))
    return _DTYPES[key]


def resolve_device(device_map: str = "auto") -> str:
    """`"auto" | "cpu" | "cuda" | "cuda:N"` → a concrete device string.

    "auto" is "cuda" when a GPU is visible and "cpu" otherwise; an explicit CUDA request without a
    usable GPU is a `DeviceError` rather than a silent CPU run.
    """
    spec = str(device_map).strip().lower()
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return "cpu"
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise DeviceError(
                f"checkpoint.device_map: {device_map!r} requested but no CUDA device is available")
        if spec != "cuda":
            index_text = spec.split(":", 1)[1]
            if not index_text.isdigit():
                raise ConfigError(f"checkpoint.device_map: {device_map!r} is not a device ({_DEVICE_HINT})")
            if int(index_text) >= torch.cuda.device_count():
                raise DeviceError(f"checkpoint.device_map: {device_map!r} requested but only "
                                  f"{torch.cuda.device_count()} CUDA device(s) are visible")
        return spec
    raise ConfigError(f"checkpoint.device_map: {device_map!r} is not a device ({_DEVICE_HINT})")
