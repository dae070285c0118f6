"""The `generation` settings (GenerationConfig) and reading them out of the probe's config.

`parse_settings` accepts a GenerationConfig, a dict with sections {"generation", "precision"} or a
ProbeConfig, and returns the validated `PolicySettings` (generation + precision) the policy engine is
built with; `parse_config` (the seed façade's reader) also returns the reward spec and batch_config dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from entropy_experiments.errors import ConfigError, closest_match
from entropy_experiments.policy.precision_utils import PrecisionConfig
from entropy_experiments.policy.sampling_policy import validate_policy

SAMPLER_DTYPES = ("auto", "fp32", "bf16")
SAMPLER_ENGINES = ("generate", "static_cache", "continuous_batching")

__all__ = ["SAMPLER_DTYPES", "SAMPLER_ENGINES", "GenerationConfig", "PolicySettings", "as_plain_dict", "check_engine_policy", "parse_config", "parse_settings"]


@dataclass
class GenerationConfig:
    """Sampling and scoring settings (the config's `generation` section). Sampling never applies top-k.

    The one definition of the generation defaults: the config schema's `generation` section
    (config/sections.py) takes its defaults from here."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    do_sample: bool = True
    num_return_sequences: int = 8
    gen_batch_size: int | str = "auto"      # rows per generate call; "auto": from memory (CUDA) / 16 (CPU)
    tf_batch_size: int = 8
    rb_requires_grad: bool = True
    pad_token_id: int | None = None          # None ⇒ the tokenizer's pad (else its EOS)
    eos_token_id: int | list[int] | None = None  # None ⇒ tokenizer EOS ∪ the model's generation_config EOS
    stop_strings: list[str] = field(default_factory=lambda: ["</answer>"])
    token_chunk_size: int = 256
    max_prompt_tokens: int | None = None     # None ⇒ max_position_embeddings − max_new_tokens
    prompt_overflow: str = "error"           # "error" | "truncate" (keep the last max_prompt_tokens)
    sampler_dtype: str = "auto"              # "auto" (bf16 on CUDA, fp32 on CPU) | "fp32" | "bf16"
    sampler_engine: str = "generate"         # "generate" (dynamic KV cache) | "static_cache" | "continuous_batching"

    def validate(self) -> None:
        validate_policy(self.temperature, self.top_p)
        if not self.do_sample:
            raise ConfigError("generation.do_sample: must be true (the probe measures the sampling policy)")
        if self.gen_batch_size != "auto" and (isinstance(self.gen_batch_size, bool)
                                               or not isinstance(self.gen_batch_size, int)):
            raise ConfigError(f"generation.gen_batch_size: must be an integer >= 1 or 'auto', "
                              f"got {self.gen_batch_size!r}")
        if self.sampler_dtype not in SAMPLER_DTYPES:
            raise ConfigError(f"generation.sampler_dtype: must be one of {', '.join(SAMPLER_DTYPES)}, "
                              f"got {self.sampler_dtype!r}")
        if self.sampler_engine not in SAMPLER_ENGINES:
            raise ConfigError(f"generation.sampler_engine: must be one of {', '.join(SAMPLER_ENGINES)}, "
                              f"got {self.sampler_engine!r}")
        check_engine_policy(self.sampler_engine, self.top_p)
        for key in ("max_new_tokens", "gen_batch_size", "tf_batch_size", "token_chunk_size"):
            if getattr(self, key) != "auto" and int(getattr(self, key)) < 1:
                raise ConfigError(f"generation.{key}: must be >= 1, got {getattr(self, key)!r}")
        if self.prompt_overflow not in ("error", "truncate"):
            raise ConfigError(f"generation.prompt_overflow: must be 'error' or 'truncate', got {self.prompt_overflow!r}")
        if self.max_prompt_tokens is not None and int(self.max_prompt_tokens) < 1:
            raise ConfigError(f"generation.max_prompt_tokens: must be >= 1, got {self.max_prompt_tokens!r}")
        if isinstance(self.stop_strings, str) or any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ConfigError(f"generation.stop_strings: must be a list of non-empty strings, got {self.stop_strings!r}")


def check_engine_policy(engine: str, top_p: float) -> None:
    """ConfigError for top_p < 1 with the continuous-batching engine: its nucleus rule is not the probe's
    (it differs on ties and at the crossing token), so its samples would not come from a known q_sampler."""
    if engine == "continuous_batching" and top_p < 1.0:
        raise ConfigError(f"generation.top_p: {top_p!r} needs the probe's nucleus rule, which "
                          "generation.sampler_engine: continuous_batching does not apply (its top-p differs on ties "
                          "and at the crossing token); use top_p: 1.0 or sampler_engine: generate")


_GEN_FIELDS = {f.name for f in dataclasses.fields(GenerationConfig)}


def as_plain_dict(config: Any) -> dict[str, Any]:
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if hasattr(config, "model_dump"):
        return dict(config.model_dump())
    if isinstance(config, Mapping):
        return dict(config)
    raise ConfigError(f"policy settings: expected GenerationConfig, dict or ProbeConfig, got {type(config).__name__}")


@dataclass(frozen=True)
class PolicySettings:
    """What the policy engine is built with: the sampling / scoring settings and the precision profile."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)


def parse_settings(config: Any) -> PolicySettings:
    """The validated generation settings and precision profile of a GenerationConfig, PolicySettings, a dict
    with sections {"generation", "precision"} or a ProbeConfig (None: the defaults)."""
    if config is None:
        config = GenerationConfig()
    if isinstance(config, PolicySettings):
        gen, prec = dataclasses.replace(config.generation), config.precision
    elif isinstance(config, GenerationConfig):
        gen, prec = dataclasses.replace(config), PrecisionConfig()
    else:
        d = as_plain_dict(config)
        gen_d = dict(d.get("generation") or {})
        for key in gen_d:
            if key not in _GEN_FIELDS:
                hint = closest_match(key, _GEN_FIELDS)
                raise ConfigError(f"unknown key 'generation.{key}'" + (f" (did you mean 'generation.{hint}'?)" if hint else ""))
        gen = GenerationConfig(**gen_d)
        prec = PrecisionConfig.from_dict(d.get("precision"))
    if prec.token_chunk_size is not None:  # the probe config keeps the chunk size under `precision`
        gen.token_chunk_size = int(prec.token_chunk_size)
    gen.stop_strings = list(gen.stop_strings or [])
    gen.validate()
    return PolicySettings(gen, prec)


def parse_config(config: Any) -> tuple[GenerationConfig, PrecisionConfig, str, dict[str, Any]]:
    """→ (generation, precision, reward spec, batch_config dict): `parse_settings` plus the sections the seed
    façade's prompt and reward conveniences read."""
    settings = parse_settings(config)
    if config is None or isinstance(config, (GenerationConfig, PolicySettings)):
        return settings.generation, settings.precision, "tag_pref", {}
    d = as_plain_dict(config)
    reward = str((d.get("reward") or {}).get("name", "tag_pref"))
    return settings.generation, settings.precision, reward, dict(d.get("batch_config") or {})
