"""Phase 0: turning the index plan (`data/plan.py`) into packed batches.

The index plan is drawn once from the config seed — E prompts WITH replacement (G = 1) or distinct,
U prompts distinct — so that a distributed run can draw it on rank 0 and broadcast it (recipe.py), and
a resumed run can check it. `SamplingSpec.choose` picks, once, how the rows are drawn (a `policy/samplers.py`
Sampler: the one-at-a-time reference sampler, or the batched one the generation settings choose); `sample_batch`
turns one `BatchDraw` (prompt indices, G, seed, rewards) into one packed batch (rewards by the reward registry, advantages by the
objective's rule); `saved_batches` validates a resumed run's; `prompt_examples`
loads the prompt pool; `draw_plan` and `sample_sharded` are the same over a torchrun job's ranks, and
`sample_phase` is phase 0 of the probe (probe/recipe.py): the plan drawn, U then E sampled. IndexPlan / draw_index_plan live in data/plan.py and are re-exported here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..config import ProbeConfig
from ..data.batch import Batch, completion_ids
from ..data.datasets import load_examples
from ..data.plan import IndexPlan, draw_index_plan
from ..data.prompt_rendering import render_prompts
from ..data.rewards.weighted import RewardSet
from ..errors import ProbeError
from ..estimators.objectives import batch_advantages
from ..policy.engine import PolicyEngine
from ..policy.reference_sampler import ReferenceSampler
from ..policy.samplers import DrawRequest, Sampler
from ..report.results_dict import sampler_block
from .parallel import SINGLE, DistContext, rank_seed
from .results import Samples

log = logging.getLogger("entropy_experiments.sampling")

__all__ = ["BatchDraw", "IndexPlan", "SamplingSpec", "draw_index_plan", "draw_plan", "prompt_examples", "sample_batch",
           "sample_phase", "sample_sharded", "saved_batches", "warn_zero_advantages"]


@dataclass(frozen=True)
class SamplingSpec:
    """How phase 0 draws its batches: the policy engine (tokenizer, pad id), the sampler chosen once, and the
    options of the chat template the prompts are rendered with."""

    engine: PolicyEngine
    sampler: Sampler
    chat_template_kwargs: dict | None = None

    @classmethod
    def choose(cls, engine: PolicyEngine, *, reference: bool = False, chat_template_kwargs: dict | None = None,
               memory_budget_gb: float | None = None) -> SamplingSpec:
        """The one-at-a-time reference sampler (`sampler.batched: false`), else the batched sampler the
        generation settings choose (`PolicyEngine.sampler`: chunk-seeded, row-keyed or continuous batching;
        `memory_budget_gb` caps what gen_batch_size auto plans for). Choose after setting the engine's
        chunk_store: the sampler keeps the one it was chosen with."""
        sampler = ReferenceSampler(engine) if reference else engine.sampler(memory_budget_gb=memory_budget_gb)
        return cls(engine, sampler, chat_template_kwargs)


@dataclass(frozen=True)
class BatchDraw:
    """One batch to draw: its prompts (indices into the pool), G responses each, the seed, the reward set (a U
    batch) or None (an E batch, zero rewards), and its name in messages."""

    prompt_indices: Sequence[int]
    G: int
    seed: int
    rewards: RewardSet | None = None
    what: str = "batch"


def sample_batch(spec: SamplingSpec, examples: list, draw: BatchDraw) -> Batch:
    """Generate G responses for each listed prompt and pack them; with rewards (a U batch) also each reward
    function's values, their weighted sum and the advantages, without (an E batch) zeros.

    Prompts are rendered and tokenised as the trainer does (`data/prompt_rendering.py`) and the sampler draws
    from those token ids, under torch seeded with draw.seed, each chunk seeded on its own so that chunks a
    killed run saved are reused. With rewards, the first prompt's responses are scored as soon as they exist
    (batched samplers), so a reward function that raises stops the run before the rest is sampled.
    """
    engine, rewards, G, seed = spec.engine, draw.rewards, draw.G, draw.seed
    chosen = [examples[i] for i in draw.prompt_indices]
    rendered = render_prompts(engine.tokenizer, chosen, spec.chat_template_kwargs)
    token_ids = engine.tokenize_prompts([list(r.token_ids) for r in rendered])
    first_check = None
    if rewards is not None and chosen:
        def first_check(rows: list[list[int]]) -> None:
            texts = engine.tokenizer.batch_decode(rows, skip_special_tokens=True)
            rewards.score(rendered[0].text, texts, chosen[0], completion_ids=rows, where=where_of(chosen, 0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drawn = spec.sampler.draw(DrawRequest(token_ids, G, seed=seed, keep_chunks=True, on_first_group=first_check))
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


def sample_sharded(spec: SamplingSpec, examples: list, draw: BatchDraw, dist: DistContext) -> Batch:
    """`sample_batch` over the ranks: each rank generates its contiguous slice of the prompts with its own
    generator (`rank_seed`; rank 0 keeps the seed); the slices are all-gathered in plan order."""
    if not dist.enabled:
        return sample_batch(spec, examples, draw)
    mine = dist.prompt_slice(len(draw.prompt_indices))
    local = None
    if mine:
        share = dataclasses.replace(draw, prompt_indices=[draw.prompt_indices[i] for i in mine],
                                    seed=rank_seed(draw.seed, dist.rank))
        local = sample_batch(spec, examples, share)
    return Batch.concat(dist.all_gather_object(local, f"gather sampled {draw.what}"), spec.engine.pad_token_id)


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
    spec = SamplingSpec.choose(engine, reference=reference, chat_template_kwargs=bc.chat_template_kwargs,
                               memory_budget_gb=config.estimator.memory_budget_gb)
    U = sample_sharded(spec, examples, BatchDraw(plan.U_prompt_indices, bc.G, seed + 2, rewards, "U"), dist)
    E = sample_sharded(spec, examples, BatchDraw(plan.E_prompt_indices, plan.E_responses_per_prompt, seed + 1,
                                                 None, "E"), dist)
    return Samples(E, U, plan, sampler_block(E.generation, U.generation))
