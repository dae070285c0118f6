"""The policy's runtime precision (`precision.runtime_dtype`) and the guards around it (docs/maths.md §7, README "Scaling").

* fp32 (the default): every parameter in fp32, whatever `checkpoint.dtype` the base was stored or loaded in.
* bf16: the frozen base weights in bf16, the adapter (the trainable parameters) in fp32. θ + η·v is then formed
  in fp32 (policy/param_overrides.py), the logits are upcast and the entropy / log-prob maths stays in fp32 or
  fp64, but each layer's output — LoRA delta included — is rounded to bf16 (8 significant bits). Gradients
  (δH₁, its error bars) survive that rounding roughly (measured: δH₁ 19 % off, SE within 4 %; always noted in
  results.json); ΔH(η) at small η does not (a rounding floor): `bf16_delta_h_warnings` names those η.

`precision_refusal` is the guard for a model handed in directly (`run_probe(policy=...)`): it refuses a model
whose parameters do not match the declared runtime precision instead of silently quantising log-prob changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import ConfigError
from .learning_rate import resolve_learning_rate

__all__ = ["BF16_MIN_ETA_OVER_LR", "bf16_delta_h_warnings", "check_precision", "precision_refusal",
           "runtime_precision_warnings", "to_runtime_precision"]

# From the bf16-vs-fp32 measurement on the embedded model (bench/bench_precision.py, README "Scaling"): with a
# bf16 base, ΔH at η = lr/1000 was −0.10 nats (fp32: −2.5e-6) — a rounding floor — and ΔH at lr, 10·lr, 100·lr
# was off by 90×, 13× and 36 % of the fp32 value: no η ≤ 100·lr resolved the step. At 1000·lr the fp32 slope
# puts |ΔH| at ≈ 5× that floor; below it ΔH measures rounding (docs/maths.md §8's "ΔH flat in η" trap).
BF16_MIN_ETA_OVER_LR = 1000.0
# The same measurement: δH₁ moved by 19 % (0.08 SE at E = 8), SE_E by 4 %, SE_U by 1 %.
BF16_DELTA_H1_NOTE = ("precision.runtime_dtype bf16: δH₁ and its error bars are gradients through a bf16 forward; "
                      "on the embedded model δH₁ moved by 19 % against fp32 on the same samples (README \"Scaling\") "
                      "— compare with fp32 before relying on it below that precision")


def to_runtime_precision(model: nn.Module, runtime_dtype: str) -> nn.Module:
    """fp32: the whole model in fp32. bf16: frozen floating parameters in bf16, trainable ones in fp32."""
    if runtime_dtype == "fp32":
        return model.float()
    if runtime_dtype != "bf16":
        raise ConfigError(f"precision.runtime_dtype: {runtime_dtype!r} is not supported (use fp32 or bf16)")
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(torch.float32 if param.requires_grad else torch.bfloat16)
    return model


def precision_refusal(model: nn.Module, runtime_dtype: str) -> str | None:
    """Why `model` cannot be probed at `runtime_dtype` (None: it can). Trainable parameters must be fp32 in
    every mode (θ + η·v and the AdamW step would quantise); with fp32 the frozen ones must be too."""
    low = [(name, p) for name, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32]
    for name, param in low:
        if param.requires_grad:
            return (f"the policy's trainable parameter {name!r} is {param.dtype}: the adapter must be fp32 "
                    "(θ + η·v and the AdamW step would be rounded away); load it with the checkpoint loader "
                    "or cast the trainable parameters to fp32")
    if low and runtime_dtype == "fp32":
        name, param = low[0]
        return (f"the policy's parameter {name!r} is {param.dtype} but precision.runtime_dtype is fp32: "
                "log-prob differences would quantise; call model.float() or set precision.runtime_dtype: "
                f"bf16 (base in bf16, adapter in fp32; ΔH(η) then only at η ≥ {BF16_MIN_ETA_OVER_LR:g}·lr)")
    return None


def check_precision(model: nn.Module, runtime_dtype: str) -> None:
    """ConfigError (one line) when `precision_refusal` refuses `model`."""
    reason = precision_refusal(model, runtime_dtype)
    if reason is not None:
        raise ConfigError(reason)


def bf16_delta_h_warnings(runtime_dtype: str, etas: Sequence[float], lr: float) -> list[str]:
    """With a bf16 base, one warning per |η| below BF16_MIN_ETA_OVER_LR·lr (its ΔH is rounding, not signal)."""
    if runtime_dtype != "bf16" or lr <= 0:
        return []
    small = sorted({abs(float(eta)) for eta in etas if abs(float(eta)) < BF16_MIN_ETA_OVER_LR * lr})
    if not small:
        return []
    listed = ", ".join(f"{eta:.3g}" for eta in small)
    message = (f"precision.runtime_dtype bf16: ΔH(η) at η = {listed} (< {BF16_MIN_ETA_OVER_LR:g}·lr = "
               f"{BF16_MIN_ETA_OVER_LR * lr:.3g}) is below what a bf16 base resolves — it measures rounding, not "
               "the step (README \"Scaling\"); use η ≥ that, or runtime_dtype fp32, for ΔH")
    return [message]


def runtime_precision_warnings(model: nn.Module, config, optimizer) -> list[str]:
    """The probe's precision check of a loaded or handed-in policy: ConfigError when `precision_refusal`
    refuses it, else the bf16 ΔH warnings for the config's η grid at the lr of δH₁ (results.json)."""
    runtime_dtype = config.precision.runtime_dtype
    check_precision(model, runtime_dtype)
    if runtime_dtype == "fp32":
        return []
    if not config.importance.enabled or optimizer is None:
        return [BF16_DELTA_H1_NOTE]
    lr = resolve_learning_rate(config.learning_rate, optimizer.param_groups).value
    return [BF16_DELTA_H1_NOTE, *bf16_delta_h_warnings(runtime_dtype, config.importance.eta_list, lr)]
