"""`entropy-probe make-checkpoint`: a real LoRA adapter and AdamW state from a few Dr-GRPO steps (`trained.py`), on
the embedded model or on a random model of a real architecture (`synthetic.py`)."""

from .trained import DEMO_CHECKPOINT_STEPS, ensure_demo_checkpoint, make_checkpoint

__all__ = ["DEMO_CHECKPOINT_STEPS", "ensure_demo_checkpoint", "make_checkpoint"]
