"""`make-checkpoint`: a real LoRA adapter with a real AdamW state, from a few Dr-GRPO steps.

Users without a checkpoint (and the tests) get one this way. Each step samples B_U distinct prompts
× G responses through the policy engine, takes the gradient of the same Dr-GRPO loss the probe
uses (`probe.recipe.update_gradients`), clips it and steps AdamW; then `save_checkpoint` writes
model/, optimizer.pt, optimizer_param_names.json and checkpoint.json. With `save_every` = K it writes
`out_dir/step_K/`, `step_2K/`, … and `step_<steps>/` instead (a run to sweep: `entropy-probe sweep`).
`ensure_demo_checkpoint`: the demo's checkpoint, made once this way in the embedded model's cache.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..checkpoint.adapter import create_lora_model
from ..checkpoint.base_model import load_tokenizer, resolve_base_model_id
from ..checkpoint.optimizer_state import trainable_named_parameters
from ..checkpoint.writer import save_checkpoint
from ..config import ProbeConfig
from ..data.datasets import load_examples
from ..data.plan import draw_index_plan
from ..data.rewards.weighted import RewardSet
from ..errors import ConfigError
from ..estimators.objective_gradient import Trainable
from ..models.embedded import cache_root
from ..policy.engine import PolicyEngine
from ..policy.progress import progress
from ..probe.recipe import Policy, update_gradients
from ..probe.sampling import BatchDraw, SamplingSpec, sample_batch, warn_zero_advantages

log = logging.getLogger("entropy_experiments.training")
DEMO_CHECKPOINT_STEPS = 1


def make_checkpoint(out_dir: str | Path, config: ProbeConfig, *, steps: int = 2, lr: float = 1e-5,
                    weight_decay: float = 0.01, max_grad_norm: float = 1.0, lora_r: int = 8,
                    lora_alpha: int = 16, save_every: int | None = None,
                    logger: logging.Logger | None = None) -> Path:
    """Create a LoRA adapter on `config.checkpoint.base_model` (null: the embedded model), train it `steps`
    Dr-GRPO steps, save it (in `out_dir`, or with `save_every` = K in out_dir/step_K/, step_2K/, … and the last)."""
    logger = logger or log
    if steps < 0:
        raise ValueError("--steps must be >= 0")
    if save_every is not None and save_every < 1:
        raise ConfigError(f"--save-every {save_every}: must be >= 1")
    ck, bc = config.checkpoint, config.batch_config
    base_model = resolve_base_model_id(ck.base_model, None).name  # no adapter yet: the config's or the embedded
    torch.manual_seed(config.seed)
    model = create_lora_model(base_model, r=lora_r, alpha=lora_alpha, dropout=0.0, dtype="fp32",
                              device_map=ck.device_map, seed=config.seed)
    model.eval()  # dropout is 0 anyway; the probe's passes also run in eval()
    tokenizer = load_tokenizer(base_model, trust_remote_code=ck.trust_remote_code)
    engine = PolicyEngine(model, tokenizer, config.policy_settings(), logger)
    policy = Policy(engine, Trainable.of(model), optimizer=None)
    named = trainable_named_parameters(model)
    params = [p for _, p in named]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    examples = load_examples(bc.dataset_name, bc.split, dataset_path=bc.dataset_path, pool_size=bc.pool_size,
                             columns=bc.column_options())

    rewards = RewardSet.resolve(config.reward.specs(), config.reward.weights, examples[0])
    mean_rewards = []

    def save(where: Path, step: int) -> None:
        save_checkpoint(model, optimizer, where, base_model=base_model, step=step, lr=lr,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                        lora={"r": lora_r, "alpha": lora_alpha, "dropout": 0.0,
                              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
                        data={"dataset_name": bc.dataset_name, "split": bc.split, "B_U": bc.B_U, "G": bc.G},
                        mean_rewards=list(mean_rewards))
        logger.info("checkpoint written to %s", where)

    spec = SamplingSpec.choose(engine, chat_template_kwargs=bc.chat_template_kwargs)
    for step in progress(range(steps), "make-checkpoint (Dr-GRPO steps)"):
        plan = draw_index_plan(len(examples), B_E=1, B_U=bc.B_U, G=bc.G, E_sampling_mode="replacement",
                               seed=config.seed + 1000 * (step + 1))
        U = sample_batch(spec, examples, BatchDraw(plan.U_prompt_indices, bc.G, config.seed + 1000 * (step + 1) + 1,
                                                   rewards, "U"))
        warn_zero_advantages(U, logger.warning, logger)  # all zero: this step is weight decay only
        grads = update_gradients(config, policy, U, [list(range(U.num_prompts))]).total
        for name, p in named:
            p.grad = grads[name].to(p.dtype)
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_rewards.append(float(sum(map(sum, U.rewards)) / (bc.B_U * bc.G)))
        logger.info("make-checkpoint step %d/%d: mean reward %.3f", step + 1, steps, mean_rewards[-1])
        if save_every is not None and ((step + 1) % save_every == 0 or step + 1 == steps):
            save(Path(out_dir) / f"step_{step + 1}", step + 1)

    if save_every is None:
        save(Path(out_dir), steps)
    return Path(out_dir)


def demo_checkpoint_dir(steps: int = DEMO_CHECKPOINT_STEPS) -> Path:
    """Where the demo checkpoint of `steps` Dr-GRPO steps is cached, beside the embedded model (one directory
    per step count, so `demo --steps N` never silently reuses a checkpoint of another length)."""
    return cache_root() / f"demo_checkpoint_{steps}steps"


def ensure_demo_checkpoint(config: ProbeConfig, steps: int = DEMO_CHECKPOINT_STEPS) -> Path:
    """The cached demo checkpoint (made once with make-checkpoint on `config`); returns its directory."""
    ckpt = demo_checkpoint_dir(steps)
    if not (ckpt / "checkpoint.json").exists():
        log.info("demo: making the demo checkpoint once (%d Dr-GRPO steps) in %s", steps, ckpt)
        make_checkpoint(ckpt, config, steps=steps)
    else:
        log.info("demo: reusing the cached demo checkpoint %s", ckpt)
    return ckpt
