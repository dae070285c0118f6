"""The base model: which one (config or adapter_config.json), where it is loaded from, and loading it.

`resolve_base_model_id` picks the id (`checkpoint.base_model`, else the adapter's recorded
`base_model_name_or_path`, a mismatch being a warning); `resolve_base_model` turns the embedded name
`smollm2-135m-instruct` into its converted local copy, passes local directories through and treats
anything else as a hub id; `load_base_model` / `load_tokenizer` load it with one-line `CheckpointError`s.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..library_noise import quiet_library_loading
from ..models.embedded import EMBEDDED_MODEL_NAME, embedded_model_dir, ensure_embedded_model
from .file_names import ADAPTER_CONFIG_FILE
from .messages import first_line

__all__ = ["BaseModelChoice", "load_base_model", "load_tokenizer", "resolve_base_model", "resolve_base_model_id",
           "same_base_model"]


@dataclass(frozen=True)
class BaseModelChoice:
    """The base model to load, where that choice came from, and a mismatch warning (or None)."""

    name: str
    source: str
    warning: str | None = None


def _adapter_recorded_base(adapter_dir: Path) -> str | None:
    path = adapter_dir / ADAPTER_CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {' '.join(str(exc).split())}") from exc
    recorded = data.get("base_model_name_or_path") if isinstance(data, dict) else None
    return recorded if isinstance(recorded, str) and recorded.strip() else None


def _canonical_base(name: str) -> str:
    """The embedded name and local directories as resolved paths; hub ids as written."""
    text = str(name).strip()
    if text.lower() == EMBEDDED_MODEL_NAME:
        return str(embedded_model_dir().expanduser().resolve())
    local = Path(text).expanduser()
    return str(local.resolve()) if local.is_dir() else text.rstrip("/")


def same_base_model(a: str, b: str) -> bool:
    """Whether two base model names name the same model (local directories compared as resolved paths)."""
    return _canonical_base(a) == _canonical_base(b)


def resolve_base_model_id(config_base_model: str | None, adapter_dir: Path | None) -> BaseModelChoice:
    """`checkpoint.base_model` if set (warning when it differs from the adapter's record), else the
    adapter_config.json `base_model_name_or_path`; with no adapter at all, the embedded model."""
    if adapter_dir is None:
        if config_base_model is None:
            return BaseModelChoice(EMBEDDED_MODEL_NAME, "default (the embedded model; no checkpoint)")
        return BaseModelChoice(config_base_model, "checkpoint.base_model")
    recorded = _adapter_recorded_base(adapter_dir)
    where = adapter_dir / ADAPTER_CONFIG_FILE
    if config_base_model is None:
        if recorded is None:
            raise CheckpointError(f"{where} names no base_model_name_or_path: set checkpoint.base_model")
        return BaseModelChoice(recorded, f"{where} base_model_name_or_path")
    warning = None
    if recorded is not None and _canonical_base(config_base_model) != _canonical_base(recorded):
        warning = (f"checkpoint.base_model {config_base_model!r} differs from the adapter's base model "
                   f"{recorded!r} ({where} base_model_name_or_path): the adapter may be measured on a base "
                   "it was not trained on")
    return BaseModelChoice(config_base_model, "checkpoint.base_model", warning)


def resolve_base_model(base_id: str) -> str:
    """Map a base-model id to what `from_pretrained` should load.

    The embedded name → the converted cache directory (converted on first use); an existing local
    directory → itself; anything else is returned unchanged as a hub id (which may fail offline).
    """
    if str(base_id).strip().lower() == EMBEDDED_MODEL_NAME:
        return str(ensure_embedded_model())
    local = Path(str(base_id)).expanduser()
    if local.is_dir():
        return str(local)
    return str(base_id)


@contextlib.contextmanager
def _base_load_errors(base_id: str, resolved: str) -> Iterator[None]:
    """Translate transformers' loading failures into one-line CheckpointErrors naming the base."""
    try:
        yield
    except (ValueError, OSError) as exc:
        message = str(exc)
        if "trust_remote_code" in message:
            raise CheckpointError(
                f"base model {base_id!r} needs custom code from its repository: set "
                "`checkpoint.trust_remote_code: true` if you trust it") from exc
        if Path(resolved).is_dir():
            raise CheckpointError(
                f"base model {base_id!r}: cannot load {resolved}: {first_line(exc)}") from exc
        raise CheckpointError(
            f"base model {base_id!r} is not a local directory and could not be loaded from the hub "
            f"(offline?): {first_line(exc)}") from exc


def load_tokenizer(base_id: str, *, trust_remote_code: bool = False):
    """Tokenizer of the base model with left padding; pad = eos when it has no pad token."""
    from transformers import AutoTokenizer

    resolved = resolve_base_model(base_id)
    with _base_load_errors(base_id, resolved):
        tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    # Generation batches prompts: left padding keeps every prompt's last token at the same position.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(base_id: str, *, torch_dtype: torch.dtype, device: str, trust_remote_code: bool,
                     quantization_config: Any = None) -> torch.nn.Module:
    """AutoModelForCausalLM with eager attention (needed for forward-mode AD / double backward)."""
    from transformers import AutoModelForCausalLM

    resolved = resolve_base_model(base_id)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": "eager", "device_map": device,
                              "trust_remote_code": trust_remote_code}
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    with _base_load_errors(base_id, resolved), quiet_library_loading():
        return AutoModelForCausalLM.from_pretrained(resolved, **kwargs)



