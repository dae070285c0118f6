"""Legacy import path of the original (seed) API: `entropy_experiments.model_loader`.

A thin re-export of `entropy_experiments.compat.model_loader`. New code imports from `entropy_experiments.checkpoint`
(base model, adapter, AdamW state, save_checkpoint, dtype / device) and `entropy_experiments.models.embedded`
(the embedded SmolLM2 and its cache).
"""

from .compat.model_loader import (
    ADAPTER_SUBDIR,
    CACHE_ENV_VAR,
    CHECKPOINT_META_FILE,
    EMBEDDED_MODEL_NAME,
    OPTIMIZER_FILE,
    PARAM_NAMES_FILE,
    cache_root,
    create_lora_model,
    embedded_model_dir,
    ensure_embedded_model,
    find_embedded_gguf,
    fresh_adam_optimizer,
    load_adam_optimizer_from_path,
    load_peft_for_probe,
    load_tokenizer,
    resolve_base_model,
    resolve_device,
    resolve_dtype,
    save_checkpoint,
    trainable_named_parameters,
)

__all__ = [
    "ADAPTER_SUBDIR", "CACHE_ENV_VAR", "CHECKPOINT_META_FILE", "EMBEDDED_MODEL_NAME", "OPTIMIZER_FILE",
    "PARAM_NAMES_FILE", "cache_root", "create_lora_model", "embedded_model_dir", "ensure_embedded_model",
    "find_embedded_gguf", "fresh_adam_optimizer", "load_adam_optimizer_from_path", "load_peft_for_probe",
    "load_tokenizer", "resolve_base_model", "resolve_device", "resolve_dtype", "save_checkpoint",
    "trainable_named_parameters",
]
