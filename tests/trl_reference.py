"""TRL's own GRPO loss, run on given per-token log-probs: an independent reference for our objectives.

`trl_loss` calls the real, unbound `trl.GRPOTrainer._compute_loss` (trl 1.16.0,
trl/trainer/grpo_trainer.py L3020–3290) with a lightweight stand-in for `self`. The stand-in's
`_get_per_token_logps_and_entropies` returns the caller's [N, T] log-prob tensor (with its autograd
graph) and entropies instead of running the model, so TRL's own loss code — ratios, clipping, KL,
aggregation per loss_type, gradient-accumulation scaling, entropy bonus, and its metric logging tail —
runs unchanged without generation. Lines of grpo_trainer.py exercised (trl 1.16.0):

- L3020–3047  inputs, `mask = completion_mask` (no tool_mask), the log-prob/entropy call (stand-in);
- L3049–3052  the high-entropy mask by TRL's own `get_high_entropy_mask` (L1380–1416) when `top_entropy_quantile`
  < 1 (one process: `pad_across_processes` and `gather` are the identity), else none;
- L3054–3066  advantages [N] → [N, 1]; `old_per_token_logps` = `per_token_logps.detach()` when absent
  (on-policy: every ratio is 1, clipping inactive);
- L3068–3095  off-policy mask skipped (`off_policy_mask_threshold=None`); token- or sequence-level
  log importance weights; `coef_1 = exp(...)`;
- L3097–3105  k3 KL `exp(ref − ℓ) − (ref − ℓ) − 1` when β ≠ 0, times `coef_1` (the differentiable ratio
  exp(ℓ − ℓ_old), 1 on-policy) when `args.use_bias_correction_kl` (the caller's, default True as TRL's);
- L3109–3120  the clipped surrogate `−min(coef_1·A, clamp(coef_1)·A)` (`args.delta=None`);
- L3140–3150  no entropy mask; the vLLM IS ratio `per_token_loss × inputs["importance_sampling_ratio"]` when
  `vllm_importance_sampling_ratio` is given (`use_vllm` and the correction on), else none; `+ β·KL`;
- L3152–3184  aggregation: grpo (per-sequence token mean, mean over rows, ÷ GA), bnpo (token mean of
  the micro-batch, ÷ GA), dr_grpo (Σ ÷ (rows · max_completion_length), ÷ GA), dapo (Σ ÷
  (num_items_in_batch / num_processes · GA / steps_per_generation)), luspo (per-sequence token sum,
  mean over rows, ÷ GA); GA = `current_gradient_accumulation_steps`;
- L3189–3245  entropy bonus `− c · Σ H·m / Σ m / GA` (m: the mask times the high-entropy mask), c the static
  coefficient or, with `use_adaptive_entropy`, the controller's gate on the given `_last_world_entropy`, and its
  logging (the controller's update then runs on the stand-in and is discarded); L3247–3251 (MoE aux loss) skipped (`aux_loss_enabled=False`);
- L3253–3290  metric logging (`_metrics`, `accelerator.reduce/gather`), then `return loss`.

How the trainer feeds micro-batches (mirrored by `trl_loss_over_micro_batches`):
- `GRPOConfig.__post_init__` (grpo_config.py L1098–1100): steps_per_generation defaults to
  gradient_accumulation_steps, generation batch = per_device_train_batch_size · processes · that;
- `_generate_and_score_completions` L2497–2498: `num_items_in_batch = gather(loss_mask.sum()).sum()`,
  the completion-token count of the whole generation batch over all processes (a 0-dim tensor);
- `_prepare_inputs` L1541–1546: the generation batch is shuffled in unison (`shuffle_sequence_dict`,
  one `torch.randperm` from the global RNG), then cut into steps_per_generation contiguous equal chunks
  (`split_tensor_dict`; 0-dim tensors such as num_items_in_batch are copied to every chunk); one chunk
  per `training_step`;
- `GRPOTrainer.loss_is_scaled_for_ga = True` (L285): the HF Trainer does not divide the loss again, so
  the accumulated gradient is the gradient of the plain sum of the micro-batch losses.

The vLLM importance-sampling ratio (`trl_vllm_importance_sampling_ratio`) is formed in
`_generate_and_score_completions` (L2660–2707) under no_grad and handed to `_compute_loss` as
`inputs["importance_sampling_ratio"]`. That method cannot be called in isolation either, so the function takes
the block `if self.use_vllm and self.vllm_importance_sampling_correction:` out of TRL's installed source (its
first such block, `inspect.getsource`) and executes it unchanged, with the stand-in's settings and the given
old / sampling log-probs and mask in its namespace.

Advantages (`trl_advantages`): they are computed inside `_generate_and_score_completions` (L2761–2810,
single reward function, `multi_objective_aggregation="sum_then_normalize"`), which cannot be called in
isolation (it generates, scores and logs). `trl_advantages` mirrors those lines, with TRL's own
`trl.trainer.utils.nanstd` (Bessel-corrected) and ε = 1e-4.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


class OneProcessAccelerator:
    """One process: gather / reduce are the identity (what accelerate does with num_processes = 1)."""

    num_processes = 1
    process_index = 0
    sync_gradients = True

    @staticmethod
    def gather(tensor):
        return tensor.reshape(-1) if tensor.dim() == 0 else tensor

    gather_for_metrics = gather

    @staticmethod
    def reduce(tensor, reduction="sum"):
        return tensor

    @staticmethod
    def pad_across_processes(tensor, dim=0, pad_index=0):
        return tensor


def _stand_in_self(per_token_logps, entropies, *, loss_type, beta, epsilon_low, epsilon_high,
                   importance_sampling_level, entropy_coef, max_completion_length,
                   gradient_accumulation_steps, steps_per_generation, use_vllm=False, use_bias_correction_kl=True,
                   entropy_controls=None):
    """The attributes of GRPOTrainer that `_compute_loss` reads, with the training model replaced; `entropy_controls`:
    {top_entropy_quantile, use_adaptive_entropy, last_world_entropy, entropy_target} (TRL's names; off when None)."""
    from trl import GRPOTrainer

    n_rows, n_tokens = per_token_logps.shape
    controls = {"top_entropy_quantile": 1.0, "use_adaptive_entropy": False, "last_world_entropy": float("inf"),
                "entropy_target": 0.2, **(entropy_controls or {})}

    def _get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        if logits_to_keep != n_tokens or input_ids.shape[0] != n_rows:
            raise AssertionError(f"unexpected call: logits_to_keep={logits_to_keep}, rows={input_ids.shape[0]}")
        return per_token_logps, entropies, None

    args = SimpleNamespace(delta=None, use_bias_correction_kl=use_bias_correction_kl,
                           steps_per_generation=steps_per_generation, entropy_target=controls["entropy_target"],
                           entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0)
    adaptive = controls["use_adaptive_entropy"]
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=_get_per_token_logps_and_entropies,
        loss_type=loss_type, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
        importance_sampling_level=importance_sampling_level, top_entropy_quantile=controls["top_entropy_quantile"],
        off_policy_mask_threshold=None, use_vllm=use_vllm, vllm_importance_sampling_correction=use_vllm,
        entropy_coef=entropy_coef, use_adaptive_entropy=adaptive, _entropy_bonus_enabled=entropy_coef != 0.0 or adaptive,
        _last_world_entropy=controls["last_world_entropy"], _entropy_window_stats=None,
        aux_loss_enabled=False, current_gradient_accumulation_steps=gradient_accumulation_steps,
        max_completion_length=max_completion_length, accelerator=OneProcessAccelerator(), args=args,
        model=SimpleNamespace(training=True), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    stand_in.get_high_entropy_mask = lambda *a: GRPOTrainer.get_high_entropy_mask(stand_in, *a)  # TRL's own
    return stand_in


def _inputs(completion_mask, advantages, num_items_in_batch, ref_per_token_logps, old_per_token_logps,
            importance_sampling_ratio=None):
    """The micro-batch dict `_compute_loss` receives (dummy one-token prompts; ids are never used)."""
    n_rows, n_tokens = completion_mask.shape
    inputs = {
        "prompt_ids": torch.zeros(n_rows, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n_rows, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n_rows, n_tokens, dtype=torch.long),
        "completion_mask": completion_mask.long(),  # TRL's masks are integer tensors
        "advantages": advantages,
        "num_items_in_batch": num_items_in_batch,
    }
    if ref_per_token_logps is not None:
        inputs["ref_per_token_logps"] = ref_per_token_logps
    if old_per_token_logps is not None:
        inputs["old_per_token_logps"] = old_per_token_logps
    if importance_sampling_ratio is not None:
        inputs["importance_sampling_ratio"] = importance_sampling_ratio
    return inputs


def trl_loss(per_token_logps, completion_mask, advantages, *, loss_type, beta=0.0, ref_per_token_logps=None,
             entropies=None, entropy_coef=0.0, max_completion_length=None, gradient_accumulation_steps=1,
             steps_per_generation=None, num_items_in_batch=None, old_per_token_logps=None, epsilon=0.2,
             epsilon_high=None, importance_sampling_level="token", importance_sampling_ratio=None,
             use_bias_correction_kl=True, entropy_controls=None, return_metrics=False):
    """TRL's loss for ONE micro-batch, from `GRPOTrainer._compute_loss` itself.

    Args:
        per_token_logps: [N, T] log-probs of the completion tokens (keep the autograd graph to get
            TRL's gradient); completion_mask: [N, T] 0/1; advantages: [N].
        loss_type: "grpo", "bnpo", "dr_grpo", "dapo", "luspo" (tested), or "cispo" (runs, untested); "sapo"
            and "vespo" read `args` fields the stand-in does not provide and are refused.
        beta, ref_per_token_logps: k3 KL coefficient and the reference log-probs [N, T] (needed if beta ≠ 0).
        use_bias_correction_kl: GRPOConfig's switch (default True, TRL 1.16's default): the KL times coef_1.
        entropies: [N, T] (zeros when None; needed with entropy_coef ≠ 0).
        max_completion_length: TRL's L for dr_grpo (default T).
        gradient_accumulation_steps: TRL's current_gradient_accumulation_steps (micro-batches per step).
        steps_per_generation: default gradient_accumulation_steps (GRPOConfig's default).
        num_items_in_batch: completion tokens of the whole generation batch (dapo/cispo/vespo); default
            this micro-batch's count, allowed only when the micro-batch is the whole generation batch.
        old_per_token_logps: default none, i.e. on-policy (TRL uses per_token_logps.detach()).
        importance_sampling_ratio: [N, T] or [N, 1] vLLM IS ratio (`trl_vllm_importance_sampling_ratio`); given,
            the stand-in has `use_vllm` and `vllm_importance_sampling_correction` on; None: both off.
        entropy_controls: {top_entropy_quantile, use_adaptive_entropy, last_world_entropy, entropy_target}: TRL's
            high-entropy mask (`get_high_entropy_mask`, TRL's own method) and adaptive controller state.
        return_metrics: also return the `_metrics["train"]` dict TRL logged.
    """
    from trl import GRPOTrainer

    if loss_type not in (*LOSS_TYPES, "cispo"):
        raise ValueError(f"loss_type {loss_type!r} is not supported by this reference")
    steps_per_generation = gradient_accumulation_steps if steps_per_generation is None else steps_per_generation
    if entropies is None:
        if entropy_coef != 0.0:
            raise ValueError("entropy_coef != 0 needs entropies")
        entropies = torch.zeros_like(per_token_logps).detach()
    if beta != 0.0 and ref_per_token_logps is None:
        raise ValueError("beta != 0 needs ref_per_token_logps")
    if num_items_in_batch is None:
        if steps_per_generation != 1 and loss_type in ("dapo", "cispo", "vespo"):
            raise ValueError("num_items_in_batch must count the whole generation batch when steps_per_generation > 1")
        num_items_in_batch = completion_mask.long().sum()
    num_items_in_batch = torch.as_tensor(num_items_in_batch)
    stand_in = _stand_in_self(
        per_token_logps, entropies, loss_type=loss_type, beta=beta, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        importance_sampling_level=importance_sampling_level, entropy_coef=entropy_coef,
        max_completion_length=per_token_logps.shape[1] if max_completion_length is None else max_completion_length,
        gradient_accumulation_steps=gradient_accumulation_steps, steps_per_generation=steps_per_generation,
        use_vllm=importance_sampling_ratio is not None, use_bias_correction_kl=use_bias_correction_kl,
        entropy_controls=entropy_controls)
    inputs = _inputs(completion_mask, advantages, num_items_in_batch, ref_per_token_logps, old_per_token_logps,
                     importance_sampling_ratio)
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    return (loss, dict(stand_in._metrics["train"])) if return_metrics else loss


def trl_loss_over_micro_batches(per_token_logps, completion_mask, advantages, *, num_micro_batches, loss_type,
                                ref_per_token_logps=None, entropies=None, order=None, **kwargs):
    """Σ over M micro-batches of TRL's loss: the objective whose gradient one TRL optimizer step uses.

    The N rows (one generation batch, one process) are optionally permuted by `order` (TRL shuffles
    with `shuffle_sequence_dict`; only bnpo and the entropy bonus depend on the split), then cut into
    M = num_micro_batches contiguous equal chunks as `split_tensor_dict` does. Each chunk's loss is
    `trl_loss` with gradient_accumulation_steps = steps_per_generation = M and num_items_in_batch =
    the completion tokens of all N rows; the Trainer back-propagates each and the gradients add up.
    Other keyword arguments go to `trl_loss`.
    """
    n_rows = per_token_logps.shape[0]
    if n_rows % num_micro_batches:
        raise ValueError(f"{n_rows} rows do not split into {num_micro_batches} equal micro-batches")
    rows = torch.arange(n_rows) if order is None else torch.as_tensor(order)
    size = n_rows // num_micro_batches
    num_items = completion_mask.long().sum()
    ratio = kwargs.pop("importance_sampling_ratio", None)

    def take(tensor, k):
        return None if tensor is None else tensor[rows[k * size:(k + 1) * size]]

    total = 0.0
    for k in range(num_micro_batches):
        total = total + trl_loss(
            take(per_token_logps, k), take(completion_mask, k), take(advantages, k), loss_type=loss_type,
            ref_per_token_logps=take(ref_per_token_logps, k), entropies=take(entropies, k),
            gradient_accumulation_steps=num_micro_batches, steps_per_generation=num_micro_batches,
            num_items_in_batch=num_items, importance_sampling_ratio=take(ratio, k), **kwargs)
    return total


def _vllm_ratio_block() -> str:
    """The lines of `_generate_and_score_completions` that form the vLLM IS ratio (see the module docstring)."""
    from trl import GRPOTrainer

    lines = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    head = "if self.use_vllm and self.vllm_importance_sampling_correction:"
    start = next(i for i, line in enumerate(lines) if line.strip() == head)
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    block = textwrap.dedent("\n".join(lines[start:end]))
    if "vllm_importance_sampling_ratio = torch.exp(logps_diff)" not in block:
        raise AssertionError(f"TRL's ratio block is not where this reference expects it:\n{block}")
    return block


def trl_vllm_importance_sampling_ratio(old_per_token_logps, sampling_per_token_logps, completion_mask, *, mode,
                                       clip_min=None, clip_max=3.0):
    """TRL's vLLM importance-sampling ratio, by TRL's own lines (grpo_trainer.py L2660–2707, trl 1.16.0).

    old / sampling log-probs and the 0/1 mask: [N, T]; returns [N, T] (token_* modes) or [N, 1] (sequence_*).
    """
    stand_in = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                               vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                               vllm_importance_sampling_clip_max=clip_max)
    namespace = {"self": stand_in, "torch": torch, "math": math, "tool_mask": None,
                 "completion_mask": completion_mask.long(), "old_per_token_logps": old_per_token_logps,
                 "sampling_per_token_logps": sampling_per_token_logps}
    exec(_vllm_ratio_block(), namespace)  # noqa: S102 - TRL's own source, as installed
    return namespace["vllm_importance_sampling_ratio"]


def trl_advantages(rewards, num_generations, scale_rewards="group"):
    """Advantages as `_generate_and_score_completions` forms them (grpo_trainer.py L2761–2787, L2810).

    rewards: [B·G] in TRL's order (each prompt's G completions consecutive); scale_rewards: "group"
    (TRL's default), "batch" or "none". One reward function of weight 1, no unscorable (NaN) rows.
    """
    from trl.trainer.utils import nanstd

    rewards = torch.as_tensor(rewards)
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ("group", "none"):
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    elif scale_rewards == "batch":
        std_rewards = nanstd(rewards).expand_as(rewards)
    else:
        raise ValueError(f"Invalid value for scale_rewards: {scale_rewards}")
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def assert_same_gradient(ours, theirs, wrt) -> None:
    """The gradients of two losses with respect to each tensor of `wrt` agree to 1e-6 (relative to TRL's scale)."""
    g_ours = torch.autograd.grad(ours, wrt, retain_graph=True)
    g_trl = torch.autograd.grad(theirs, wrt, retain_graph=True)
    for a, b in zip(g_ours, g_trl):
        scale = b.abs().max().item()
        assert scale > 0
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6 * scale), (a - b).abs().max()


def padded_independent_logps(model, U, temperature):
    """([B·G, T_max] trainer log-probs (graph) of every U response by an unpadded forward per sequence, the mask):
    an independent reference for the probe's padded teacher forcing."""
    rows, lengths = [], []
    for b in range(U.num_prompts):
        for g in range(U.num_responses_per_prompt):
            T, end = U.gen_lens[b][g], U.prompt_lens[b] + U.gen_lens[b][g]
            ids = U.sequences[b, g][:end][U.attention_masks[b, g][:end].bool()]
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].double() / temperature, dim=-1)
            rows.append(logp[-T - 1:-1].gather(-1, ids[-T:, None]).squeeze(-1))
            lengths.append(T)
    width = max(lengths)
    padded = torch.stack([torch.cat([r, r.new_zeros(width - len(r))]) for r in rows])
    return padded, (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).double()


def random_loss_batch(seed: int, B: int, G: int) -> tuple[tuple, torch.Generator]:
    """((padded [B·G, T] log-probs (leaf, float64), mask, rewards [B, G] with one constant group, lengths,
    reference log-probs, entropies (leaf)), the generator — whose next draws a caller may add to the batch)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (B, G), generator=gen)
    T = int(lengths.max())
    logps = -3 * torch.rand(B * G, T, generator=gen, dtype=torch.float64)
    mask = (torch.arange(T)[None, :] < lengths.reshape(-1, 1)).to(torch.float64)
    rewards = torch.randint(0, 4, (B, G), generator=gen).double()
    rewards[1] = 2.0
    ref = logps + 0.2 * torch.randn(logps.shape, generator=gen, dtype=torch.float64)
    # float32 values (held in float64), as TRL's model gives them: its high-entropy mask compares them with its float32
    # quantile, so a float64 entropy that float32 rounds up would fall below a threshold that is its own value
    entropies = (2 * torch.rand(logps.shape, generator=gen, dtype=torch.float64)).float().double()
    return (logps.requires_grad_(True), mask, rewards, lengths, ref, entropies.requires_grad_(True)), gen


def token_statistics(entropies, logps, lengths):
    """The probe's `TokenStatistics` (no graph) of a padded [B·G, T] batch: what its no-grad pass over U gives."""
    from entropy_experiments.estimators.entropy_terms import TokenStatistics

    rows = [int(t) for t in lengths.reshape(-1)]
    ents = tuple((torch.zeros(T) if entropies is None else entropies[n, :T]).detach() for n, T in enumerate(rows))
    return TokenStatistics(ents, tuple(logps[n, :T].detach() for n, T in enumerate(rows)))


def probe_loss(logps, rewards, lengths, options, ref=None, entropies=None, sampler=None):
    """The probe's objective (`estimators/objectives.sequence_loss`) summed over a padded [B·G, T] batch; with
    `sampler` log-probs, TRL's vLLM importance-sampling ratios from `options.vllm_correction`; the entropy controls'
    per-token weights (when the options have any) from the batch's own entropies and log-probs."""
    from entropy_experiments.estimators import objectives

    B, G = lengths.shape
    stats = token_statistics(entropies, logps, lengths) if options.needs_token_statistics else None
    terms = objectives.batch_terms(rewards, lengths, options, stats)
    correction = options.vllm_correction
    total = 0.0
    for p in range(B):
        for g in range(G):
            n, T = p * G + g, int(lengths[p, g])
            total = total + objectives.sequence_loss(
                logps[n, :T], terms[p][g], options, ref_logps=None if ref is None else ref[n, :T],
                entropies=None if entropies is None else entropies[n, :T],
                sampler_ratios=None if sampler is None else correction.ratios(logps[n, :T], sampler[n, :T]))
    return total
