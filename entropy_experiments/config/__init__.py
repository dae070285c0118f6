"""Typed, validated probe configuration.

A config is a YAML mapping of sections (`checkpoint`, `batch_config`, `generation`, ...) plus two
top-level scalars (`seed`, `learning_rate`). `load_config` reads it, applies `--set key=value`
overrides, maps the legacy key names onto the canonical ones (`LEGACY_KEYS`) and validates it into
a `ProbeConfig`: a tree of pydantic models with attribute access (`cfg.batch_config.B_E`).

Validation is strict (no silent "64" -> 64 or true -> 1 coercions; an int is accepted where a float
is expected) and every failure is raised as ONE-line `ConfigError` naming the dotted key and the bad
value, e.g. ``batch_config.B_E: expected an integer, got 'abc'``.

YAML is read with PyYAML's safe loader, patched so that `1e-5` is a float as in YAML 1.2 (plain
PyYAML follows YAML 1.1 and reads `1e-5` as the *string* "1e-5", a classic trap for learning rates).
"""

from .loading import CONFIGS_DIR as CONFIGS_DIR  # importable, not in __all__ (an internal path)
from .loading import LEGACY_KEYS, config_from_dict, load_config, packaged_config_path
from .probe_config import ProbeConfig
from .sections import (
    BatchSection,
    CheckpointSection,
    DistributedSection,
    EstimatorSection,
    FuncOverrideProfile,
    GenerationSection,
    ImportanceSection,
    ObjectiveSection,
    OutputSection,
    PrecisionSection,
    PredictorsSection,
    RewardSection,
    SamplerSection,
    SecondOrderSection,
    TeacherForcingProfile,
    VarianceSection,
)
from .what_if_section import WhatIfSection

__all__ = [
    "LEGACY_KEYS",
    "BatchSection",
    "CheckpointSection",
    "DistributedSection",
    "EstimatorSection",
    "FuncOverrideProfile",
    "GenerationSection",
    "ImportanceSection",
    "ObjectiveSection",
    "OutputSection",
    "PrecisionSection",
    "PredictorsSection",
    "ProbeConfig",
    "RewardSection",
    "SamplerSection",
    "SecondOrderSection",
    "TeacherForcingProfile",
    "VarianceSection",
    "WhatIfSection",
    "config_from_dict",
    "load_config",
    "packaged_config_path",
]
