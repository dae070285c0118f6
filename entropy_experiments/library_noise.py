"""Library noise kept out of a run's output: `quiet_library_loading` (used around model loading and the
embedded model's one-time conversion), `quiet_gguf_conversion` and `quiet_source_compilation` (around
the first import of a dependency that warns when compiled)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_library_loading() -> Iterator[None]:
    """Without transformers' weight-loading progress bars, and without the FutureWarning peft raises by
    reading transformers' deprecated `is_gradient_checkpointing` (library noise, nothing the user can act
    on), so that a run's output is the probe's. Every other warning passes."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def quiet_gguf_conversion() -> Iterator[None]:
    """Without the "Converting and de-quantizing GGUF tensors" bar: transformers' GGUF reader calls plain
    `tqdm` (not its own switchable one), so its module's `tqdm` is swapped for a disabled one meanwhile."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


@contextlib.contextmanager
def quiet_source_compilation() -> Iterator[None]:
    """No SyntaxWarning from a dependency compiled for the first time inside the block (reasoning-gym's
    cellpylib compares with `is "recursive"`; pip hides such warnings when it precompiles, uv installs no
    bytecode, so the first import compiles and warns) — not ours to fix, and not the user's to read."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        yield


BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
BNB_KERNELS_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def quiet_bitsandbytes_kernels_notice() -> None:
    """Drop bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community … pip install kernels" line,
    logged at its import (which peft triggers) on every CPU with AVX512-BF16: a best-effort speed-up of CPU 4-bit
    matmuls the probe never runs (its QLoRA path is CUDA). Its other messages pass. Idempotent."""
    logger = logging.getLogger(BNB_CPU_LOGGER)
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage(BNB_KERNELS_NOTICE))
