"""The original (seed 001) API's `model_loader`: `load_peft_for_probe` and `load_adam_optimizer_from_path`.

Each name is the function of `entropy_experiments.checkpoint` that does the work (same keywords), so that the
seed's code runs unchanged;
`entropy_experiments.model_loader` (the legacy import path) re-exports this list.
"""

from ..checkpoint.adapter import load_peft_for_probe
from ..checkpoint.optimizer_state import load_adam_optimizer_from_path

__all__ = ["load_adam_optimizer_from_path", "load_peft_for_probe"]
