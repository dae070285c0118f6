"""SequenceProcessor (seed 004's API) — the policy engine (`policy/engine.py`) plus the seed conveniences.

`PolicyEngine` does the work: generation, teacher forcing (`teacher_force_logprobs`, `..._with_diagnostics`,
`teacher_force_directional`), parameter overrides and seeding, with the seams tests replace
(`_generate_span`, `_generate_chunk`, `_forward_logits`). This subclass adds what the seed API kept on the
same object: the config forms it accepted (a GenerationConfig, a dict with sections {"generation",
"precision"} + optional "reward": {"name"}, "batch_config": {"dataset_path", "pool_size"}, or a
ProbeConfig), prompt draws from a data set (`datasets/prompt_draws.py`), rewards
(`rewards/sequence_rewards.py`), generate-score-reward in one call, the probe's names for its
teacher-forcing passes when a caller names none, and the legacy private aliases.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from entropy_experiments.data.datasets import Example
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
from entropy_experiments.policy.sequences import BatchedSequences as _PolicyBatchedSequences
from entropy_experiments.policy.sequences import DiagnosticsResults, global_prompt_id
from entropy_experiments.policy.sequences import LogprobResults as _PolicyLogprobResults

__all__ = [
    "BatchedSequences", "DiagnosticsPack", "DiagnosticsResults", "GenerationConfig", "LogprobResults",
    "SequenceDiagnostics", "SequenceProcessor", "TokenStepDiagnostics", "chunk_seed",
]

JVP_PHASE = "teacher forcing (jvp, E directional derivatives)"
_EXAMPLE_FIELDS = frozenset(f.name for f in dataclasses.fields(Example))
# Fields an older saved record may lack (they have defaults): `prompt` and `columns` came with data sets in TRL's
# conventions.
_REQUIRED_EXAMPLE_FIELDS = frozenset(f.name for f in dataclasses.fields(Example)
                                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def probe_phase(with_grad: bool, compute_rb: bool, override: bool) -> str:
    """What a teacher-forcing call is for in the probe, for error messages (when the caller names none)."""
    if with_grad:
        return "teacher forcing with grad (E backward)" if compute_rb else "teacher forcing with grad (U gradient)"
    if override:
        return "teacher forcing at θ + η·v (ΔH(η) scoring)"
    return "teacher forcing (E scoring)"


def example_from_dict(e: Any) -> Any:
    """A saved example record back as the data set's `Example` (other records as plain dicts)."""
    if not isinstance(e, Mapping):
        return e
    return Example(**e) if _REQUIRED_EXAMPLE_FIELDS <= set(e) <= _EXAMPLE_FIELDS else dict(e)


class BatchedSequences(_PolicyBatchedSequences):
    """The policy's `BatchedSequences`; `from_dict` also turns saved examples back into `Example`s."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> _PolicyBatchedSequences:
        seqs = _PolicyBatchedSequences.from_dict(d)
        if seqs.examples is not None:
            seqs.examples = [example_from_dict(e) for e in seqs.examples]
        return seqs


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
    """The policy engine with seed 004's conveniences: prompt pools, rewards, generate-score-reward.

    `config` is a GenerationConfig, a dict with sections {"generation", "precision"} (+ optional
    "reward": {"name"}, "batch_config": {"dataset_path", "pool_size"}) or a ProbeConfig. The
    process-wide matmul switches of the precision profile are applied at construction unless
    `apply_precision=False`.
    """

    def __init__(self, model: nn.Module, tokenizer, config: Any = None, logger: logging.Logger | None = None,
                 *, apply_precision: bool = True):
        generation, precision, self.reward_spec, self._batch_cfg = parse_config(config)
        super().__init__(model, tokenizer, PolicySettings(generation, precision), logger,
                         apply_precision=apply_precision)

    # ------------------------------------------------------------------ legacy private names
    @property
    def _mdl_target(self) -> nn.Module:
        return self.policy.module

    @property
    def _fo_cfg(self) -> ForwardProfile:
        return self.policy.precision.func_override

    @property
    def _tf_cfg(self) -> ForwardProfile:
        return self.policy.precision.tf_nograd

    @property
    def _reward_spec(self) -> str:
        return self.reward_spec

    _tokenize_prompts = PolicyEngine.tokenize_prompts
    _left_pad = PolicyEngine.left_pad
    _generate_rows = PolicyEngine.generate_rows
    _pack = PolicyEngine.pack
    _response_length = PolicyEngine.response_length
    _seeded = PolicyEngine.seeded
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
        lp.rewards = self.compute_rewards(list(prompts), seqs, list(examples) if examples is not None else None)
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
        for key in ("prompts", "examples", "dataset_name", "num_prompts", "split"):
            if key in kwargs:
                raise ConfigError(f"generate_with_replacement_sampling: '{key}' cannot be passed here")
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

    def compute_rewards(self, prompts: Sequence[str], sequences: BatchedSequences,
                        examples: Sequence | None = None) -> list[list[float]]:
        """Rewards [B][G] through the reward registry (config `reward.name`, default tag_pref); prompts
        without an example get 0.0 with one warning (`rewards/sequence_rewards.py`)."""
        return rewards_for_sequences(self.reward_spec, prompts, sequences, examples, self.warn_once)

    _compute_rewards = compute_rewards  # the seed's name

    # ------------------------------------------------------------------ teacher forcing (seed defaults)
    def teacher_force_logprobs(self, sequences, with_grad: bool = False, tf_batch_size: int | None = None,
                               compute_rb: bool = False, return_baseline_features: bool = False,
                               params_override: Mapping[str, Tensor] | None = None,
                               buffers_override: Mapping[str, Tensor] | None = None, *,
                               phase: str | None = None) -> LogprobResults:
        """`PolicyEngine.teacher_force_logprobs`; without `phase`, the probe's name of the pass (`probe_phase`)."""
        return LogprobResults.of(super().teacher_force_logprobs(
            sequences, with_grad, tf_batch_size, compute_rb, return_baseline_features, params_override,
            buffers_override, phase=phase or probe_phase(with_grad, compute_rb, params_override is not None)))

    def teacher_force_logprobs_with_diagnostics(self, sequences, with_grad: bool = False,
                                                tf_batch_size: int | None = None, compute_rb: bool = False,
                                                return_baseline_features: bool = False,
                                                params_override: Mapping[str, Tensor] | None = None,
                                                buffers_override: Mapping[str, Tensor] | None = None, *,
                                                phase: str | None = None
                                                ) -> tuple[LogprobResults, DiagnosticsResults]:
        """`PolicyEngine.teacher_force_logprobs_with_diagnostics`, with the seed's default phase names."""
        lp, diags = super().teacher_force_logprobs_with_diagnostics(
            sequences, with_grad, tf_batch_size, compute_rb, return_baseline_features, params_override,
            buffers_override, phase=phase or probe_phase(with_grad, compute_rb, params_override is not None))
        return LogprobResults.of(lp), diags

    def teacher_force_directional(self, sequences, v_named: Mapping[str, Tensor], *,
                                  tf_batch_size: int | None = None, phase: str = JVP_PHASE, order: int = 1
                                  ) -> list[list[dict[str, Tensor]]]:
        """`PolicyEngine.teacher_force_directional` under the seed's default phase name."""
        return super().teacher_force_directional(sequences, v_named, tf_batch_size=tf_batch_size, phase=phase,
                                                 order=order)
