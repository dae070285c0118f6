"""Getting a checkpoint off disk correctly: its files, the base model, the adapter, the AdamW state, the lr.

* `file_names`: the names of a checkpoint's files;
* `layout`: which files a checkpoint is made of (own / Trainer / adapter + parent optimizer / ...);
* `base_model`: which base model (config or adapter_config.json) and loading it and its tokenizer;
* `dtype_device`: `checkpoint.dtype` and `checkpoint.device_map`;
* `adapter`: base + LoRA adapter for the probe (`load_peft_for_probe`), a fresh adapter;
* `optimizer_mapping`: which saved optimizer entry belongs to which parameter;
* `optimizer_state`: the saved AdamW state loaded onto the model (`load_adam_optimizer_from_path`);
* `learning_rate`: the lr of δH₁ and its provenance;
* `writer`: `save_checkpoint` (this project's layout).

The public names of the submodules are re-exported here.
"""

from .adapter import create_lora_model, load_peft_for_probe
from .base_model import (
    BaseModelChoice,
    load_base_model,
    load_tokenizer,
    resolve_base_model,
    resolve_base_model_id,
)
from .dtype_device import resolve_device, resolve_dtype
from .file_names import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_SUBDIR,
    CHECKPOINT_META_FILE,
    OPTIMIZER_FILE,
    PARAM_NAMES_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
)
from .layout import (
    CheckpointFiles,
    adapter_dir_of,
    checkpoint_info,
    log_checkpoint_files,
    resolve_checkpoint,
)
from .learning_rate import (
    LR_FROM_CONFIG,
    LR_FROM_OPTIMIZER,
    LearningRate,
    resolve_learning_rate,
    schedule_hint,
)
from .optimizer_state import fresh_adam_optimizer, load_adam_optimizer_from_path, trainable_named_parameters
from .writer import save_checkpoint

__all__ = [
    "ADAPTER_CONFIG_FILE", "ADAPTER_SUBDIR", "CHECKPOINT_META_FILE", "LR_FROM_CONFIG", "LR_FROM_OPTIMIZER",
    "OPTIMIZER_FILE", "PARAM_NAMES_FILE", "SCHEDULER_FILE", "TRAINER_STATE_FILE", "BaseModelChoice",
    "CheckpointFiles", "LearningRate", "adapter_dir_of", "checkpoint_info", "create_lora_model",
    "fresh_adam_optimizer", "load_adam_optimizer_from_path", "load_base_model", "load_peft_for_probe",
    "load_tokenizer", "log_checkpoint_files", "resolve_base_model", "resolve_base_model_id", "resolve_checkpoint",
    "resolve_device", "resolve_dtype", "resolve_learning_rate", "save_checkpoint", "schedule_hint",
    "trainable_named_parameters",
]
