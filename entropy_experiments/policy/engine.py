"""PolicyEngine: the policy under probe — generation and teacher forcing under one sampling policy q_θ.

It holds the model, tokenizer and settings (`PolicyModel`) and runs: generation (`sampler` picks the `Sampler`
of `samplers.py` the settings choose — chunk-seeded, row-keyed or continuous batching — and `generate_batched`
draws with it; the pieces are `generate.py`'s: tokenise, left-pad, HF generate, the stop rule), teacher forcing
with and without grad at θ or at a parameter mapping θ + η·v (`score.py`), the exact directional derivatives
along v by forward-mode AD (`score.jvp`), and seeding. It knows no data set, reward or estimator: the probe,
training, the sweep and the estimators call it with sequences and parameter directions, and each names what
a teacher-forcing pass is for (`phase`), which the error messages carry.

Naming: `LogprobResults.logprobs` is log p (raw model, τ = 1, no nucleus) as in the seed; `token_logqs` is
log q (sampling policy) — what the probe uses for ℓ_k. They coincide at τ = 1, top_p = 1.

Seams kept for tests: `_generate_span`, `_generate_chunk` and `_forward_logits` are the methods every
generation / teacher-forcing call goes through (tests replace them to simulate running out of memory).
The seed API (`compat.sequence_processor.SequenceProcessor`) is this class plus prompt pools and rewards.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from entropy_experiments.data.batch import Batch
from entropy_experiments.policy import generate, score
from entropy_experiments.policy.cb_generation import CB_DRAWS, ContinuousBatchingSampler
from entropy_experiments.policy.chunk_seeded import ChunkSeededSampler, generate_span
from entropy_experiments.policy.generation_config import GenerationConfig, PolicySettings
from entropy_experiments.policy.param_overrides import build_params_override
from entropy_experiments.policy.policy_model import PolicyModel
from entropy_experiments.policy.precision_utils import (
    ForwardProfile,
    PrecisionConfig,
    apply_global_precision,
    str_to_dtype,
)
from entropy_experiments.policy.row_generation import RowKeyedSampler
from entropy_experiments.policy.sampler_setup import plan_sampler
from entropy_experiments.policy.samplers import DrawRequest, Sampler, SamplerContext
from entropy_experiments.policy.sequences import DiagnosticsResults, LogprobResults
from entropy_experiments.policy.stop_rule import response_length
from entropy_experiments.policy.tf_batches import TFBatch, tf_batches

__all__ = ["ChunkStore", "PolicyEngine"]

TEACHER_FORCING = "teacher forcing"
JVP = "teacher forcing (jvp)"


class ChunkStore(Protocol):
    """Where a `seed_per_chunk` generation saves its completed chunks (report/run_dir.GenerationChunkStore)."""

    def open(self, key: dict) -> tuple[dict[int, list[list[int]]], Callable[[int, list[list[int]]], None]]: ...


class PolicyEngine:
    """Batched generation and teacher-forced scoring of one model under one sampling policy.

    `model` may be a plain HF causal LM, a PEFT model, or wrapped in DDP (unwrapped, PEFT kept). The
    process-wide matmul switches of the precision profile are applied at construction unless
    `apply_precision=False`.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, settings: PolicySettings | None = None,
                 logger: logging.Logger | None = None, *, apply_precision: bool = True):
        settings = settings if settings is not None else PolicySettings()
        self.model = model
        self.tokenizer = tokenizer
        self.logger = logger or logging.getLogger("entropy_experiments.sequence_processor")
        self.policy = PolicyModel.build(model, tokenizer, settings.generation, settings.precision, self.logger)
        if apply_precision:
            apply_global_precision(settings.precision)
        # Optional store of completed generation chunks: seed_per_chunk calls save each chunk there and reuse
        # the ones a killed run saved.
        self.chunk_store: ChunkStore | None = None
        # What the last generate_batched call did (sampler dtype, draws, engine, rows per call, tokens, seconds).
        self.last_generation: dict | None = None

    # ------------------------------------------------------------------ settings
    @property
    def config(self) -> GenerationConfig:
        return self.policy.config

    @property
    def precision(self) -> PrecisionConfig:
        return self.policy.precision

    @property
    def settings(self) -> PolicySettings:
        return PolicySettings(self.policy.config, self.policy.precision)

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

    def warn_once(self, key: str, message: str) -> None:
        """Log `message` the first time `key` is seen by this engine."""
        self.policy.warn_once(key, message)

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
             prompts: Sequence[str] | None = None) -> Batch:
        """Packed layout from per-prompt token ids [B] and responses [B][G] (token id lists)."""
        return generate.pack(self.policy, prompt_tokens, responses, prompts)

    def response_length(self, gen_tokens: Sequence[int]) -> int:
        """T by the stop rule (docs/maths.md §1) for the tokens generated after the prompt."""
        return response_length(self.policy, gen_tokens)

    def seeded(self, seed: int | None):
        """Seed torch for the block without touching the caller's RNG state; no-op when seed is None."""
        return generate.seeded(self.device, seed)

    def _generate_chunk(self, ids: Tensor, mask: Tensor, prompt_index: Tensor, *, output_scores: bool = False,
                        draw: Any = None, module: nn.Module | None = None
                        ) -> tuple[list[list[int]], list[Tensor] | None]:
        """Seam: the rows `prompt_index` of the padded prompts, in one generate call (`draw`: a row-keyed
        LogitsProcessor, `module`: the sampler model; defaults: torch's multinomial, the policy)."""
        return generate.generate_chunk(self.policy, ids, mask, prompt_index, output_scores=output_scores,
                                       draw=draw, module=module)

    def _generate_span(self, ids: Tensor, mask: Tensor, start: int, stop: int, G: int, index: int,
                       state: dict, reseed: int | None) -> list[list[int]]:
        """Seam: rows [start, stop) of chunk `index`, halving the rows per call on OOM."""
        return generate_span(self.policy, ids, mask, start, stop, G, index, state, reseed,
                             chunk_generator=self._generate_chunk)

    # ------------------------------------------------------------------ generation
    def generate_batched(self, prompts: Sequence[str], G: int, gen_batch_size: int | None = None, *,
                         seed: int | None = None, seed_per_chunk: bool = False,
                         done_chunks: Mapping[int, Sequence[Sequence[int]]] | None = None,
                         on_chunk: Callable[[int, list[list[int]]], None] | None = None,
                         on_first_group: Callable[[list[list[int]]], None] | None = None,
                         memory_budget_gb: float | None = None) -> Batch:
        """G responses per prompt: all prompts left-padded to one length, rows generated in chunks.

        Rows are ordered prompt-major (row = b·G + g) and generated `gen_batch_size` at a time; the
        rows of one prompt share its prefill. `seed` seeds torch for this call only (the global RNG
        is used when None). With `seed_per_chunk` every chunk i is seeded on its own with
        `chunk_seed(seed, i)`; then `done_chunks` {i: responses} (saved by an earlier, killed run, or
        by the `chunk_store`) are reused instead of generated, and `on_chunk(i, responses)` is called as
        each chunk completes (to save it), so a kill loses at most the chunk in flight. `on_first_group(rows)`
        gets the first prompt's G responses as soon as they exist (a caller's early check). A prompt is a
        string (tokenised here) or its token ids (rendered by the caller, e.g. with the trainer's chat template).
        Running out of memory halves the rows per forward (logged) down to 1, then DeviceError.

        The sampler (policy/sampler_setup.py): an integer gen_batch_size with an fp32 sampler draws as above
        ("chunk_seeded"); gen_batch_size auto or a bf16 sampler draw "row_keyed" (every row's tokens depend on
        (seed, row, step) only, so chunks are any size), a bf16 sampler also records `sampler_logqs`. auto rows
        per call come from the free memory (or `memory_budget_gb`). `last_generation` records what was done.
        """
        if seed_per_chunk and seed is None:
            raise ValueError("generate_batched: seed_per_chunk needs a seed")
        sampler = self.sampler(gen_batch_size, memory_budget_gb=memory_budget_gb, done_chunks=done_chunks,
                               on_chunk=on_chunk)
        drawn = sampler.draw(DrawRequest(self.tokenize_prompts(prompts), G, seed=seed, keep_chunks=seed_per_chunk,
                                         on_first_group=on_first_group))
        self.last_generation = drawn.record
        drawn.sequences.prompts = list(prompts)
        return drawn.sequences

    def sampler(self, gen_batch_size: int | str | None = None, *, memory_budget_gb: float | None = None,
                done_chunks: Mapping[int, Sequence[Sequence[int]]] | None = None,
                on_chunk: Callable[[int, list[list[int]]], None] | None = None) -> Sampler:
        """The batched sampler the generation settings choose (`sampler_setup.plan_sampler`; gen_batch_size
        overrides generation.gen_batch_size): chunk-seeded, row-keyed or continuous batching (`samplers.py`).
        `done_chunks` / `on_chunk`: a chunk-seeded caller's own store of chunks."""
        requested = gen_batch_size or self.config.gen_batch_size
        plan = plan_sampler(requested, self.config.sampler_dtype, self.config.sampler_engine, self.device,
                            self.policy.module)
        context = SamplerContext(self.policy, requested, plan, chunk_store=self.chunk_store,
                                 chunk_generator=self._generate_chunk, span=self._generate_span,
                                 memory_budget_gb=memory_budget_gb)
        if plan.draws == CB_DRAWS:
            return ContinuousBatchingSampler(context)
        if plan.draws == "row_keyed":
            return RowKeyedSampler(context)
        return ChunkSeededSampler(context, done_chunks, on_chunk)

    # ------------------------------------------------------------------ teacher forcing
    def build_params_override(self, v_named: Mapping[str, Tensor], eta: float) -> dict[str, Tensor]:
        """θ + η·v on the named parameters (formed in func_override.dtype ≥ fp32), live views elsewhere."""
        profile = self.policy.precision.func_override
        return build_params_override(self.policy.module, v_named, eta, dtype=str_to_dtype(profile.dtype),
                                     cast_params=profile.cast_params)

    def _tf_batches(self, sequences: Batch, tf_batch_size: int | None) -> Iterator[TFBatch]:
        """Seam: the teacher-forcing forwards of `sequences` (tf_batch_size rows each)."""
        return tf_batches(sequences, int(tf_batch_size or self.config.tf_batch_size), self.device)

    def _forward_logits(self, batch: TFBatch, mapping: Mapping[str, Tensor] | None,
                        profile: ForwardProfile) -> Tensor:
        """Seam: logits [R, K, V] at the batch's needed positions; live module when `mapping` is None."""
        return score.forward_logits(self.policy, batch, mapping, profile)

    def teacher_force_logprobs(self, sequences: Batch, with_grad: bool = False,
                               tf_batch_size: int | None = None, compute_rb: bool = False,
                               return_baseline_features: bool = False,
                               params_override: Mapping[str, Tensor] | None = None,
                               buffers_override: Mapping[str, Tensor] | None = None, *,
                               phase: str = TEACHER_FORCING) -> LogprobResults:
        """Score the generated tokens of `sequences` (`policy.score.score`).

        `with_grad`: the live module, outputs carry the graph (no overrides allowed). Without grad: at θ, or
        at `params_override` (θ + η·v, `build_params_override`) and `buffers_override`. `phase` names the pass
        in error messages. A with-grad caller that fixes `tf_batch_size` gets each of its batches in ONE
        forward (the backward row hooks count rows per forward): such a pass is never split after an OOM.
        """
        request = score.ScoreRequest(with_grad, params_override, buffers_override, tf_batch_size, compute_rb,
                                     return_baseline_features, diagnostics=False, phase=phase)
        lp, _ = self._teacher_force(sequences, request)
        return lp

    def teacher_force_logprobs_with_diagnostics(self, sequences: Batch, with_grad: bool = False,
                                                tf_batch_size: int | None = None, compute_rb: bool = False,
                                                return_baseline_features: bool = False,
                                                params_override: Mapping[str, Tensor] | None = None,
                                                buffers_override: Mapping[str, Tensor] | None = None, *,
                                                phase: str = TEACHER_FORCING
                                                ) -> tuple[LogprobResults, DiagnosticsResults]:
        """As `teacher_force_logprobs`, plus per-sequence `DiagnosticsPack`s from the same pass."""
        request = score.ScoreRequest(with_grad, params_override, buffers_override, tf_batch_size, compute_rb,
                                     return_baseline_features, diagnostics=True, phase=phase)
        return self._teacher_force(sequences, request)

    def _teacher_force(self, sequences: Batch, request: score.ScoreRequest
                       ) -> tuple[LogprobResults, DiagnosticsResults | None]:
        if request.grad and (request.params is not None or request.buffers is not None):
            raise ValueError("teacher_force_logprobs: with_grad=True evaluates the live module; "
                             "params_override/buffers_override are for the no-grad path")
        # a with-grad caller that fixes tf_batch_size gets each of its batches in ONE forward
        request = dataclasses.replace(request, can_split=not (request.grad and request.tf_batch_size is not None))
        return score.score(self.policy, sequences, request, logits_fn=self._forward_logits)

    def teacher_force_directional(self, sequences: Batch, v_named: Mapping[str, Tensor], *,
                                  tf_batch_size: int | None = None, phase: str = JVP, order: int = 1
                                  ) -> list[list[dict[str, Tensor]]]:
        """Per [b][g]: `logq`, `rb_entropy`, `d_logq`, `d_rb_entropy` (with order 2 also `d2_logq`,
        `d2_rb_entropy`; float64 [T], CPU) by forward-mode AD along v (`policy.score.jvp`, docs/maths.md §6)."""
        return score.jvp(self.policy, sequences, v_named, tf_batch_size=tf_batch_size, phase=phase,
                         logits_fn=self._forward_logits, order=order)
