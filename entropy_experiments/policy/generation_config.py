"""The `generation` settings (GenerationConfig) and reading them out of the probe's config.

`parse_config` accepts a GenerationConfig, a dict with sections {"generation", "precision"} (+ optional
"reward": {"name"}, "batch_config": {"dataset_path", "pool_size"}) or a ProbeConfig, and returns the
validated settings, the precision profile, the reward spec and the batch_config dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from entropy_experiments.errors import ConfigError, closest_match
from entropy_experiments.policy.precision_utils import PrecisionConfig
from entropy_experiments.policy.sampling_policy import validate_policy

__all__ = ["GenerationConfig", "as_plain_dict", "parse_config"]


@dataclass
class GenerationConfig:
    """Sampling and scoring settings (the config's `generation` section). Sampling never applies top-k."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 200
    do_sample: bool = True
    num_return_sequences: int = 8
    gen_batch_size: int = 32
    tf_batch_size: int = 8
    rb_requires_grad: bool = False
    pad_token_id: int | None = None          # None ⇒ the tokenizer's pad (else its EOS)
    eos_token_id: int | list[int] | None = None  # None ⇒ tokenizer EOS ∪ the model's generation_config EOS
    stop_strings: list[str] = field(default_factory=lambda: ["</answer>"])
    token_chunk_size: int = 256
    max_prompt_tokens: int | None = None     # None ⇒ max_position_embeddings − max_new_tokens
    prompt_overflow: str = "error"           # "error" | "truncate" (keep the last max_prompt_tokens)

    def validate(self) -> None:
        validate_policy(self.temperature, self.top_p)
        if not self.do_sample:
            raise ConfigError("generation.do_sample: must be true (the probe measures the sampling policy)")
        for key in ("max_new_tokens", "gen_batch_size", "tf_batch_size", "token_chunk_size"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"generation.{key}: must be >= 1, got {getattr(self, key)!r}")
        if self.prompt_overflow not in ("error", "truncate"):
            raise ConfigError(f"generation.prompt_overflow: must be 'error' or 'truncate', got {self.prompt_overflow!r}")
        if self.max_prompt_tokens is not None and int(self.max_prompt_tokens) < 1:
            raise ConfigError(f"generation.max_prompt_tokens: must be >= 1, got {self.max_prompt_tokens!r}")
        if isinstance(self.stop_strings, str) or any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ConfigError(f"generation.stop_strings: must be a list of non-empty strings, got {self.stop_strings!r}")



_GEN_FIELDS = {f.name for f in dataclasses.fields(GenerationConfig)}


def as_plain_dict(config: Any) -> dict[str, Any]:
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if hasattr(config, "model_dump"):
        return dict(config.model_dump())
    if isinstance(config, Mapping):
        return dict(config)
    raise ConfigError(f"SequenceProcessor config: expected GenerationConfig, dict or ProbeConfig, got {type(config).__name__}")


def parse_config(config: Any) -> tuple[GenerationConfig, PrecisionConfig, str, dict[str, Any]]:
    """→ (generation, precision, reward spec, batch_config dict)."""
    if config is None:
        config = GenerationConfig()
    if isinstance(config, GenerationConfig):
        gen, prec, reward, batch = dataclasses.replace(config), PrecisionConfig(), "tag_pref", {}
    else:
        d = as_plain_dict(config)
        gen_d = dict(d.get("generation") or {})
        for key in gen_d:
            if key not in _GEN_FIELDS:
                hint = closest_match(key, _GEN_FIELDS)
                raise ConfigError(f"unknown key 'generation.{key}'" + (f" (did you mean 'generation.{hint}'?)" if hint else ""))
        gen = GenerationConfig(**gen_d)
        prec = PrecisionConfig.from_dict(d.get("precision"))
        reward = str((d.get("reward") or {}).get("name", "tag_pref"))
        batch = dict(d.get("batch_config") or {})
    if prec.token_chunk_size is not None:  # the probe config keeps the chunk size under `precision`
        gen.token_chunk_size = int(prec.token_chunk_size)
    gen.stop_strings = list(gen.stop_strings or [])
    gen.validate()
    return gen, prec, reward, batch
