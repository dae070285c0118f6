"""The trainer objectives L_U, each defined once (docs/maths.md §4, docs/objectives.md).

v must be the step the user's trainer takes next, so U's gradient is the gradient of that trainer's
loss at its first, on-policy optimizer step after generation (ratio 1: clipping inactive). Every
objective here has the form

    L_U(θ) = Σ_pg w_pg Σ_t [ −ρ_pgt m_pgt A_pg ℓ_pgt(θ) + β·kl_pgt(θ)·r_pgt(θ) ]  −  c · Σ_pg u_pg Σ_t m'_pgt H_pgt(θ)

with ℓ the TRAINER's per-token log-prob (logits / τ, no top-p), A the advantages, kl a per-token KL
estimate against the reference (the base model: the same network with the adapter disabled), r TRL's
KL importance weight exp(ℓ − sg ℓ) under `use_bias_correction_kl` (value 1 on-policy, gradient ∇ℓ; else 1), H the
trainer's per-token entropy, ρ TRL's importance-sampling ratio to the sampler when U was drawn by another
sampler and `vllm_importance_sampling_correction` is on (vllm_correction.py; else 1; no graph), m, m' the entropy
controls' per-token weights (entropy_terms.py: TRL's high-entropy mask, verl's Clip-Cov; else 1; no graph), and
per-sequence token weights w_pg, u_pg that depend only on the batch's lengths (no graph). So the loss of U is a sum of per-sequence terms and can be
back-propagated one microbatch of prompts at a time.

Loss aggregations (`LOSS_WEIGHTS`, canonical TRL names; verl names in `LOSS_ALIASES`), B prompts × G:

| loss_type            | w_pg                              |
|----------------------|-----------------------------------|
| dr_grpo_per_prompt   | 1 / (B · G · L_max,p)             |  the seeds' trainer (default)
| grpo                 | 1 / (B · G · T_pg)                |  seq-mean-token-mean
| bnpo                 | 1 / (M · Σ_{micro-batch} T)       |  token mean per micro-batch, M micro-batches
| dapo                 | 1 / Σ_pg T_pg                     |  token-mean over the whole U
| dr_grpo              | 1 / (B · G · L_const)             |  seq-mean-token-sum-norm
| luspo                | 1 / (B · G)                       |  seq-mean-token-sum

Micro-batches are the M contiguous equal slices of U in (prompt, response) order (TRL shuffles the
generation batch before splitting it, so `bnpo` with M > 1 reproduces TRL's normaliser only in
distribution). The entropy bonus is aggregated like the loss (`entropy_aggregation: loss`, verl) or
as a token mean per micro-batch (`token_mean`, TRL: u_pg = 1 / (M · Σ_{micro-batch} T)).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError, closest_match
from ..registry import registrar
from .entropy_terms import TokenStatistics, control_refusal, control_weights
from .trainer_presets import TRAINER_PRESETS
from .vllm_correction import VllmCorrection, vllm_correction

ADVANTAGE_SCALINGS = ("none", "group", "batch")
KL_ESTIMATORS = ("k3", "low_var_kl", "k1", "k2")
ENTROPY_AGGREGATIONS = ("loss", "token_mean")
CORRECTION_KEYS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                   "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")
LOSS_ALIASES = {
    "token-mean": "dapo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum": "luspo",
    "seq-mean-token-sum-norm": "dr_grpo",
}


@dataclass(frozen=True)
class ObjectiveOptions:
    """The resolved objective of the trainer that made the checkpoint (config section `objective`)."""

    loss_type: str = "dr_grpo_per_prompt"
    scale_rewards: str = "none"
    advantage_eps: float = 1e-4
    max_completion_length: int | None = None   # L_const of dr_grpo (None: generation.max_new_tokens)
    micro_batches: int = 1
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    entropy_aggregation: str = "loss"
    max_grad_norm: float | None = None
    trainer: str | None = None                 # the preset the values came from, for the record
    # TRL's vLLM importance-sampling correction (vllm_correction.py; TRL's names and, for mode and bounds,
    # TRL's defaults); off: the probe's U is taken as sampled by the policy it scores.
    vllm_importance_sampling_correction: bool = False
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0
    # TRL's use_bias_correction_kl (TRL's name; True in the trl preset, TRL's default): the per-token KL is
    # multiplied by the token's importance ratio exp(ℓ − ℓ_old), 1 on-policy but differentiable (`sequence_loss`).
    use_bias_correction_kl: bool = False
    # Recorded, never acting on the probed step: ε, ε_high (ratio 1 on-policy), num_iterations (checkpoint/rollouts.py)
    epsilon: float | None = None
    epsilon_high: float | None = None
    num_iterations: int = 1
    # Entropy controls (entropy_terms.py): TRL's high-entropy token mask (1.0: off), verl's policy_loss.loss_mode
    # with its Clip-Cov band (KL-Cov's penalty has no gradient on-policy: kl_cov is vanilla's gradient).
    top_entropy_quantile: float = 1.0
    policy_loss: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0

    @property
    def needs_token_statistics(self) -> bool:
        """Whether per-token weights need a no-grad pass over U first (TRL's entropy mask, verl's Clip-Cov)."""
        return self.top_entropy_quantile < 1.0 or self.policy_loss == "clip_cov"

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef != 0.0

    @property
    def weights_kl(self) -> bool:
        """Whether TRL's KL importance weight changes the gradient (use_bias_correction_kl with β ≠ 0)."""
        return self.use_bias_correction_kl and self.needs_reference

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0.0

    @property
    def vllm_correction(self) -> VllmCorrection | None:
        """The importance-sampling correction of a U batch drawn by another sampler (None: off)."""
        return vllm_correction(self.trainer, self.vllm_importance_sampling_correction,
                                  self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
                                  self.vllm_importance_sampling_clip_max)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- advantages

def advantages(rewards: Tensor, scale_rewards: str = "none", eps: float = 1e-4) -> Tensor:
    """A_pg from rewards [B, G] (float64 out).

    none: r − mean_g r; group: (r − mean_g r) / (std_g r + ε); batch: (r − mean_g r) / (std(all r) + ε);
    std with Bessel's correction (torch.std), as TRL's `nanstd`. A constant group has A = 0 in all.
    """
    if scale_rewards not in ADVANTAGE_SCALINGS:
        raise ConfigError(f"objective.scale_rewards: expected one of {ADVANTAGE_SCALINGS}, got {scale_rewards!r}")
    r = rewards.to(torch.float64)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = r.std(dim=1, keepdim=True) if r.shape[1] > 1 else torch.zeros_like(r[:, :1])
    else:
        std = r.std() if r.numel() > 1 else torch.zeros(())
    return centred / (std + eps)


def batch_advantages(rewards: list[list[float]]) -> Tensor:
    """The packed U batch's advantages (batch contract, docs/development.md "Layout"): A = r − mean_g r, float32 [B, G]; the
    trainer objective forms its own, possibly std-scaled, advantages from the rewards (`advantages`)."""
    return advantages(torch.tensor(rewards, dtype=torch.float32)).float()


# ----------------------------------------------------------------------------- token weights


def micro_batch_token_counts(lengths: Tensor, micro_batches: int) -> Tensor:
    """Σ T over the micro-batch of each sequence. lengths [B, G] → [B, G] float64.

    The B·G sequences in (prompt, response) order are split into `micro_batches` equal slices.
    """
    flat = lengths.reshape(-1).to(torch.float64)
    n = flat.numel()
    if micro_batches < 1 or n % micro_batches:
        raise ConfigError(f"objective.micro_batches: must divide the {n} U sequences (B_U·G), got {micro_batches}")
    per = flat.reshape(micro_batches, n // micro_batches)
    return per.sum(dim=1, keepdim=True).expand_as(per).reshape(lengths.shape)


# An aggregation: weights(lengths [B, G], options) -> w [B, G] (float64, no graph).
WeightFn = Callable[[Tensor, ObjectiveOptions], Tensor]
LOSS_WEIGHTS: dict[str, WeightFn] = {}
# Decorator: `@register_loss_type("name")` on the weight function, where it is defined (registry.py's style).
register_loss_type: Callable[[str], Callable[[WeightFn], WeightFn]] = registrar(LOSS_WEIGHTS, "loss_type")


@register_loss_type("dr_grpo_per_prompt")
def dr_grpo_per_prompt_weights(lengths: Tensor, options: ObjectiveOptions) -> Tensor:
    B, G = lengths.shape
    l_max = lengths.to(torch.float64).amax(dim=1, keepdim=True)
    return (1.0 / (B * G * l_max)).expand(B, G)


@register_loss_type("grpo")
def grpo_weights(lengths: Tensor, options: ObjectiveOptions) -> Tensor:
    return 1.0 / (lengths.numel() * lengths.to(torch.float64))


@register_loss_type("bnpo")
def bnpo_weights(lengths: Tensor, options: ObjectiveOptions) -> Tensor:
    return 1.0 / (options.micro_batches * micro_batch_token_counts(lengths, options.micro_batches))


@register_loss_type("dapo")
def dapo_weights(lengths: Tensor, options: ObjectiveOptions) -> Tensor:
    return torch.full(lengths.shape, 1.0 / float(lengths.sum()), dtype=torch.float64)


@register_loss_type("dr_grpo")
def dr_grpo_weights(lengths: Tensor, options: ObjectiveOptions) -> Tensor:
    if options.max_completion_length is None:
        raise ConfigError("objective.max_completion_length: dr_grpo needs the trainer's constant length")
    return torch.full(lengths.shape, 1.0 / (lengths.numel() * options.max_completion_length), dtype=torch.float64)


@register_loss_type("luspo")
def luspo_weights(lengths: Tensor, options: ObjectiveOptions) -> Tensor:
    return torch.full(lengths.shape, 1.0 / lengths.numel(), dtype=torch.float64)


# Loss types a trainer has whose gradient the probe does not mirror (another per-token weight than the
# clipped-ratio one of `LOSS_WEIGHTS`): named as such, never answered with a look-alike suggestion.
UNMIRRORED_LOSS_TYPES = {"cispo": "TRL", "sapo": "TRL", "vespo": "TRL"}


def unmirrored_loss_type(name: str) -> str | None:
    """'TRL's loss_type 'cispo' is not supported by the probe; supported: …' for a trainer's loss type the probe
    does not mirror, else None."""
    trainer = UNMIRRORED_LOSS_TYPES.get(name)
    if trainer is None:
        return None
    return f"{trainer}'s loss_type {name!r} is not supported by the probe; supported: {', '.join(sorted(LOSS_WEIGHTS))}"


def canonical_loss_type(name: str) -> str:
    """The registry name of `name` (verl aliases mapped); ConfigError for an unknown one."""
    name = LOSS_ALIASES.get(name, name)
    unmirrored = unmirrored_loss_type(name)
    if unmirrored is not None:
        raise ConfigError(f"objective.loss_type: {unmirrored}")
    if name not in LOSS_WEIGHTS:
        known = sorted(LOSS_WEIGHTS) + sorted(LOSS_ALIASES)
        hint = closest_match(name, known)
        raise ConfigError(f"objective.loss_type: unknown {name!r}; expected one of {', '.join(known)}"
                          + (f" (did you mean {hint!r}?)" if hint else ""))
    return name


def token_weights(lengths: Tensor, options: ObjectiveOptions) -> Tensor:
    """w_pg of the policy (and KL) term. lengths [B, G] → [B, G] float64."""
    return LOSS_WEIGHTS[canonical_loss_type(options.loss_type)](lengths, options)


def entropy_weights(lengths: Tensor, options: ObjectiveOptions) -> Tensor:
    """u_pg of the entropy bonus. lengths [B, G] → [B, G] float64 (zeros when entropy_coef is 0)."""
    if not options.needs_entropy:
        return torch.zeros(lengths.shape, dtype=torch.float64)
    if options.entropy_aggregation == "token_mean":
        return 1.0 / (options.micro_batches * micro_batch_token_counts(lengths, options.micro_batches))
    return token_weights(lengths, options)


def leave_one_out_scales(lengths: Tensor, groups: list[list[int]], options: ObjectiveOptions) -> list[float]:
    """c_k with g₍₋k₎ = c_k·(g − g_k): the ratio of the loss's normaliser Z to Z without prompt group k.

    Z = B (dr_grpo_per_prompt), B·G (grpo, dr_grpo, luspo) or Σ T (dapo; also bnpo, whose
    per-micro-batch normalisers have no leave-one-out form: the total token count stands in).
    Advantages (including a batch std) are held at their whole-batch values in the replicates.
    """
    kind = canonical_loss_type(options.loss_type)
    if kind in ("dapo", "bnpo"):
        per_prompt = lengths.to(torch.float64).sum(dim=1)
    else:
        per_prompt = torch.ones(lengths.shape[0], dtype=torch.float64)
    total = float(per_prompt.sum())
    return [total / (total - float(per_prompt[group].sum())) for group in groups]


# ----------------------------------------------------------------------------- per-token terms

def kl_per_token(logps: Tensor, ref_logps: Tensor, estimator: str = "k3") -> Tensor:
    """KL(π‖π_ref) per token from the sampled tokens. [T], [T] → [T] (graph through `logps`).

    k3 (TRL): exp(ref − ℓ) − (ref − ℓ) − 1; low_var_kl (verl's low_var_kl and k3, OpenRLHF's k3): the
    same with ref − ℓ clamped to ±20 and the result clamped to ±10; k1: ℓ − ref; k2: (ℓ − ref)² / 2
    (verl's k1 / k2; the gradient of k2 is also that of verl's "+" types and OpenRLHF's unbiased_gradient).
    """
    delta = ref_logps.detach().to(logps.dtype) - logps
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta * delta
    if estimator == "k3":
        return torch.exp(delta) - delta - 1.0
    if estimator == "low_var_kl":
        delta = delta.clamp(-20.0, 20.0)
        return (torch.exp(delta) - delta - 1.0).clamp(-10.0, 10.0)
    raise ConfigError(f"objective.kl_estimator: expected one of {KL_ESTIMATORS}, got {estimator!r}")


@dataclass(frozen=True)
class SequenceTerms:
    """What one U sequence contributes: its advantage and its two token weights (floats, no graph)."""

    advantage: float
    weight: float
    entropy_weight: float
    policy_mask: Tensor | None = None    # [T] per-token multiplier of the policy term (entropy_terms.py)
    entropy_mask: Tensor | None = None   # [T] per-token multiplier of the entropy bonus


def sequence_loss(logps: Tensor, terms: SequenceTerms, options: ObjectiveOptions, *,
                  ref_logps: Tensor | None = None, entropies: Tensor | None = None,
                  sampler_ratios: Tensor | None = None) -> Tensor:
    """w·Σ_t [−ρ_t A ℓ_t + β kl_t r_t] − c·u·Σ_t H_t for one sequence (scalar, graph through ℓ and H).

    logps / ref_logps / entropies: [T] trainer log-probs, reference log-probs, trainer entropies;
    sampler_ratios: [T] TRL's importance-sampling ratios ρ_t (no graph; vllm_correction.py), None: ρ = 1;
    r_t = exp(ℓ_t − sg ℓ_t) with `options.use_bias_correction_kl` (TRL's token-level coef_1 at ℓ_old = ℓ:
    value 1, ∇r_t = ∇ℓ_t, so the KL gradient gains kl_t·∇ℓ_t), else 1.
    """
    per_token = -terms.advantage * logps
    if terms.policy_mask is not None:
        per_token = per_token * terms.policy_mask.to(logps.device, logps.dtype)
    if sampler_ratios is not None:
        per_token = per_token * sampler_ratios.detach().to(logps.dtype)
    if options.needs_reference:
        if ref_logps is None:
            raise ValueError("objective.kl_coef != 0 needs the reference log-probs")
        kl = kl_per_token(logps, ref_logps, options.kl_estimator)
        if options.use_bias_correction_kl:
            kl = kl * torch.exp(logps - logps.detach())
        per_token = per_token + options.kl_coef * kl
    loss = terms.weight * per_token.sum()
    if options.needs_entropy:
        if entropies is None:
            raise ValueError("objective.entropy_coef != 0 needs the per-token entropies")
        if terms.entropy_mask is not None:
            entropies = entropies * terms.entropy_mask.to(entropies.device, entropies.dtype)
        loss = loss - options.entropy_coef * terms.entropy_weight * entropies.sum()
    return loss


def batch_terms(rewards: Tensor, lengths: Tensor, options: ObjectiveOptions,
                stats: TokenStatistics | None = None) -> list[list[SequenceTerms]]:
    """SequenceTerms [B][G] of the whole U batch (rewards, lengths [B, G]); `stats` (needed when
    `options.needs_token_statistics`) gives the per-token weights of the entropy controls."""
    adv = advantages(rewards, options.scale_rewards, options.advantage_eps)
    w = token_weights(lengths, options)
    u = entropy_weights(lengths, options)
    B, G = lengths.shape
    clip_cov = ((options.clip_cov_ratio, options.clip_cov_lb, options.clip_cov_ub)
                if options.policy_loss == "clip_cov" else None)
    masks = control_weights(adv.reshape(-1).tolist(), stats, micro_batches=options.micro_batches,
                            quantile=options.top_entropy_quantile, clip_cov=clip_cov)
    if masks.entropy_counts is not None and options.entropy_aggregation == "token_mean":
        u = torch.tensor([1.0 / (options.micro_batches * max(c, 1.0)) for c in masks.entropy_counts],
                         dtype=torch.float64).reshape(B, G) * float(options.needs_entropy)

    def at(table: tuple[Tensor, ...] | None, n: int) -> Tensor | None:
        return None if table is None else table[n]

    return [[SequenceTerms(float(adv[b, g]), float(w[b, g]), float(u[b, g]), at(masks.policy, b * G + g),
                           at(masks.entropy, b * G + g)) for g in range(G)] for b in range(B)]



def contributes(terms_row: list[SequenceTerms], options: ObjectiveOptions) -> bool:
    """Whether a prompt's sequences can change the gradient (all-zero advantages add nothing unless a
    KL or entropy term is on)."""
    return options.needs_reference or options.needs_entropy or any(t.advantage != 0.0 for t in terms_row)


def resolve(explicit: dict[str, Any], *, default_completion_length: int) -> ObjectiveOptions:
    """ObjectiveOptions from the config's `objective` keys: explicit > trainer preset > defaults.

    `explicit` holds only the keys the user set (None = unset); `default_completion_length` (the probe's
    generation.max_new_tokens) fills a max_completion_length the user did not set, for dr_grpo (its L_const)
    and for trainer trl (whose max_completion_length IS its generation length, whatever the loss).
    """
    trainer = explicit.get("trainer")
    values: dict[str, Any] = {}
    if trainer is not None:
        if trainer not in TRAINER_PRESETS:
            raise ConfigError(f"objective.trainer: expected one of {', '.join(TRAINER_PRESETS)}, got {trainer!r}")
        values.update(TRAINER_PRESETS[trainer])
    values.update({k: v for k, v in explicit.items() if v is not None and k != "trainer"})
    # the correction's bounds are copied as given: None is TRL's "no bound", not "unset"
    values.update({k: explicit[k] for k in CORRECTION_KEYS if k in explicit})
    options = replace(ObjectiveOptions(), **values, trainer=trainer)
    options = replace(options, loss_type=canonical_loss_type(options.loss_type))
    _ = options.vllm_correction  # a correction the trainer does not have, or bad bounds, fail here (with the key)
    if options.use_bias_correction_kl and trainer != "trl":
        raise ConfigError(f"objective.use_bias_correction_kl: true is TRL's KL importance-sampling correction, "
                          f"objective.trainer is {trainer or 'null'}: only trainer trl has it (leave the key null)")
    if trainer == "openrlhf" and options.loss_type != "dapo" and options.needs_reference:
        raise ConfigError(f"objective.kl_coef: OpenRLHF aggregates its KL loss as a token mean over the step "
                          f"whatever the policy loss's aggregation; with loss_type {options.loss_type!r} that is "
                          "not the probe's objective (only token-mean / dapo is)")
    refusal = control_refusal(trainer, options.top_entropy_quantile, options.policy_loss)
    if refusal is not None:
        raise ConfigError(refusal)
    if options.max_completion_length is None and (options.loss_type == "dr_grpo" or trainer == "trl"):
        options = replace(options, max_completion_length=default_completion_length)
    for key, allowed in (("scale_rewards", ADVANTAGE_SCALINGS), ("kl_estimator", KL_ESTIMATORS),
                         ("entropy_aggregation", ENTROPY_AGGREGATIONS)):
        if getattr(options, key) not in allowed:
            raise ConfigError(f"objective.{key}: expected one of {', '.join(allowed)}, got {getattr(options, key)!r}")
    return options
