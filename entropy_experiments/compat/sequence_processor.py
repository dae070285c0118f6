"""SequenceProcessor (seed 004's API) — the policy engine (`policy/engine.py`) plus the seed conveniences.

`PolicyEngine` does the work: generation, teacher forcing, parameter overrides and seeding. This subclass
adds what the seed API kept on the same object: the config forms it accepted (a GenerationConfig, a dict
with sections {"generation", "precision"} + optional "reward": {"name"}, "batch_config": {"dataset_path",
"pool_size"}, or a ProbeConfig), prompt draws from a data set (`datasets/prompt_draws.py`), rewards
(`rewards/sequence_rewards.py`), generate-score-reward in one call, the seed's private names
(`_build_params_override`, `_fo_cfg`, `_tf_cfg`, `_mdl_target`, `_compute_rewards`) and its name
`LogprobResults.entropies` for the per-token surprisals.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from entropy_experiments.data.datasets.prompt_draws import (
    draw_distinct,
    draw_with_replacement,
    load_prompt_pool,
)
from entropy_experiments.data.rewards.sequence_rewards import rewards_for_sequences
from entropy_experiments.errors import ConfigError, DataError
from entropy_experiments.policy.distribution_diagnostics import (
    DiagnosticsPack,
    SequenceDiagnostics,
    TokenStepDiagnostics,
)
from entropy_experiments.policy.engine import PolicyEngine
from entropy_experiments.policy.generate import chunk_seed
from entropy_experiments.policy.generation_config import GenerationConfig, PolicySettings, parse_config
from entropy_experiments.policy.precision_utils import ForwardProfile
from entropy_experiments.policy.sequences import BatchedSequences, DiagnosticsResults, global_prompt_id
from entropy_experiments.policy.sequences import LogprobResults as _PolicyLogprobResults

__all__ = [
    "BatchedSequences", "DiagnosticsPack", "DiagnosticsResults", "GenerationConfig", "LogprobResults",
    "SequenceDiagnostics", "SequenceProcessor", "TokenStepDiagnostics", "chunk_seed",
]


@dataclasses.dataclass
class LogprobResults(_PolicyLogprobResults):
    """The policy's `LogprobResults` with seed 004's name `entropies` for the per-token surprisals −log q."""

    @classmethod
    def of(cls, results: _PolicyLogprobResults) -> LogprobResults:
        return cls(**{f.name: getattr(results, f.name) for f in dataclasses.fields(results)})

    @property
    def entropies(self) -> list[list[Any]]:
        """−log q per generated token (`surprisals`; numpy [T] per [b][g])."""
        return self.surprisals


class SequenceProcessor(PolicyEngine):
    """The policy engine with seed 004's conveniences: prompt pools, rewards, generate-score-reward."""

    def __init__(self, model: nn.Module, tokenizer, config: Any = None, logger: logging.Logger | None = None):
        generation, precision, self.reward_spec, self._batch_cfg = parse_config(config)
        super().__init__(model, tokenizer, PolicySettings(generation, precision), logger)

    # ------------------------------------------------------------------ the seed's private names
    @property
    def _mdl_target(self) -> nn.Module:
        return self.policy.module

    @property
    def _fo_cfg(self) -> ForwardProfile:
        return self.policy.precision.func_override

    @property
    def _tf_cfg(self) -> ForwardProfile:
        return self.policy.precision.tf_nograd

    _build_params_override = PolicyEngine.build_params_override

    # ------------------------------------------------------------------ generate, score, reward
    def generate_with_logprobs(self, prompts: Sequence[str] | None = None, G: int = 8, dataset_name: str | None = None,
                               split: str = "train", num_prompts: int | None = None, seed: int | None = None,
                               with_grad: bool = False, gen_batch_size: int | None = None,
                               tf_batch_size: int | None = None, compute_rb: bool = False,
                               examples: Sequence | None = None
                               ) -> tuple[BatchedSequences, LogprobResults, DiagnosticsResults]:
        """Prompts (explicit, or `num_prompts` sampled from `dataset_name`) → generate → score → rewards.

        `examples` (our extension) gives the data-set records of explicit prompts so that rewards
        see their gold answers; sampled prompts carry theirs automatically.
        """
        if prompts is None:
            if dataset_name is None or num_prompts is None:
                raise ConfigError("generate_with_logprobs: give prompts, or dataset_name and num_prompts")
            prompts, examples = self.sample_prompts(dataset_name, split, num_prompts, seed)
        if examples is not None and len(examples) != len(prompts):
            raise DataError(f"generate_with_logprobs: {len(examples)} examples for {len(prompts)} prompts")
        seqs = self.generate_batched(prompts, G, gen_batch_size, seed=seed)
        if examples is not None:
            seqs.examples = list(examples)
            seqs.prompt_ids = [global_prompt_id(ex, i) for i, ex in enumerate(examples)]
        lp, diags = self.teacher_force_logprobs_with_diagnostics(seqs, with_grad=with_grad, tf_batch_size=tf_batch_size,
                                                                 compute_rb=compute_rb)
        lp.rewards = self._compute_rewards(list(prompts), seqs, list(examples) if examples is not None else None)
        return seqs, lp, diags

    def generate_with_replacement_sampling(self, total_sequences: int, dataset_name: str, split: str = "train",
                                           max_prompts_pool: int | None = None, seed: int | None = None, **kwargs
                                           ) -> tuple[BatchedSequences, LogprobResults, DiagnosticsResults]:
        """`total_sequences` prompts drawn WITH replacement, one response each (G forced to 1).

        Each draw keeps its own example (gold answer), so rewards work; logs the pool size, the
        number of unique prompts drawn and the largest repeat count.
        """
        if total_sequences < 1:
            raise ConfigError(f"total_sequences: must be >= 1, got {total_sequences}")
        G = kwargs.pop("G", 1)
        if G != 1:
            self.logger.warning("generate_with_replacement_sampling: G=%s ignored, forced to 1 (independent draws)", G)
        pool = self._prompt_pool(dataset_name, split, max_prompts_pool)
        examples, counts = draw_with_replacement(pool, total_sequences, seed)
        self.logger.info("replacement sampling: pool %d prompts, %d draws, %d unique, largest repeat %d",
                         len(pool), len(examples), len(counts), max(counts.values()))
        return self.generate_with_logprobs(prompts=[ex.question for ex in examples], G=1, seed=seed,
                                           examples=examples, **kwargs)

    # ------------------------------------------------------------------ prompts and rewards
    def sample_prompts(self, dataset_name: str, split: str, num_prompts: int, seed: int | None = None
                       ) -> tuple[list[str], list]:
        """`num_prompts` distinct prompts drawn with a local `random.Random(seed)` → (prompts, examples)."""
        pool = self._prompt_pool(dataset_name, split)
        examples = draw_distinct(pool, num_prompts, seed, label=f"{dataset_name}/{split}")
        return [ex.question for ex in examples], examples

    def _prompt_pool(self, dataset_name: str, split: str, max_prompts_pool: int | None = None) -> list:
        return load_prompt_pool(dataset_name, split, dataset_path=self._batch_cfg.get("dataset_path"),
                                pool_size=self._batch_cfg.get("pool_size"), max_prompts_pool=max_prompts_pool)

    def _compute_rewards(self, prompts: Sequence[str], sequences: BatchedSequences,
                         examples: Sequence | None = None) -> list[list[float]]:
        """Rewards [B][G] through the reward registry (config `reward.name`, default tag_pref); prompts
        without an example get 0.0 with one warning (`rewards/sequence_rewards.py`)."""
        return rewards_for_sequences(self.reward_spec, prompts, sequences, examples, self.warn_once)

    # ------------------------------------------------------------------ teacher forcing (seed result type)
    def teacher_force_logprobs(self, *args, **kwargs) -> LogprobResults:
        """`PolicyEngine.teacher_force_logprobs`, its result with the seed's `entropies`."""
        return LogprobResults.of(super().teacher_force_logprobs(*args, **kwargs))

    def teacher_force_logprobs_with_diagnostics(self, *args, **kwargs) -> tuple[LogprobResults, DiagnosticsResults]:
        """`PolicyEngine.teacher_force_logprobs_with_diagnostics`, its result with the seed's `entropies`."""
        lp, diags = super().teacher_force_logprobs_with_diagnostics(*args, **kwargs)
        return LogprobResults.of(lp), diags
