"""The original (seed) API's `model_loader` names: base model, adapter, AdamW state, save_checkpoint,
dtype / device, the embedded SmolLM2 and its cache.

Each name is the function or constant of `entropy_experiments.checkpoint` / `entropy_experiments.models.embedded`
that now does the work; `entropy_experiments.model_loader` (the legacy import path) re-exports this list.
"""

from ..checkpoint.adapter import create_lora_model, load_peft_for_probe
from ..checkpoint.base_model import load_tokenizer, resolve_base_model
from ..checkpoint.dtype_device import resolve_device, resolve_dtype
from ..checkpoint.layout import ADAPTER_SUBDIR, CHECKPOINT_META_FILE, OPTIMIZER_FILE, PARAM_NAMES_FILE
from ..checkpoint.optimizer_state import (
    fresh_adam_optimizer,
    load_adam_optimizer_from_path,
    trainable_named_parameters,
)
from ..checkpoint.writer import save_checkpoint
from ..models.embedded import (
    CACHE_ENV_VAR,
    EMBEDDED_MODEL_NAME,
    cache_root,
    embedded_model_dir,
    ensure_embedded_model,
    find_embedded_gguf,
)

__all__ = [
    "ADAPTER_SUBDIR", "CACHE_ENV_VAR", "CHECKPOINT_META_FILE", "EMBEDDED_MODEL_NAME", "OPTIMIZER_FILE",
    "PARAM_NAMES_FILE", "cache_root", "create_lora_model", "embedded_model_dir", "ensure_embedded_model",
    "find_embedded_gguf", "fresh_adam_optimizer", "load_adam_optimizer_from_path", "load_peft_for_probe",
    "load_tokenizer", "resolve_base_model", "resolve_device", "resolve_dtype", "save_checkpoint",
    "trainable_named_parameters",
]
