"""Typed, validated probe configuration.

A config is a YAML mapping of sections (`checkpoint`, `batch_config`, `generation`, ...) plus two
top-level scalars (`seed`, `learning_rate`). `load_config` reads it, applies `--set key=value`
overrides, maps the seed-era key names onto the canonical ones (`LEGACY_KEYS`) and validates it into
a `ProbeConfig`: a tree of pydantic models with attribute access (`cfg.batch_config.B_E`).

Validation is strict (no silent "64" -> 64 or true -> 1 coercions; an int is accepted where a float
is expected) and every failure is raised as ONE-line `ConfigError` naming the dotted key and the bad
value, e.g. ``batch_config.B_E: expected an integer, got 'abc'``.

YAML is read with PyYAML's safe loader, patched so that `1e-5` is a float as in YAML 1.2 (plain
PyYAML follows YAML 1.1 and reads `1e-5` as the *string* "1e-5", a classic trap for learning rates).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from entropy_experiments.errors import ConfigError, closest_match

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
    "ProbeConfig",
    "ProbeReworkSection",
    "RewardSection",
    "TeacherForcingProfile",
    "VarianceSection",
    "config_from_dict",
    "load_config",
    "packaged_config_path",
]

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"

# Seed-era keys still accepted in user configs. Old dotted key -> canonical dotted key; None means
# "accepted and dropped" (generation.do_sample must be true: the probe always samples;
# generation.num_return_sequences is superseded by batch_config.G and by G = 1 on E).
LEGACY_KEYS: dict[str, str | None] = {
    "checkpoint.model_config_path": "checkpoint.base_model",
    "sampling.use_sequence_processor": "probe_rework.use_sequence_processor_sampling",
    "generation.do_sample": None,
    "generation.num_return_sequences": None,
    "estimator.max_grad_norm": "objective.max_grad_norm",
}

# Spellings accepted for dtypes. Model-loading dtypes use the short names; precision profiles use
# torch attribute names (`getattr(torch, cfg.precision.tf_nograd.dtype)` must work).
_SHORT_DTYPE = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "fp32": "fp32",
    "bf16": "bf16",
    "fp16": "fp16",
}
_TORCH_DTYPE = {short: torch_name for torch_name, short in _SHORT_DTYPE.items() if torch_name != short}
_DEVICE_MAP_RE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _normalise_dtype(value: Any, table: dict[str, str]) -> Any:
    """Map a dtype spelling through `table`; anything else is left for the type check to reject."""
    if isinstance(value, str) and value.strip().lower() in table:
        return table[value.strip().lower()]
    return value


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


class _Section(BaseModel):
    """Base of every section: unknown keys are errors, no lax coercions, no inf/nan, defaults checked."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)


class CheckpointSection(_Section):
    """Where the adapter, optimizer state and base model come from, and how to load them."""

    # The layout under checkpoint_path (own, Trainer checkpoint-N/, adapter dir with optimizer.pt in its
    # parent) is recognised at load time by checkpoint_layout.resolve_checkpoint; explicit paths win.
    checkpoint_path: str | None = None
    adapter_path: str | None = None
    optimizer_path: str | None = None
    # None: the adapter's adapter_config.json base_model_name_or_path (no checkpoint: the embedded model)
    base_model: str | None = Field(None, min_length=1)
    use_qlora: bool = False
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # load dtype; runtime parameters are fp32 anyway
    device_map: str = "auto"
    trust_remote_code: bool = False
    allow_fresh_optimizer: bool = False  # a missing optimizer.pt is an error unless this is true

    @field_validator("dtype", mode="before")
    @classmethod
    def _short_dtype(cls, value: Any) -> Any:
        return _normalise_dtype(value, _SHORT_DTYPE)

    @field_validator("device_map")
    @classmethod
    def _check_device_map(cls, value: str) -> str:
        if not _DEVICE_MAP_RE.fullmatch(value):
            raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {value!r}")
        return value


class BatchSection(_Section):
    """Data set and batch sizes: E (B_E sequences for the entropy) and U (B_U prompts x G for v)."""

    dataset_name: str = Field("gsm_symbolic_r1_template", min_length=1)
    split: str = Field("train", min_length=1)
    dataset_path: str | None = None
    pool_size: int = Field(500, ge=1)  # examples drawn by generated (reasoning-gym) data sets
    B_E: int = Field(64, ge=1)
    B_U: int = Field(8, ge=1)
    G: int = Field(4, ge=2)  # U needs a group of responses to form advantages
    E_sampling_mode: Literal["replacement", "distinct"] = "replacement"
    max_prompts_pool: int | None = Field(None, ge=1)


class GenerationSection(_Section):
    """Sampling policy (temperature, nucleus) and generation / teacher-forcing batch sizes."""

    temperature: float = Field(1.0, gt=0)
    top_p: float = 1.0
    max_new_tokens: int = Field(128, ge=1)
    gen_batch_size: int = Field(8, ge=1)  # sequences per generate() call
    tf_batch_size: int = Field(8, ge=1)  # sequences per teacher-forcing forward
    rb_requires_grad: bool = True
    stop_strings: list[str] = Field(default_factory=lambda: ["</answer>"])
    max_prompt_tokens: int | None = Field(None, ge=1)  # None: the model's context limit
    prompt_overflow: Literal["error", "truncate"] = "error"

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, value: float) -> float:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"must be in (0, 1], got {value!r}")
        return value

    @field_validator("stop_strings")
    @classmethod
    def _check_stop_strings(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError(f"stop strings must be non-empty, got {value!r}")
        return value


class _AutocastProfile(_Section):
    """Autocast settings of one forward path (seed 004's precision profiles)."""

    autocast: bool = False
    dtype: str = "float32"  # torch dtype name used when autocast is on

    @field_validator("dtype", mode="before")
    @classmethod
    def _torch_dtype(cls, value: Any) -> Any:
        value = _normalise_dtype(value, _TORCH_DTYPE)
        if isinstance(value, str) and value not in _TORCH_DTYPE.values():
            raise ValueError(f"expected float32, bfloat16 or float16, got {value!r}")
        return value


class FuncOverrideProfile(_AutocastProfile):
    """Forward through `functional_call` with overridden parameters θ + η·v."""

    cast_params: bool = True  # cast the effective parameters to `dtype` before the forward


class TeacherForcingProfile(_AutocastProfile):
    """Teacher-forced scoring forward (no-grad or with-grad)."""

    cast_logits_fp32: bool = True  # upcast logits before the softmax maths


class PrecisionSection(_Section):
    """Numerics: fp32 runtime, fp64 entropy maths, TF32 and matmul precision, token chunking."""

    runtime_dtype: Literal["fp32"] = "fp32"
    entropy_fp64: bool = True
    allow_tf32: bool = False
    matmul_precision: Literal["highest", "high", "medium"] = "highest"
    token_chunk_size: int = Field(256, ge=1)  # tokens per chunk in vocab-sized maths (memory bound)
    func_override: FuncOverrideProfile = Field(default_factory=FuncOverrideProfile)
    tf_nograd: TeacherForcingProfile = Field(default_factory=TeacherForcingProfile)
    tf_withgrad: TeacherForcingProfile = Field(default_factory=TeacherForcingProfile)

    @field_validator("runtime_dtype", mode="before")
    @classmethod
    def _short_dtype(cls, value: Any) -> Any:
        return _normalise_dtype(value, _SHORT_DTYPE)


class ProbeReworkSection(_Section):
    """Sampling backend toggle: SequenceProcessor (default) or the plain reference sampler."""

    use_sequence_processor_sampling: bool = True


class EstimatorSection(_Section):
    """How δH₁ is estimated (MATH.md §2-4)."""

    normalize: Literal["per_token", "per_sequence"] = "per_token"
    x_mode: Literal["causal", "full_return"] = "causal"
    baseline: Literal["none", "loo_position"] = "none"
    update_direction: Literal["adamw_step", "preconditioned_gradient", "sgd"] = "adamw_step"
    microbatch_size: int = Field(4, ge=1)  # sequences per backward microbatch


class ObjectiveSection(_Section):
    """The objective of the trainer that made the checkpoint (MATH.md §4, TRAINERS.md); U's gradient is
    its gradient. Unset keys (null) take the `trainer` preset's value, else the seeds' Dr-GRPO defaults;
    `ProbeConfig.objective_options()` gives the resolved values."""

    trainer: Literal["trl", "verl", "openrlhf"] | None = None
    loss_type: str | None = None  # dr_grpo_per_prompt (default) | grpo | bnpo | dapo | dr_grpo | luspo | verl names
    scale_rewards: Literal["none", "group", "batch"] | None = None
    advantage_eps: float | None = Field(None, ge=0)
    max_completion_length: int | None = Field(None, ge=1)
    micro_batches: int | None = Field(None, ge=1)
    kl_coef: float | None = Field(None, ge=0)
    kl_estimator: Literal["k3", "low_var_kl"] | None = None
    entropy_coef: float | None = None
    entropy_aggregation: Literal["loss", "token_mean"] | None = None
    max_grad_norm: float | None = Field(None, gt=0)
    # What a single first on-policy step cannot represent: accepted only at their neutral values.
    num_iterations: int = 1
    vllm_importance_sampling_correction: bool = False
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0

    @field_validator("num_iterations")
    @classmethod
    def _one_iteration(cls, value: int) -> int:
        if value != 1:
            raise ValueError("the probe represents the first, on-policy optimizer step after generation (ratio 1, "
                             f"no clipping); later PPO epochs on the same rollouts are off-policy, got {value}")
        return value

    @field_validator("vllm_importance_sampling_correction")
    @classmethod
    def _no_vllm_correction(cls, value: bool) -> bool:
        if value:
            raise ValueError("the π_old/π_vLLM correction of a vLLM-sampled run is not representable (the probe "
                             "samples with the policy itself), got true")
        return value

    @field_validator("off_policy_mask_threshold")
    @classmethod
    def _no_off_policy_mask(cls, value: float | None) -> float | None:
        if value is not None:
            raise ValueError(f"off-policy sequence masks need old log-probs the probe does not have, got {value!r}")
        return value

    @field_validator("top_entropy_quantile")
    @classmethod
    def _no_entropy_mask(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError(f"high-entropy token masks are not represented, must be 1.0, got {value!r}")
        return value

    def explicit(self) -> dict[str, Any]:
        """The keys that feed the objective (None = unset), for `objectives.resolve`."""
        return self.model_dump(exclude={"num_iterations", "vllm_importance_sampling_correction",
                                        "off_policy_mask_threshold", "top_entropy_quantile"})


class ImportanceSection(_Section):
    """Ground-truth ΔH(η) by self-normalised importance sampling (MATH.md §5)."""

    enabled: bool = True
    mode: Literal["param_override", "real_step"] = "param_override"
    eta_list: list[float] = Field(default_factory=lambda: [1e-6, 3e-6, 1e-5], min_length=1)
    symmetric: bool = True  # also evaluate -η for symmetric slopes

    @field_validator("eta_list")
    @classmethod
    def _check_etas(cls, value: list[float]) -> list[float]:
        for eta in value:
            if eta == 0.0:
                raise ValueError(f"η must be non-zero, got {eta!r}")
        return value


class VarianceSection(_Section):
    """Jackknife standard errors (MATH.md §6)."""

    enabled: bool = True
    u_groups: int | None = Field(None, ge=2)  # None: min(B_U, 8)
    # How the per-sequence pieces D_v(...) are obtained: auto = backward_hooks when possible, else jvp.
    directional: Literal["auto", "backward_hooks", "jvp"] = "auto"


class RewardSection(_Section):
    """Reward for U: a registered name or "package.module:function"."""

    name: str = Field("tag_pref", min_length=1)


class DistributedSection(_Section):
    """torch.distributed settings (used only when launched by torchrun with several ranks; not part of
    config_hash). backend auto: nccl on CUDA, gloo on CPU; timeout_s: how long a collective waits for
    a rank that died or hangs before every other rank exits with one error line."""

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = Field(600, gt=0)


class OutputSection(_Section):
    """Run directory and artefacts; not part of config_hash."""

    run_dir: str | None = None  # None: runs/<timestamp>
    save_batches: bool = True
    plot: bool = True


class ProbeConfig(_Section):
    """The whole probe configuration (see entropy_experiments/configs/default.yaml for every key)."""

    seed: int = Field(42, ge=0)
    learning_rate: float | None = Field(None, gt=0)  # None: the optimizer's saved param_groups lr
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    batch_config: BatchSection = Field(default_factory=BatchSection)
    generation: GenerationSection = Field(default_factory=GenerationSection)
    precision: PrecisionSection = Field(default_factory=PrecisionSection)
    probe_rework: ProbeReworkSection = Field(default_factory=ProbeReworkSection)
    estimator: EstimatorSection = Field(default_factory=EstimatorSection)
    objective: ObjectiveSection = Field(default_factory=ObjectiveSection)
    importance: ImportanceSection = Field(default_factory=ImportanceSection)
    variance: VarianceSection = Field(default_factory=VarianceSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    output: OutputSection = Field(default_factory=OutputSection)

    @model_validator(mode="after")
    def _check_cross_section(self) -> ProbeConfig:
        # The U-side jackknife leaves out one group of prompts at a time: it needs >= 1 prompt per group.
        groups = self.variance.u_groups
        if groups is not None and groups > self.batch_config.B_U:
            raise ValueError(
                f"variance.u_groups: must be <= batch_config.B_U ({self.batch_config.B_U}), got {groups}"
            )
        try:  # an unknown loss type or a micro-batch count that cannot split U fails here, before any work
            options = self.objective_options()
            n_u = self.batch_config.B_U * self.batch_config.G
            if n_u % options.micro_batches:
                raise ConfigError(f"objective.micro_batches: must divide the {n_u} U sequences "
                                  f"(batch_config.B_U·G), got {options.micro_batches}")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self

    def objective_options(self):
        """The resolved `objectives.ObjectiveOptions` (explicit keys > trainer preset > defaults)."""
        from .estimators.objectives import resolve

        return resolve(self.objective.explicit(), default_completion_length=self.generation.max_new_tokens)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of the resolved config (YAML / JSON safe)."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        """Resolved config as YAML; `load_config` on it gives an equal config."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    def config_hash(self) -> str:
        """First 16 hex chars of sha256 over the canonical JSON of the config, `output` and `distributed`
        excluded (neither changes a number: a run can be resumed on any number of ranks or backend)."""
        payload = json.dumps(
            self.model_dump(mode="json", exclude={"output", "distributed"}),
            sort_keys=True,
            separators=(",", ":"),
            allow_nan=False,
        )
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# YAML reading
# ----------------------------------------------------------------------------------------------


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (`1e-5`) and an error on duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges may legitimately repeat keys
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable key; the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)


# Copy the resolver table before adding to it, so that yaml.SafeLoader itself is left untouched.
_YamlLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)


def _yaml_error_detail(exc: yaml.YAMLError) -> str:
    """`line N: problem` from a PyYAML error, on one line."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def _read_yaml_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    try:
        data = _yaml_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML ({_yaml_error_detail(exc)})") from None
    if data is None:  # an empty file means "all defaults"
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------------------------
# Overrides and legacy keys (operate on the raw dict before validation)
# ----------------------------------------------------------------------------------------------

_OVERRIDE_RE = re.compile(r"\s*([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\s*=(.*)", re.DOTALL)


def _apply_override(raw: dict[str, Any], spec: str) -> None:
    """Set one `section.key=value` (value parsed as YAML) in `raw`, in place."""
    match = _OVERRIDE_RE.fullmatch(spec) if isinstance(spec, str) else None
    if match is None:
        raise ConfigError(f"--set expects section.key=value, got {spec!r}")
    key, text = match.group(1), match.group(2)
    try:
        value = _yaml_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"--set {key}: value is not valid YAML ({_yaml_error_detail(exc)}), got {text!r}"
        ) from None
    # An override names the canonical key or a legacy one; either way it replaces both spellings in
    # the file, so that `--set checkpoint.base_model=X` wins over a file's `model_config_path`.
    canonical = LEGACY_KEYS.get(key) or key  # a dropped legacy key stays as is, so its check still runs
    for old, new in LEGACY_KEYS.items():
        if new == canonical or old == key:
            _pop_path(raw, old)
    *parents, leaf = canonical.split(".")
    node, model = raw, ProbeConfig
    for i, part in enumerate(parents):
        child = node.get(part)
        known_scalar = model is not None and part in model.model_fields and _section_type(model, part) is None
        if known_scalar or (child is not None and not isinstance(child, dict)):
            raise ConfigError(f"--set {spec.strip()}: '{'.'.join(parents[: i + 1])}' is not a section")
        if child is None:  # unknown names are created here and reported by validation
            child = node[part] = {}
        node, model = child, (_section_type(model, part) if model is not None else None)
    node[leaf] = value


def _pop_path(raw: dict[str, Any], dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    node: Any = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(leaf, None)


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML (strings quoted), cut to a readable length."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None:
        text = "null"
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _resolve_legacy_keys(raw: dict[str, Any]) -> None:
    """Map seed-era keys (`LEGACY_KEYS`) onto canonical ones in place; error on conflicting values."""
    for old, new in LEGACY_KEYS.items():
        old_section, old_key = old.split(".")
        section = raw.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        value = section.pop(old_key)
        if new is None:
            if old == "generation.do_sample" and value is not True:
                raise ConfigError(
                    f"generation.do_sample: the probe always samples, must be true, got {_show(value)}"
                )
            continue
        new_section, new_key = new.split(".")
        target = raw.get(new_section)
        if target is None:
            target = raw[new_section] = {}
        if not isinstance(target, dict):
            continue  # validation reports "expected a mapping"
        if new_key in target and target[new_key] != value:
            raise ConfigError(
                f"{old} ({_show(value)}) conflicts with {new} ({_show(target[new_key])}); give only {new}"
            )
        target[new_key] = value

    # Sections that exist only in seed-era configs (`sampling`) must be empty once their keys moved.
    for section_name in sorted({old.split(".")[0] for old in LEGACY_KEYS} - set(ProbeConfig.model_fields)):
        if section_name not in raw:
            continue
        leftover = raw.pop(section_name)
        if leftover is None or leftover == {}:
            continue
        known = [old.split(".")[1] for old in LEGACY_KEYS if old.startswith(section_name + ".")]
        if not isinstance(leftover, dict):
            raise ConfigError(f"{section_name}: expected a mapping, got {_show(leftover)}")
        bad = str(next(iter(leftover)))
        hint = closest_match(bad, known)
        raise ConfigError(
            f"unknown key '{section_name}.{bad}'"
            + (f" (did you mean '{section_name}.{hint}'?)" if hint else f" (valid keys: {', '.join(known)})")
        )


def _section_type(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The model class of section `name` of `model`, or None when `name` is not a section."""
    field = model.model_fields.get(name)
    sub = field.annotation if field is not None else None
    return sub if isinstance(sub, type) and issubclass(sub, BaseModel) else None


def _fill_empty_sections(raw: dict[str, Any], model: type[BaseModel]) -> None:
    """Treat `section:` with nothing under it (YAML null) as an empty section, recursively."""
    for name in model.model_fields:
        sub = _section_type(model, name)
        if sub is None or name not in raw:
            continue
        if raw[name] is None:
            raw[name] = {}
        if isinstance(raw[name], dict):
            _fill_empty_sections(raw[name], sub)


# ----------------------------------------------------------------------------------------------
# pydantic errors -> one-line ConfigError
# ----------------------------------------------------------------------------------------------

_EXPECTED = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "model_type": "expected a mapping",
    "dict_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "finite_number": "must be a finite number",
}
_BOUNDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def _dotted(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _section_model(loc: tuple) -> type[BaseModel] | None:
    """The model class that holds the key at `loc` (ProbeConfig for a top-level key)."""
    model: type[BaseModel] | None = ProbeConfig
    for part in loc[:-1]:
        model = _section_type(model, part) if isinstance(part, str) else None
        if model is None:
            return None
    return model


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key path of `model`, sections included."""
    keys = []
    for name in model.model_fields:
        keys.append(prefix + name)
        sub = _section_type(model, name)
        if sub is not None:
            keys.extend(_all_keys(sub, prefix + name + "."))
    return keys


def _unknown_key_message(loc: tuple) -> str:
    path = _dotted(loc)
    model = _section_model(loc)
    prefix = path[: -len(str(loc[-1]))]
    valid = list(model.model_fields) if model is not None else []
    hint = closest_match(str(loc[-1]), valid)
    if hint is not None:
        return f"unknown key '{path}' (did you mean '{prefix}{hint}'?)"
    # The right key in the wrong section is a common slip: point at where it lives.
    elsewhere = [k for k in _all_keys(ProbeConfig) if k.rsplit(".", 1)[-1] == str(loc[-1])]
    if elsewhere:
        return f"unknown key '{path}' (did you mean '{elsewhere[0]}'?)"
    return f"unknown key '{path}' (valid keys: {', '.join(valid)})"


def _error_message(err: dict[str, Any]) -> str:
    kind, loc, ctx = err["type"], tuple(err["loc"]), err.get("ctx") or {}
    path = _dotted(loc)
    if kind == "extra_forbidden":
        return _unknown_key_message(loc)
    if kind == "invalid_key":  # a non-string key such as `1:` can only be an unknown key
        return _unknown_key_message(loc[:-1] + (str(loc[-1]),))
    if kind in ("value_error", "assertion_error"):
        # Our validators write "<what>, got <value>"; a cross-section check names its own keys.
        reason = str(ctx.get("error", err["msg"]))
        return f"{path}: {reason}" if path else reason
    if kind in _BOUNDS:
        name, symbol = _BOUNDS[kind]
        reason = f"must be {symbol} {ctx[name]:g}"
    elif kind == "literal_error":
        reason = f"expected {ctx['expected']}"
    elif kind in ("too_short", "string_too_short"):
        reason = (
            "must not be empty" if ctx.get("min_length") == 1 else f"needs at least {ctx['min_length']} items"
        )
    else:
        reason = _EXPECTED.get(kind, err["msg"])
    return f"{path}: {reason}, got {_show(err['input'])}"


def _config_error(exc: ValidationError) -> ConfigError:
    errors = exc.errors()
    # An unknown key (often a typo) explains more than whatever else failed, so report it first.
    first = next((e for e in errors if e["type"] in ("extra_forbidden", "invalid_key")), errors[0])
    return ConfigError(_error_message(first))


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def config_from_dict(d: dict[str, Any]) -> ProbeConfig:
    """Validate a raw config mapping (seed-era keys allowed) into a ProbeConfig. `d` is not modified."""
    if not isinstance(d, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(d).__name__}")
    raw = copy.deepcopy(d)
    _resolve_legacy_keys(raw)
    _fill_empty_sections(raw, ProbeConfig)
    try:
        return ProbeConfig.model_validate(raw)
    except ValidationError as exc:
        raise _config_error(exc) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ProbeConfig:
    """Read a YAML config (None: all defaults), apply `section.key=value` overrides, validate.

    Override values are YAML: `generation.top_p=0.9`, `importance.eta_list=[1e-5, 2e-5]`,
    `precision.tf_nograd.autocast=false`, `learning_rate=1e-5`.
    """
    raw = {} if path is None else _read_yaml_file(Path(path))
    for spec in overrides or []:
        _apply_override(raw, spec)
    return config_from_dict(raw)


def packaged_config_path(name: str) -> Path:
    """Path of a config shipped with the package: entropy_experiments/configs/<name>.yaml."""
    stem = name.removesuffix(".yaml")
    path = CONFIGS_DIR / f"{stem}.yaml"
    if not path.is_file():
        available = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
        hint = closest_match(stem, available)
        raise ConfigError(
            f"no packaged config '{name}'"
            + (f" (did you mean '{hint}'?)" if hint else "")
            + f"; available: {', '.join(available)}"
        )
    return path
