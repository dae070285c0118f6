"""What the probe reads from a live TRL `GRPOTrainer`: its objective, sampling, data, rewards and optimizer.

Everything the offline probe takes from a config and a checkpoint, the callback takes from the trainer:

| probe                          | from the trainer                                                          |
|--------------------------------|---------------------------------------------------------------------------|
| `objective.*`                  | `args.loss_type`, `beta` (kl_coef), `scale_rewards`, `max_grad_norm`, `max_completion_length`, `gradient_accumulation_steps` (micro-batches), `num_iterations` (which steps are probed: the callback), `top_entropy_quantile`, `entropy_coef` (with `use_adaptive_entropy`: the live controller's, `step_objective`), `off_policy_mask_threshold`, `vllm_importance_sampling_correction`, `use_bias_correction_kl` |
| `generation.*`                 | `temperature`, `top_p`, `max_completion_length`; no stop string (TRL stops at EOS only) |
| prompts                        | `train_dataset` rows in TRL's column conventions, rendered with `args.chat_template_kwargs` |
| rewards                        | `reward_funcs` with `reward_weights`, called as TRL calls them            |
| the policy, its AdamW, the lr  | the live PeftModel, the live optimizer (its param_groups hold the lr of the step about to be taken) |

Sampling settings the probe's sampling policy q (temperature + nucleus) cannot represent — top-k, min-p, a
repetition penalty, extra generation kwargs, vLLM — are refused with one line, as are TRL loss types whose
gradient the probe does not mirror (cispo, sapo, vespo), reward models (the probe calls functions) and launch
modes that shard the policy or its optimizer (DeepSpeed ZeRO, FSDP: `ranks.launch_refusal`; several processes
under DDP are supported). Each refusal names the setting and says why.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import ValidationError

from entropy_experiments.config import ProbeConfig
from entropy_experiments.config.messages import config_error
from entropy_experiments.data.datasets.hf import dataset_examples
from entropy_experiments.data.rewards.weighted import RewardSet
from entropy_experiments.errors import ConfigError
from entropy_experiments.estimators.entropy_terms import adaptive_entropy_coef
from entropy_experiments.estimators.objective_gradient import Trainable
from entropy_experiments.estimators.objectives import unmirrored_loss_type
from entropy_experiments.integrations.ranks import launch_refusal
from entropy_experiments.policy.engine import PolicyEngine
from entropy_experiments.probe.results import Policy

KEY = "EntropyProbeCallback"


def check_trainer(trainer: Any) -> None:
    """ConfigError (one line) unless `trainer` is a TRL GRPOTrainer (one process or DDP) the probe can mirror."""
    check_grpo(trainer)
    args = trainer.args
    unmirrored = unmirrored_loss_type(args.loss_type)
    if unmirrored is not None:
        raise ConfigError(f"{KEY}: GRPOConfig.loss_type: {unmirrored}")
    refusals = unsupported_settings(args)
    for key, (refused, why) in refusals.items():
        if refused:
            raise ConfigError(f"{KEY}: GRPOConfig.{key}={getattr(args, key)!r} is not supported ({why})")
    for fn in trainer.reward_funcs:
        if not callable(fn) or isinstance(fn, torch.nn.Module):
            raise ConfigError(f"{KEY}: reward models are not supported (reward {type(fn).__name__}); "
                              "pass reward functions")


def check_grpo(trainer: Any) -> None:
    """ConfigError (one line) unless `trainer` is a trl.GRPOTrainer in one process or under DDP."""
    try:
        from trl import GRPOTrainer
    except ImportError:  # pragma: no cover - the callback is only useful with trl installed
        raise ConfigError(f"{KEY}: needs trl (pip install trl) — it probes a trl.GRPOTrainer") from None
    if not isinstance(trainer, GRPOTrainer):
        raise ConfigError(f"{KEY}: supports trl.GRPOTrainer only, got {type(trainer).__name__}")
    refusal = launch_refusal(trainer)
    if refusal is not None:
        raise ConfigError(refusal)


def unsupported_settings(args: Any) -> dict[str, tuple[bool, str]]:
    """{GRPOConfig key: (refused?, why)}: sampling the probe's q cannot represent, and loss terms its objectives
    (estimators/objectives.py) do not have — mirrored silently, they would make v another trainer's step."""
    q_only = "the probe's sampling policy is temperature + top-p only"
    return {"use_vllm": (args.use_vllm, "generation by vLLM is not the policy's own sampling"),
            "top_k": (args.top_k not in (0, None), q_only),
            "min_p": (args.min_p is not None, q_only),
            "repetition_penalty": (args.repetition_penalty != 1.0, "a penalty changes the sampled distribution"),
            "generation_kwargs": (bool(args.generation_kwargs), "extra generation settings are not mirrored"),
            "importance_sampling_level": (args.importance_sampling_level != "token",
                                          "sequence-level ratios (GSPO) have another gradient"),
            "mask_truncated_completions": (bool(args.mask_truncated_completions), "the probe keeps truncated ones"),
            "multi_objective_aggregation": (args.multi_objective_aggregation != "sum_then_normalize",
                                            "the probe sums the weighted rewards, then normalises"),
            "steps_per_generation": (args.steps_per_generation != args.gradient_accumulation_steps,
                                     (f"≠ gradient_accumulation_steps={args.gradient_accumulation_steps}: "
                                      "a generation that serves several optimizer steps is off-policy after the "
                                      "first; the callback follows rollout reuse through num_iterations only"))}


def objective_keys(args: Any) -> dict[str, Any]:
    """The probe's `objective` section for the GRPOConfig `args` (TRL's values, not the preset's defaults)."""
    return {"trainer": "trl", "loss_type": args.loss_type, "scale_rewards": args.scale_rewards,
            "kl_coef": float(args.beta), "max_grad_norm": args.max_grad_norm,
            "max_completion_length": args.max_completion_length, "micro_batches": args.gradient_accumulation_steps,
            "num_iterations": args.num_iterations, "top_entropy_quantile": args.top_entropy_quantile,
            # the adaptive controller's coefficient changes every step: `step_objective` sets the live one
            "entropy_coef": 0.0 if args.use_adaptive_entropy else float(args.entropy_coef),
            "off_policy_mask_threshold": args.off_policy_mask_threshold,
            "vllm_importance_sampling_correction": bool(args.use_vllm and args.vllm_importance_sampling_correction),
            # a TRL version without the switch applies no KL importance weight
            "use_bias_correction_kl": bool(getattr(args, "use_bias_correction_kl", False))}


def live_entropy_coef(trainer: Any) -> float:
    """The entropy coefficient the trainer's next step applies: `args.entropy_coef`, or with `use_adaptive_entropy`
    the controller's current `entropy_coef` gated on its last window's entropy (`_last_world_entropy`, TRL's
    attribute; estimators/entropy_terms.adaptive_entropy_coef)."""
    args = trainer.args
    if not args.use_adaptive_entropy:
        return float(args.entropy_coef)
    return adaptive_entropy_coef(trainer.entropy_coef, trainer._last_world_entropy, args.entropy_target)


def step_objective(config: ProbeConfig, trainer: Any) -> ProbeConfig:
    """`config` with the entropy coefficient of the trainer's next step (it moves under the adaptive controller)."""
    coef = live_entropy_coef(trainer)
    if config.objective.entropy_coef == coef:
        return config
    return config.model_copy(update={"objective": config.objective.model_copy(update={"entropy_coef": coef})})


def trainer_batch(args: Any) -> int:
    """Completions per optimizer step of the trainer (one process): per-device batch × accumulation steps."""
    return int(args.per_device_train_batch_size * args.gradient_accumulation_steps)


def probe_config(args: Any, *, B_E: int, B_U: int, G: int | None, seed: int, microbatch_size: int,
                 objective: dict | None = None) -> ProbeConfig:
    """A ProbeConfig mirroring the trainer (`objective_keys`, its sampling) at the callback's batch sizes;
    `objective` replaces the mirrored objective section (a mode that takes the trainer's own gradients)."""
    G = G or args.num_generations
    keys = objective if objective is not None else {**objective_keys(args),
                                                    "trainer_batch_completions": trainer_batch(args)}
    data = {"seed": seed,
            "batch_config": {"B_E": B_E, "B_U": B_U, "G": G, "chat_template_kwargs": args.chat_template_kwargs or {}},
            "generation": {"temperature": args.temperature, "top_p": args.top_p, "stop_strings": [],
                           "max_new_tokens": args.max_completion_length},
            "estimator": {"microbatch_size": microbatch_size}, "objective": keys,
            "importance": {"enabled": False}, "second_order": {"enabled": False}, "predictors": {"enabled": False}}
    try:
        return ProbeConfig.model_validate(data)
    except ValidationError as exc:  # pydantic's text ends in a link: say the key and the reason instead
        raise ConfigError(f"{KEY}: the trainer's settings cannot be probed: {config_error(exc)}") from None


def trainer_examples(trainer: Any) -> list:
    """The trainer's train_dataset as the probe's Examples (TRL's `prompt` column, every other column kept)."""
    return dataset_examples(trainer.train_dataset, "train", source="trainer.train_dataset")


def trainer_rewards(trainer: Any) -> RewardSet:
    """The trainer's reward functions with TRL's names and weights."""
    names = tuple(getattr(trainer, "reward_func_names", None) or [getattr(f, "__name__", repr(f))
                                                                   for f in trainer.reward_funcs])
    weights = tuple(float(w) for w in torch.as_tensor(trainer.reward_weights).tolist())
    return RewardSet(names, tuple(trainer.reward_funcs), weights)


def live_policy(trainer: Any, config: ProbeConfig) -> Policy:
    """The live model, tokenizer and AdamW as the probe's Policy; parameters in the optimizer's order."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    names_of = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [p for p in ordered if id(p) not in names_of]
    if missing or len(ordered) != len(names_of):
        raise ConfigError(f"{KEY}: the optimizer's parameters are not the model's trainable parameters "
                          f"({len(ordered)} in the optimizer, {len(names_of)} trainable)")
    trainable = Trainable(model, tuple(names_of[id(p)] for p in ordered), tuple(ordered))
    engine = PolicyEngine(model, trainer.processing_class, config.policy_settings(), apply_precision=False)
    return Policy(engine, trainable, optimizer, trainer.processing_class, {"layout": "live GRPOTrainer"})
