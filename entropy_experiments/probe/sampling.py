"""Phase 0: turning the index plan (`data/plan.py`) into packed batches.

The index plan is drawn once from the config seed — E prompts WITH replacement (G = 1) or distinct,
U prompts distinct — so that a distributed run can draw it on rank 0 and broadcast it (recipe.py), and
a resumed run can check it. `choose_sampler` picks how the rows are drawn (a `policy/samplers.py` Sampler:
the one-at-a-time reference sampler, or the batched one the generation settings choose); `sample_batch`
turns a list of prompt indices into one packed batch (rewards by the reward registry, advantages by the
objective's rule); `saved_batches` validates a resumed run's; `prompt_examples`
loads the prompt pool; `draw_plan` and `sample_sharded` are the same over a torchrun job's ranks, and
`sample_phase` is phase 0 of the probe (probe/recipe.py): the plan drawn, U then E sampled. IndexPlan / draw_index_plan live in data/plan.py and are re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..config import ProbeConfig
from ..data.batch import Batch
from ..data.datasets import load_examples
from ..data.plan import IndexPlan, draw_index_plan
from ..data.prompt_rendering import render_prompts
from ..data.rewards.weighted import RewardSet
from ..errors import ProbeError
from ..estimators.objectives import batch_advantages
from ..policy.engine import PolicyEngine
from ..policy.reference_sampler import ReferenceSampler
from ..policy.samplers import DrawRequest, Sampler
from ..policy.sequences import completion_ids
from ..report.results_dict import sampler_block
from .parallel import SINGLE, DistContext, rank_seed
from .results import Samples

log = logging.getLogger("entropy_experiments.sampling")

__all__ = ["IndexPlan", "choose_sampler", "draw_index_plan", "draw_plan", "prompt_examples", "sample_batch", "sample_phase", "sample_sharded", "saved_batches",
           "warn_zero_advantages"]


def sample_batch(engine: PolicyEngine, examples: list, prompt_indices: list[int], G: int, *, seed: int,
                 rewards: RewardSet | None, reference: bool = False,
                 chat_template_kwargs: dict | None = None, memory_budget_gb: float | None = None) -> Batch:
    """Generate G responses for each listed prompt and pack them; with `rewards` (a U batch) also each reward
    function's values, their weighted sum and the advantages, without (an E batch) zeros.

    Prompts are rendered and tokenised as the trainer does (`data/prompt_rendering.py`) and the policy
    generates from those token ids. With rewards, the first prompt's responses are scored as soon as they
    exist, so a reward function that raises stops the run before the rest is sampled. `reference=True`
    uses the plain one-prompt-at-a-time sampler (`sampler.batched: false`). `memory_budget_gb` caps the memory
    gen_batch_size auto plans for (estimator.memory_budget_gb).
    """
    chosen = [examples[i] for i in prompt_indices]
    rendered = render_prompts(engine.tokenizer, chosen, chat_template_kwargs)
    token_ids = engine.tokenize_prompts([list(r.token_ids) for r in rendered])
    first_check = None
    if rewards is not None and chosen:
        def first_check(rows: list[list[int]]) -> None:
            texts = engine.tokenizer.batch_decode(rows, skip_special_tokens=True)
            rewards.score(rendered[0].text, texts, chosen[0], completion_ids=rows, where=where_of(chosen, 0))
    sampler = choose_sampler(engine, reference=reference, memory_budget_gb=memory_budget_gb)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # keep_chunks: each chunk seeded from (seed, chunk index), so chunks saved by a killed run can be reused
        drawn = sampler.draw(DrawRequest(token_ids, G, seed=seed, keep_chunks=True, on_first_group=first_check))
    seqs, generation = drawn.sequences, drawn.record
    seqs.examples = chosen
    seqs.prompts = [r.text for r in rendered]
    seqs.prompt_ids = [int(ex.meta["global_prompt_id"]) for ex in chosen]
    if rewards is None:
        batch = Batch.pack(seqs, None)
        batch.generation = generation
        return batch
    scored = [rewards.score(seqs.prompts[b], list(seqs.responses_text[b]), ex, completion_ids=completion_ids(seqs, b),
                            where=where_of(chosen, b)) for b, ex in enumerate(chosen)]
    summed = [p.summed for p in scored]
    batch = Batch.pack(seqs, summed, batch_advantages(summed))
    batch.rewards_per_function = {name: [p.per_function[name] for p in scored] for name in rewards.names}
    batch.reward_weights = dict(zip(rewards.names, rewards.weights, strict=True))
    batch.generation = generation
    return batch


def choose_sampler(engine: PolicyEngine, *, reference: bool, memory_budget_gb: float | None = None) -> Sampler:
    """How E and U are drawn: the one-at-a-time reference sampler (`sampler.batched: false`), else the batched
    sampler the generation settings choose (`PolicyEngine.sampler`: chunk-seeded, row-keyed or continuous
    batching; `memory_budget_gb` caps what gen_batch_size auto plans for)."""
    if reference:
        return ReferenceSampler(engine)
    return engine.sampler(memory_budget_gb=memory_budget_gb)


def where_of(examples: list, b: int) -> str:
    """' (prompt b+1 of B, prompt id N)' for reward error messages."""
    meta = getattr(examples[b], "meta", None) or {}
    pid = f", prompt id {meta['global_prompt_id']}" if "global_prompt_id" in meta else ""
    return f" (prompt {b + 1} of {len(examples)}{pid})"


def prompt_examples(bc) -> list:
    """The prompt pool of the config's `batch_config` section (dataset registry)."""
    return load_examples(bc.dataset_name, bc.split, dataset_path=bc.dataset_path, pool_size=bc.pool_size,
                         columns=bc.column_options())


def saved_batches(batches: tuple[Batch, Batch], logger: logging.Logger = log) -> tuple[Batch, Batch]:
    """Saved (E, U) batches, validated."""
    E, U = batches
    E.validate("E_batch")
    U.validate("U_batch")
    logger.info("Phase 0: reusing saved batches (E %d×%d, U %d×%d)", E.num_prompts, E.num_responses_per_prompt,
                U.num_prompts, U.num_responses_per_prompt)
    return E, U


def warn_zero_advantages(U: Batch, warn: Callable[[str], None], logger: logging.Logger = log) -> int:
    """Log how many U prompts have all-zero advantages; `warn` when all of them do (v is then no policy step)."""
    n_zero = U.zero_advantage_prompts()
    logger.info("U: %d of %d prompts have all-zero advantages (they add nothing to v)", n_zero, U.num_prompts)
    if n_zero == U.num_prompts:
        warn("every U prompt has all-zero advantages: the update direction is pure weight decay / "
             "momentum (check rewards and gold answers)")
    return n_zero


def draw_plan(config: ProbeConfig, n_examples: int, dist: DistContext) -> IndexPlan:
    """The index plan, drawn on rank 0 and broadcast (or rank 0's error raised on every rank)."""
    bc = config.batch_config
    plan = error = None
    if dist.is_main:
        try:
            plan = draw_index_plan(n_examples, B_E=bc.B_E, B_U=bc.B_U, G=bc.G, E_sampling_mode=bc.E_sampling_mode,
                                   seed=config.seed, max_prompts_pool=bc.max_prompts_pool)
        except ProbeError as exc:
            error = exc
    plan, message = dist.broadcast_object((plan, str(error) if error else None), "index plan broadcast")
    if error is not None:
        raise error
    if message is not None:
        raise ProbeError(message)
    return plan


def sample_sharded(engine: PolicyEngine, examples: list, prompt_indices: list[int], G: int, *, seed: int,
                   rewards: RewardSet | None, reference: bool, dist: DistContext, what: str,
                   chat_template_kwargs: dict | None = None, memory_budget_gb: float | None = None) -> dict:
    """`sample_batch` over the ranks: each rank generates its contiguous slice of the prompts with its own
    generator (`rank_seed`; rank 0 keeps `seed`); the slices are all-gathered in plan order."""
    options = {"rewards": rewards, "reference": reference, "chat_template_kwargs": chat_template_kwargs,
               "memory_budget_gb": memory_budget_gb}
    if not dist.enabled:
        return sample_batch(engine, examples, prompt_indices, G, seed=seed, **options)
    mine = dist.prompt_slice(len(prompt_indices))
    local = (sample_batch(engine, examples, [prompt_indices[i] for i in mine], G, seed=rank_seed(seed, dist.rank),
                          **options) if mine else None)
    return Batch.concat(dist.all_gather_object(local, f"gather sampled {what}"), engine.pad_token_id)


def sample_phase(config: ProbeConfig, engine: PolicyEngine, dist: DistContext = SINGLE, logger: logging.Logger = log,
                 *, examples: list | None = None, rewards: RewardSet | None = None) -> Samples:
    """E: B_E prompts with replacement × 1 (or distinct × G); U: B_U distinct prompts × G. `examples` and
    `rewards` (a live trainer's: integrations/) replace the config's data set and reward functions."""
    bc, seed = config.batch_config, config.seed
    examples = examples if examples is not None else prompt_examples(config.batch_config)
    plan = draw_plan(config, len(examples), dist)
    reference = not config.sampler.batched
    desc = plan.describe()
    logger.info("Phase 0: sampling E = %d sequences (%d unique prompts, largest repeat %d, G=%d) and "
                "U = %d prompts × G=%d%s", desc["E_sequences"], desc["unique_E_prompts"], desc["largest_E_repeat"],
                plan.E_responses_per_prompt, bc.B_U, bc.G, " [reference sampler]" if reference else "")
    if dist.enabled:
        logger.info("Phase 0: rank %d of %d samples %d E and %d U prompts", dist.rank, dist.world_size,
                    len(dist.prompt_slice(len(plan.E_prompt_indices))),
                    len(dist.prompt_slice(len(plan.U_prompt_indices))))
    # U first (its own seed, so the batches are those of E first): a reward that raises stops the run at the
    # first U prompt's responses, before the rest is sampled.
    rewards = rewards or RewardSet.resolve(config.reward.specs(), config.reward.weights, examples[0])
    budget = config.estimator.memory_budget_gb
    U = sample_sharded(engine, examples, plan.U_prompt_indices, bc.G, seed=seed + 2, rewards=rewards,
                       reference=reference, dist=dist, what="U", chat_template_kwargs=bc.chat_template_kwargs,
                       memory_budget_gb=budget)
    E = sample_sharded(engine, examples, plan.E_prompt_indices, plan.E_responses_per_prompt, seed=seed + 1,
                       rewards=None, reference=reference, dist=dist, what="E",
                       chat_template_kwargs=bc.chat_template_kwargs, memory_budget_gb=budget)
    return Samples(E, U, plan, sampler_block(E.generation, U.generation))
