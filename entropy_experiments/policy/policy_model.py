"""PolicyModel: the model, its tokenizer and the sampling settings that generation and scoring share.

It resolves, once, what every forward needs: the unwrapped module (DDP stripped, PEFT kept), the pad
id and the EOS ids of the stop rule, whether the forward accepts `logits_to_keep`, and the device.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from entropy_experiments.errors import ConfigError
from entropy_experiments.policy.generation_config import GenerationConfig
from entropy_experiments.policy.param_overrides import unwrap_model
from entropy_experiments.policy.precision_utils import PrecisionConfig

__all__ = ["PolicyModel", "hf_model_of", "resolve_special_ids"]


def hf_model_of(module: nn.Module) -> nn.Module:
    """The transformers model itself (inside a PEFT wrapper, if any)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def resolve_special_ids(config: GenerationConfig, tokenizer: Any, hf_model: nn.Module) -> tuple[int, list[int]]:
    """(pad id, EOS ids): the config's, else the tokenizer's EOS ∪ the model's generation_config EOS."""
    if config.eos_token_id is not None:
        eos = [config.eos_token_id] if isinstance(config.eos_token_id, int) else list(config.eos_token_id)
    else:
        eos = []
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.append(int(tokenizer.eos_token_id))
        model_eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
        for e in ([model_eos] if isinstance(model_eos, int) else list(model_eos or [])):
            if int(e) not in eos:
                eos.append(int(e))
    if not eos:
        raise ConfigError("the tokenizer has no EOS token and the model's generation_config names none: use a tokenizer with one (or set GenerationConfig.eos_token_id)")
    pad = config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else eos[0]
    return int(pad), [int(e) for e in eos]


def _forward_accepts(hf_model: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(hf_model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params


@dataclass
class PolicyModel:
    """What generation (`generate.py`) and scoring (`score.py`) need to know about the policy."""

    module: nn.Module                  # the model, DDP unwrapped (PEFT kept)
    tokenizer: Any
    config: GenerationConfig
    precision: PrecisionConfig
    pad_token_id: int
    eos_token_ids: list[int]
    supports_logits_to_keep: bool
    logger: logging.Logger
    warned: set[str] = field(default_factory=set)

    @classmethod
    def build(cls, model: nn.Module, tokenizer: Any, config: GenerationConfig, precision: PrecisionConfig,
              logger: logging.Logger) -> PolicyModel:
        module = unwrap_model(model)
        hf_model = hf_model_of(module)
        pad, eos = resolve_special_ids(config, tokenizer, hf_model)
        return cls(module=module, tokenizer=tokenizer, config=config, precision=precision, pad_token_id=pad,
                   eos_token_ids=eos, supports_logits_to_keep=_forward_accepts(hf_model, "logits_to_keep"),
                   logger=logger)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def hf_model(self) -> nn.Module:
        return hf_model_of(self.module)

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (used for the EOS-probability diagnostic)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            self.logger.warning(message)
