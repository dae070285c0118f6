"""Legacy import path of the original (seed) API: `entropy_experiments.model_loader`.

A thin re-export of `entropy_experiments.compat.model_loader`. New code imports from `entropy_experiments.checkpoint`
(base model, adapter, AdamW state, save_checkpoint, dtype / device) and `entropy_experiments.models.embedded`
(the embedded SmolLM2 and its cache).
"""

from .compat.model_loader import *  # every legacy name: the list is compat.model_loader.__all__
from .compat.model_loader import __all__  # noqa: F401
