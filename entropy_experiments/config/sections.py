"""The pydantic section models of the probe configuration (`checkpoint`, `batch_config`, ...).

Every section forbids unknown keys and validates strictly (no silent "64" -> 64 or true -> 1
coercions; an int is accepted where a float is expected). `ProbeConfig` (probe_config.py) holds one
of each.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import ConfigError
from ..policy.generation_config import GenerationConfig, check_engine_policy

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
GENERATION_DEFAULTS = GenerationConfig()  # the `generation` defaults are the policy's (policy/generation_config.py)


def _normalise_dtype(value: Any, table: dict[str, str]) -> Any:
    """Map a dtype spelling through `table`; anything else is left for the type check to reject."""
    if isinstance(value, str) and value.strip().lower() in table:
        return table[value.strip().lower()]
    return value


class _Section(BaseModel):
    """Base of every section: unknown keys are errors, no lax coercions, no inf/nan, defaults checked."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)


class CheckpointSection(_Section):
    """Where the adapter, optimizer state and base model come from, and how to load them."""

    # The layout under checkpoint_path (own, Trainer checkpoint-N/, adapter dir with optimizer.pt in its
    # parent) is recognised at load time by checkpoint.layout.resolve_checkpoint; explicit paths win.
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
    # null: the data set's own size (a generated data set's default pool, 500 problems for the default data set;
    # every row of a split read from a file or the hub); a number: that many (generated) or the first that many rows
    pool_size: int | None = Field(None, ge=1)
    B_E: int = Field(64, ge=1)
    B_U: int = Field(8, ge=1)
    G: int = Field(4, ge=2)  # U needs a group of responses to form advantages
    E_sampling_mode: Literal["replacement", "distinct"] = "replacement"
    max_prompts_pool: int | None = Field(None, ge=1)
    # dataset_name: hf (TRL's conventions, data/datasets/hf.py): the prompt and gold-answer columns, and the
    # trainer's chat_template_kwargs (GRPOConfig.chat_template_kwargs) for conversational prompts.
    prompt_column: str | None = Field(None, min_length=1)  # None: 'prompt'
    answer_column: str | None = Field(None, min_length=1)  # None: 'answer' when present
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _columns_need_hf(self) -> BatchSection:
        if self.dataset_name != "hf":
            for key in ("prompt_column", "answer_column", "chat_template_kwargs"):
                if getattr(self, key):
                    raise ValueError(f"{key} applies to dataset_name: hf only (got dataset_name "
                                     f"{self.dataset_name!r})")
        return self

    def column_options(self) -> tuple[str, str | None] | None:
        """(prompt column, answer column) for `load_examples(columns=...)`; None for the other data sets."""
        return (self.prompt_column or "prompt", self.answer_column) if self.dataset_name == "hf" else None


class GenerationSection(_Section):
    """Sampling policy (temperature, nucleus) and generation / teacher-forcing batch sizes."""

    temperature: float = Field(GENERATION_DEFAULTS.temperature, gt=0)
    top_p: float = GENERATION_DEFAULTS.top_p
    max_new_tokens: int = Field(GENERATION_DEFAULTS.max_new_tokens, ge=1)
    # sequences per generate() call; "auto": from the free device memory (CUDA), 16 (CPU: CPU_ROWS_PER_CALL)
    gen_batch_size: int | Literal["auto"] = GENERATION_DEFAULTS.gen_batch_size  # type: ignore[assignment]
    tf_batch_size: int = Field(GENERATION_DEFAULTS.tf_batch_size, ge=1)  # sequences per teacher-forcing forward
    rb_requires_grad: bool = GENERATION_DEFAULTS.rb_requires_grad
    stop_strings: list[str] = Field(default_factory=lambda: list(GENERATION_DEFAULTS.stop_strings))
    max_prompt_tokens: int | None = Field(GENERATION_DEFAULTS.max_prompt_tokens, ge=1)  # None: the context limit
    prompt_overflow: Literal["error", "truncate"] = GENERATION_DEFAULTS.prompt_overflow  # type: ignore[assignment]
    sampler_dtype: Literal["auto", "fp32", "bf16"] = GENERATION_DEFAULTS.sampler_dtype  # type: ignore[assignment]
    sampler_engine: Literal["generate", "static_cache", "continuous_batching"] = \
        GENERATION_DEFAULTS.sampler_engine  # type: ignore[assignment]

    @field_validator("gen_batch_size")
    @classmethod
    def _check_gen_batch_size(cls, value: int | str) -> int | str:
        if value != "auto" and value < 1:
            raise ValueError(f"must be an integer >= 1 or 'auto', got {value!r}")
        return value

    @model_validator(mode="after")
    def _engine_applies_our_nucleus(self) -> GenerationSection:
        try:
            check_engine_policy(self.sampler_engine, self.top_p)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self

    @field_validator("sampler_dtype", mode="before")
    @classmethod
    def _short_sampler_dtype(cls, value: Any) -> Any:
        return _normalise_dtype(value, _SHORT_DTYPE)

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

    runtime_dtype: Literal["fp32", "bf16"] = "fp32"  # bf16: base weights bf16, adapter fp32 (README "Scaling")
    entropy_fp64: bool = True
    allow_tf32: bool = False
    matmul_precision: Literal["highest", "high", "medium"] = "highest"
    token_chunk_size: int = Field(GENERATION_DEFAULTS.token_chunk_size, ge=1)  # tokens per chunk (memory bound)
    func_override: FuncOverrideProfile = Field(default_factory=FuncOverrideProfile)
    tf_nograd: TeacherForcingProfile = Field(default_factory=TeacherForcingProfile)
    tf_withgrad: TeacherForcingProfile = Field(default_factory=TeacherForcingProfile)

    @field_validator("runtime_dtype", mode="before")
    @classmethod
    def _short_dtype(cls, value: Any) -> Any:
        return _normalise_dtype(value, _SHORT_DTYPE)


class SamplerSection(_Section):
    """Which sampler draws E and U: batched generation by the policy engine (default) or the plain
    one-prompt-at-a-time reference sampler (legacy section: `probe_rework.use_sequence_processor_sampling`)."""

    batched: bool = True


class EstimatorSection(_Section):
    """How δH₁ is estimated (docs/maths.md §2-4)."""

    normalize: Literal["per_token", "per_sequence"] = "per_token"
    x_mode: Literal["causal", "full_return"] = "causal"
    baseline: Literal["none", "loo_position"] = "none"
    update_direction: Literal["adamw_step", "preconditioned_gradient", "sgd"] = "adamw_step"
    microbatch_size: int = Field(4, ge=1)  # sequences per backward microbatch
    memory_budget_gb: float | None = Field(None, gt=0)  # with-grad microbatch memory cap: microbatch_size lowered to fit


class ObjectiveSection(_Section):
    """The objective of the trainer that made the checkpoint (docs/maths.md §4, docs/objectives.md); U's gradient is
    its gradient. Unset keys (null) take the `trainer` preset's value, else the seeds' Dr-GRPO defaults;
    `ProbeConfig.objective_options()` gives the resolved values."""

    trainer: Literal["trl", "verl", "openrlhf"] | None = None
    loss_type: str | None = None  # dr_grpo_per_prompt (default) | grpo | bnpo | dapo | dr_grpo | luspo | verl names
    scale_rewards: Literal["none", "group", "batch"] | None = None
    advantage_eps: float | None = Field(None, ge=0)
    max_completion_length: int | None = Field(None, ge=1)
    micro_batches: int | None = Field(None, ge=1)
    kl_coef: float | None = Field(None, ge=0)
    kl_estimator: Literal["k3", "low_var_kl", "k1", "k2"] | None = None
    entropy_coef: float | None = None
    entropy_aggregation: Literal["loss", "token_mean"] | None = None
    max_grad_norm: float | None = Field(None, gt=0)
    # Completions per optimizer step of the trainer (TRL: per_device_train_batch_size × processes ×
    # gradient_accumulation_steps); a U batch of another size is stated in results.json (trainer_batch.py).
    trainer_batch_completions: int | None = Field(None, ge=1)
    # The trainer's μ (TRL num_iterations, steps_per_generation = gradient_accumulation_steps): each rollout
    # batch serves μ optimizer steps. Only the first of them is on-policy (ratio 1, no clipping), so a checkpoint
    # is probed only when its next step takes fresh rollouts (checkpoint/rollouts.py); the others are refused.
    num_iterations: int = Field(1, ge=1)
    # TRL's PPO clip range ε and its upper bound ε_high (GRPOConfig epsilon, epsilon_high; null: the trainer's
    # default). Recorded only: on the first on-policy step the ratio is 1, inside every clip range, so they do
    # not act on the step the probe represents.
    epsilon: float | None = Field(None, gt=0)
    epsilon_high: float | None = Field(None, gt=0)
    # TRL's vLLM importance-sampling correction (TRL's names; mode and bounds default to TRL's): with trainer trl,
    # U's policy loss is weighted by TRL's truncated / masked ratio of the policy's log-probs to the sampler's own
    # (estimators/vllm_correction.py); it acts only on a U batch drawn by another sampler (sampler_logqs).
    vllm_importance_sampling_correction: bool = False
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                           "sequence_mask"] = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0
    # TRL's use_bias_correction_kl: the per-token KL (kl_coef > 0) times the token's importance ratio, 1 on-policy
    # but differentiable (docs/objectives.md). null: the trainer's default (trl: true, TRL's; other trainers and
    # none: off); true is refused for a trainer other than trl.
    use_bias_correction_kl: bool | None = None
    # What a single first on-policy step cannot represent: accepted only at their neutral values.
    kl_in_reward_coef: float = 0.0   # OpenRLHF --algo.kl.init_coef without --algo.kl.use_loss; verl use_kl_in_reward
    off_policy_mask_threshold: float | None = None
    # Entropy controls (docs/objectives.md "Entropy controls"): TRL's high-entropy token mask and adaptive entropy
    # coefficient (its state read from the checkpoint's entropy_ctrl_state.json), verl's policy_loss.loss_mode.
    top_entropy_quantile: float = Field(1.0, ge=0, le=1)
    use_adaptive_entropy: bool = False
    entropy_target: float = 0.2
    policy_loss: Literal["vanilla", "clip_cov", "kl_cov"] = "vanilla"
    clip_cov_ratio: float = Field(0.0002, gt=0)
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = Field(0.0002, gt=0)   # no effect on the first on-policy step (docs/objectives.md)
    ppo_kl_coef: float = 1.0

    @field_validator("kl_in_reward_coef")
    @classmethod
    def _no_kl_in_reward(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("a KL penalty inside the reward (OpenRLHF's default: --algo.kl.init_coef without "
                             "--algo.kl.use_loss; verl's use_kl_in_reward) makes the advantages depend on the reference "
                             "model (OpenRLHF: each token's on the KL of the tokens after it), which the probe does not "
                             f"represent; got {value!r} (train with the KL as a loss: kl_coef)")
        return value

    @field_validator("off_policy_mask_threshold")
    @classmethod
    def _no_off_policy_mask(cls, value: float | None) -> float | None:
        if value is not None:
            raise ValueError(f"off-policy sequence masks need old log-probs the probe does not have, got {value!r}")
        return value

    def explicit(self) -> dict[str, Any]:
        """The keys that feed the objective (None = unset), for `objectives.resolve`."""
        return self.model_dump(exclude={"kl_in_reward_coef", "off_policy_mask_threshold", "trainer_batch_completions",
                                        "use_adaptive_entropy", "entropy_target", "kl_cov_ratio", "ppo_kl_coef"})


class ImportanceSection(_Section):
    """Ground-truth ΔH(η) by self-normalised importance sampling (docs/maths.md §5)."""

    enabled: bool = True
    mode: Literal["param_override", "real_step"] = "param_override"
    eta_list: list[float] = Field(default_factory=lambda: [1e-5], min_length=1)
    symmetric: bool = False  # also evaluate -η, for symmetric slopes (one more no-grad pass over E per η)
    eta_over_lr: list[float] | None = Field(None, min_length=1)  # η = k·lr per k instead of eta_list (None: eta_list)

    @field_validator("eta_list", "eta_over_lr")
    @classmethod
    def _check_etas(cls, value: list[float] | None) -> list[float] | None:
        for eta in value or []:
            if eta == 0.0:
                raise ValueError(f"η must be non-zero, got {eta!r}")
        return value


class VarianceSection(_Section):
    """Jackknife standard errors (docs/maths.md §6)."""

    enabled: bool = True
    u_groups: int | None = Field(None, ge=2)  # None: min(B_U, 8)
    # How the per-sequence pieces D_v(...) are obtained: auto = backward_hooks when possible, else jvp.
    directional: Literal["auto", "backward_hooks", "jvp"] = "auto"
    # How r_i = D_v L_β,i is obtained on the backward_hooks path (docs/scaling.md "r_i without the second
    # backward"): backward (a second backward of L_β per E microbatch, exact) | central_difference (from the no-grad
    # passes at θ ± η·v, η = r_eta; the E side then runs one backward). r_eta: None = the largest η ≤ R_ETA_MAX
    # whose ±η the ΔH phase scores; a value not among them adds a dedicated pair of no-grad passes.
    r_method: Literal["backward", "central_difference"] = "backward"
    r_eta: float | None = Field(None, gt=0)


class SecondOrderSection(_Section):
    """d2 = D²_v H on E (docs/maths.md §10): `finite_difference`, from no-grad passes at θ ± η·v per η of `eta_list`
    (the ΔH passes' where they measured it), or `jvp`, exact (forward over forward, shared with the attribution)."""

    enabled: bool = True
    method: Literal["finite_difference", "jvp"] = "finite_difference"
    eta_list: list[Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(default_factory=lambda: [1e-3], min_length=1)


class PredictorsSection(_Section):
    """Competing predictors of the same step beside the AdamW step (README "Competing predictors").
    next_checkpoint: the checkpoint the run reached next; set, it adds the `displacement` predictor
    δH_Δθ = X̂·(θ_next − θ) (README "Across a run"; set by the sweep), also with `enabled` false unless
    `displacement` is false (its ½·D²_Δθ H: a nested jvp over E, with second_order)."""

    enabled: bool = False  # one more forward + backward over E (direct_only) and a no-grad pass over U
    displacement: bool = True
    next_checkpoint: str | None = None


class RewardSection(_Section):
    """Reward for U: a registered name or "package.module:function" (`name`), or several functions with weights
    summed as TRL's `reward_weights` (`functions`, `weights`; data/rewards/weighted.py)."""

    name: str = Field("tag_pref", min_length=1)
    functions: list[str] | None = Field(None, min_length=1)
    weights: list[float] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_way(self) -> RewardSection:
        if self.functions is not None and self.name != "tag_pref":
            raise ValueError("give reward.name (one function) or reward.functions (several), not both")
        n = len(self.specs())
        if self.weights is not None and len(self.weights) != n:
            raise ValueError(f"reward.weights: {len(self.weights)} weights for {n} reward function(s)")
        return self

    def specs(self) -> list[str]:
        """The reward functions, in order (`functions`, else [`name`])."""
        return list(self.functions) if self.functions is not None else [self.name]


class DistributedSection(_Section):
    """Multi-rank settings under torchrun (probe/parallel.py; not hashed). backend auto: nccl on CUDA, gloo on
    CPU; timeout_s: how long a collective waits for a dead or hung rank before every rank exits with one line."""

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = Field(600, gt=0)


class OutputSection(_Section):
    """Run directory and artefacts; not part of config_hash."""

    run_dir: str | None = None  # None: runs/<timestamp>
    save_batches: bool = True
    plot: bool = True
    token_attribution: bool = True  # E_tokens.parquet and the report's coloured tokens
    # D_v H_t: from the ΔH passes (no ΔH pass: jvp) | jvp, exact (one pass over E unless one was made anyway)
    token_attribution_method: Literal["finite_difference", "jvp"] = "finite_difference"


def section_type(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The model class of section `name` of `model`, or None when `name` is not a section."""
    field = model.model_fields.get(name)
    sub = field.annotation if field is not None else None
    return sub if isinstance(sub, type) and issubclass(sub, BaseModel) else None
