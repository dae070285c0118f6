"""SequenceProcessor (seed 004's API) — a thin façade over `entropy_experiments.policy`.

It holds the model, tokenizer and parsed config (`policy.PolicyModel`) and delegates: generation to
`policy/generate.py` (tokenise, left-pad, HF generate under the sampling policy, the stop rule, chunk
seeding), teacher forcing to `policy/score.py` (`score`, `jvp`), prompt draws to
`datasets/prompt_draws.py` and rewards to `rewards/sequence_rewards.py`. It also keeps the probe's
names for its teacher-forcing passes, which the error messages carry ("E backward", "ΔH(η) scoring").

Naming: `LogprobResults.logprobs` is log p (raw model, τ = 1, no nucleus) as in the seed;
`token_logqs` is log q (sampling policy) — what the probe uses for ℓ_k. They coincide at τ = 1, top_p = 1.

Seams kept for tests: `_generate_span`, `_generate_chunk` and `_forward_logits` are the methods every
generation / teacher-forcing call goes through (tests replace them to simulate running out of memory).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from entropy_experiments.data.datasets.prompt_draws import (
    draw_distinct,
    draw_with_replacement,
    load_prompt_pool,
)
from entropy_experiments.data.rewards.sequence_rewards import rewards_for_sequences
from entropy_experiments.errors import ConfigError, DataError
from entropy_experiments.policy import generate, score
from entropy_experiments.policy.distribution_diagnostics import (
    DiagnosticsPack,
    SequenceDiagnostics,
    TokenStepDiagnostics,
)
from entropy_experiments.policy.generate import chunk_seed
from entropy_experiments.policy.generation_config import GenerationConfig, parse_config
from entropy_experiments.policy.param_overrides import build_params_override
from entropy_experiments.policy.policy_model import PolicyModel
from entropy_experiments.policy.precision_utils import (
    ForwardProfile,
    PrecisionConfig,
    apply_global_precision,
    str_to_dtype,
)
from entropy_experiments.policy.sequences import (
    BatchedSequences,
    DiagnosticsResults,
    LogprobResults,
    global_prompt_id,
)
from entropy_experiments.policy.stop_rule import response_length
from entropy_experiments.policy.tf_batches import TFBatch, tf_batches

__all__ = [
    "BatchedSequences", "DiagnosticsPack", "DiagnosticsResults", "GenerationConfig", "LogprobResults",
    "SequenceDiagnostics", "SequenceProcessor", "TokenStepDiagnostics", "chunk_seed",
]

JVP_PHASE = "teacher forcing (jvp, E directional derivatives)"


def probe_phase(with_grad: bool, compute_rb: bool, override: bool) -> str:
    """What a teacher-forcing call is for in the probe, for error messages (when the caller names none)."""
    if with_grad:
        return "teacher forcing with grad (E backward)" if compute_rb else "teacher forcing with grad (U gradient)"
    if override:
        return "teacher forcing at θ + η·v (ΔH(η) scoring)"
    return "teacher forcing (E scoring)"


class SequenceProcessor:
    """Batched generation and teacher-forced scoring under one sampling policy (seed 004).

    `model` may be a plain HF causal LM, a PEFT model, or wrapped in DDP (unwrapped, PEFT kept).
    `config` is a GenerationConfig, a dict with sections {"generation", "precision"} (+ optional
    "reward": {"name"}, "batch_config": {"dataset_path", "pool_size"}) or a ProbeConfig. The
    process-wide matmul switches of the precision profile are applied at construction unless
    `apply_precision=False`.
    """

    def __init__(self, model: nn.Module, tokenizer, config: Any = None, logger: logging.Logger | None = None,
                 *, apply_precision: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.logger = logger or logging.getLogger("entropy_experiments.sequence_processor")
        generation, precision, self._reward_spec, self._batch_cfg = parse_config(config)
        self.policy = PolicyModel.build(model, tokenizer, generation, precision, self.logger)
        if apply_precision:
            apply_global_precision(precision)
        # Optional store of completed generation chunks (results.GenerationChunkStore): seed_per_chunk
        # calls save each chunk there and reuse the ones a killed run saved.
        self.chunk_store = None

    # ------------------------------------------------------------------ settings
    @property
    def config(self) -> GenerationConfig:
        return self.policy.config

    @property
    def precision(self) -> PrecisionConfig:
        return self.policy.precision

    @property
    def pad_token_id(self) -> int:
        return self.policy.pad_token_id

    @property
    def eos_token_ids(self) -> list[int]:
        return self.policy.eos_token_ids

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (used for the EOS-probability diagnostic)."""
        return self.policy.eos_token_id

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def _mdl_target(self) -> nn.Module:
        return self.policy.module

    @property
    def _fo_cfg(self) -> ForwardProfile:
        return self.policy.precision.func_override

    @property
    def _tf_cfg(self) -> ForwardProfile:
        return self.policy.precision.tf_nograd

    # ------------------------------------------------------------------ generation pieces
    def tokenize_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
        """Token ids of each prompt (no padding), checked against max_prompt_tokens."""
        return generate.tokenize_prompts(self.policy, prompts)

    def left_pad(self, token_lists: Sequence[Sequence[int]], length: int | None = None) -> tuple[Tensor, Tensor]:
        """Left-pad to one length → (ids [n, Lp], mask [n, Lp]) on the model's device."""
        return generate.left_pad(self.policy, token_lists, length)

    def generate_rows(self, input_ids: Tensor, attention_mask: Tensor, *, past_key_values: Any = None,
                      output_scores: bool = False) -> tuple[list[list[int]], list[Tensor] | None]:
        """One response per row of the left-padded prompts, cut by the stop rule (+ HF's scores)."""
        return generate.generate_rows(self.policy, input_ids, attention_mask, past_key_values=past_key_values,
                                      output_scores=output_scores)

    def pack(self, prompt_tokens: Sequence[Sequence[int]], responses: Sequence[Sequence[Sequence[int]]],
             prompts: Sequence[str] | None = None) -> BatchedSequences:
        """Packed layout from per-prompt token ids [B] and responses [B][G] (token id lists)."""
        return generate.pack(self.policy, prompt_tokens, responses, prompts)

    def response_length(self, gen_tokens: Sequence[int]) -> int:
        """T by the stop rule (MATH.md §1) for the tokens generated after the prompt."""
        return response_length(self.policy, gen_tokens)

    def seeded(self, seed: int | None):
        """Seed torch for the block without touching the caller's RNG state; no-op when seed is None."""
        return generate.seeded(self.device, seed)

    # seed-era private names of the pieces above (tests and benchmarks call them)
    _tokenize_prompts = tokenize_prompts
    _left_pad = left_pad
    _generate_rows = generate_rows
    _pack = pack
    _response_length = response_length
    _seeded = seeded

    def _generate_chunk(self, ids: Tensor, mask: Tensor, prompt_index: Tensor, *, output_scores: bool = False
                        ) -> tuple[list[list[int]], list[Tensor] | None]:
        """Seam: the rows `prompt_index` of the padded prompts, in one generate call."""
        return generate.generate_chunk(self.policy, ids, mask, prompt_index, output_scores=output_scores)

    def _generate_span(self, ids: Tensor, mask: Tensor, start: int, stop: int, G: int, index: int,
                       state: dict, reseed: int | None) -> list[list[int]]:
        """Seam: rows [start, stop) of chunk `index`, halving the rows per call on OOM."""
        return generate.generate_span(self.policy, ids, mask, start, stop, G, index, state, reseed,
                                      chunk_generator=self._generate_chunk)

    # ------------------------------------------------------------------ generation
    def generate_batched(self, prompts: Sequence[str], G: int, gen_batch_size: int | None = None, *,
                         seed: int | None = None, seed_per_chunk: bool = False,
                         done_chunks: Mapping[int, Sequence[Sequence[int]]] | None = None,
                         on_chunk: Callable[[int, list[list[int]]], None] | None = None) -> BatchedSequences:
        """G responses per prompt: all prompts left-padded to one length, rows generated in chunks.

        Rows are ordered prompt-major (row = b·G + g) and generated `gen_batch_size` at a time; the
        rows of one prompt share its prefill. `seed` seeds torch for this call only (the global RNG
        is used when None). With `seed_per_chunk` every chunk i is seeded on its own with
        `chunk_seed(seed, i)`; then `done_chunks` {i: responses} (saved by an earlier, killed run)
        are reused instead of generated, and `on_chunk(i, responses)` is called as each chunk
        completes (to save it), so a kill loses at most the chunk in flight.
        Running out of memory halves the rows per forward (logged) down to 1, then DeviceError.
        """
        if G < 1:
            raise ConfigError(f"G: must be >= 1, got {G}")
        if seed_per_chunk and seed is None:
            raise ValueError("generate_batched: seed_per_chunk needs a seed")
        prompt_tokens = self.tokenize_prompts(prompts)
        ids, mask = self.left_pad(prompt_tokens)
        B, R = len(prompt_tokens), len(prompt_tokens) * G
        chunk = int(gen_batch_size or self.config.gen_batch_size)
        if seed_per_chunk and self.chunk_store is not None and done_chunks is None and on_chunk is None:
            done_chunks, on_chunk = self.chunk_store.open({
                "seed": int(seed), "G": int(G), "chunk": chunk, "prompt_tokens": prompt_tokens,
                "generation": dataclasses.asdict(self.config)})
            if done_chunks:
                self.logger.info("generation: reusing %d saved chunk(s) of %d", len(done_chunks), -(-R // chunk))
        responses = generate.generate_in_chunks(self.policy, ids, mask, G, chunk, seed=seed,
                                                seed_per_chunk=seed_per_chunk, done_chunks=done_chunks,
                                                on_chunk=on_chunk, span=self._generate_span)
        grouped = [responses[b * G:(b + 1) * G] for b in range(B)]
        return self.pack(prompt_tokens, grouped, prompts)

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
        return rewards_for_sequences(self._reward_spec, prompts, sequences, examples, self.policy.warn_once)

    _compute_rewards = compute_rewards  # the seed's name

    # ------------------------------------------------------------------ teacher forcing
    def build_params_override(self, v_named: Mapping[str, Tensor], eta: float) -> dict[str, Tensor]:
        """θ + η·v on the named parameters (formed in func_override.dtype ≥ fp32), live views elsewhere."""
        return build_params_override(self.policy.module, v_named, eta, dtype=str_to_dtype(self._fo_cfg.dtype),
                                     cast_params=self._fo_cfg.cast_params)

    _build_params_override = build_params_override  # the seed's name

    def _tf_batches(self, sequences: BatchedSequences, tf_batch_size: int | None) -> Iterator[TFBatch]:
        """Seam: the teacher-forcing forwards of `sequences` (tf_batch_size rows each)."""
        return tf_batches(sequences, int(tf_batch_size or self.config.tf_batch_size), self.device)

    def _forward_logits(self, batch: TFBatch, mapping: Mapping[str, Tensor] | None,
                        profile: ForwardProfile) -> Tensor:
        """Seam: logits [R, K, V] at the batch's needed positions; live module when `mapping` is None."""
        return score.forward_logits(self.policy, batch, mapping, profile)

    def teacher_force_logprobs(self, sequences: BatchedSequences, with_grad: bool = False,
                               tf_batch_size: int | None = None, compute_rb: bool = False,
                               return_baseline_features: bool = False,
                               params_override: Mapping[str, Tensor] | None = None,
                               buffers_override: Mapping[str, Tensor] | None = None, *,
                               phase: str | None = None) -> LogprobResults:
        """Score the generated tokens of `sequences` (`policy.score.score`); `phase` names the pass in errors."""
        lp, _ = self._teacher_force(sequences, with_grad, tf_batch_size, compute_rb, return_baseline_features,
                                    params_override, buffers_override, diagnostics=False, phase=phase)
        return lp

    def teacher_force_logprobs_with_diagnostics(self, sequences: BatchedSequences, with_grad: bool = False,
                                                tf_batch_size: int | None = None, compute_rb: bool = False,
                                                return_baseline_features: bool = False,
                                                params_override: Mapping[str, Tensor] | None = None,
                                                buffers_override: Mapping[str, Tensor] | None = None, *,
                                                phase: str | None = None
                                                ) -> tuple[LogprobResults, DiagnosticsResults]:
        """As `teacher_force_logprobs`, plus per-sequence `DiagnosticsPack`s from the same pass."""
        return self._teacher_force(sequences, with_grad, tf_batch_size, compute_rb, return_baseline_features,
                                   params_override, buffers_override, diagnostics=True, phase=phase)

    def _teacher_force(self, sequences, with_grad, tf_batch_size, compute_rb, baseline, params, buffers, *,
                       diagnostics: bool, phase: str | None) -> tuple[LogprobResults, DiagnosticsResults | None]:
        if with_grad and (params is not None or buffers is not None):
            raise ValueError("teacher_force_logprobs: with_grad=True evaluates the live module; "
                             "params_override/buffers_override are for the no-grad path")
        # A with-grad caller that fixes tf_batch_size needs each of its batches in ONE forward (the
        # backward row hooks count rows per forward), so that pass cannot be split after an OOM.
        return score.score(self.policy, sequences, grad=with_grad, params=params, buffers=buffers,
                           tf_batch_size=tf_batch_size, compute_rb=compute_rb, baseline=baseline,
                           diagnostics=diagnostics, phase=phase or probe_phase(with_grad, compute_rb, params is not None),
                           can_split=not (with_grad and tf_batch_size is not None), logits_fn=self._forward_logits)

    def teacher_force_directional(self, sequences: BatchedSequences, v_named: Mapping[str, Tensor], *,
                                  tf_batch_size: int | None = None, phase: str = JVP_PHASE, order: int = 1
                                  ) -> list[list[dict[str, Tensor]]]:
        """Per [b][g]: `logq`, `rb_entropy`, `d_logq`, `d_rb_entropy` (with order 2 also `d2_logq`,
        `d2_rb_entropy`; float64 [T], CPU) by forward-mode AD along v (`policy.score.jvp`, MATH.md §6)."""
        return score.jvp(self.policy, sequences, v_named, tf_batch_size=tf_batch_size, phase=phase,
                         logits_fn=self._forward_logits, order=order)
