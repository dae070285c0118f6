"""SequenceProcessor: one engine for sampling, teacher forcing, RB entropies, log q, diagnostics, rewards.

Conventions (seed 004, MATH.md §1):
- B prompts, G responses each; prompts left-padded to ONE padded length Lp per call; a response of
  T tokens sits at [Lp, Lp + T) of its row; everything after it is pad with attention mask 0.
- The logits at absolute position i − 1 score the token at position i.
- q_θ is the sampling policy (temperature + nucleus, `sampling_policy.py`); generation applies it
  through a LogitsProcessor inside HF `generate` with HF's own warpers off, teacher forcing through
  the same `sampling_logits`, so a token is always scored under the measure it was drawn from.
- Stop rule: the first EOS (kept and scored), or the token completing a stop string ("</answer>",
  kept and scored, nothing forced after it), or max_new_tokens. T is found from the FIRST EOS after
  the prompt, which matters where pad == EOS (Qwen, SmolLM2).

Naming: `LogprobResults.logprobs` is log p (raw model, τ = 1, no nucleus) as in the seed;
`token_logqs` is log q (sampling policy) — what the probe uses for ℓ_k. They coincide at τ = 1, top_p = 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from entropy_experiments.errors import ConfigError, DataError, DeviceError, NumericsError, closest_match
from entropy_experiments.utils.distribution_diagnostics import (
    DiagnosticsPack,
    DistributionDiagnostics,
    SequenceDiagnostics,
    TokenStepDiagnostics,
    baseline_features,
)
from entropy_experiments.utils.param_overrides import (
    build_params_override,
    build_state_override,
    live_params_mapping,
    resolve_param_names,
    unwrap_model,
)
from entropy_experiments.utils.precision_utils import (
    PrecisionConfig,
    apply_global_precision,
    forward_precision_ctx,
    str_to_dtype,
)
from entropy_experiments.utils.sampling_policy import (
    NonFiniteLogitsError,
    SamplingPolicyLogitsProcessor,
    policy_token_stats,
    validate_policy,
)

__all__ = [
    "BatchedSequences", "DiagnosticsPack", "DiagnosticsResults", "GenerationConfig", "LogprobResults",
    "SequenceDiagnostics", "SequenceProcessor", "TokenStepDiagnostics",
]


# ---------------------------------------------------------------------------------------------- types
@dataclass
class GenerationConfig:
    """Sampling and scoring settings (the config's `generation` section). Sampling never applies top-k."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 200
    do_sample: bool = True
    num_return_sequences: int = 8
    gen_batch_size: int = 32
    tf_batch_size: int = 8
    rb_requires_grad: bool = False
    pad_token_id: int | None = None          # None ⇒ the tokenizer's pad (else its EOS)
    eos_token_id: int | list[int] | None = None  # None ⇒ tokenizer EOS ∪ the model's generation_config EOS
    stop_strings: list[str] = field(default_factory=lambda: ["</answer>"])
    token_chunk_size: int = 256
    max_prompt_tokens: int | None = None     # None ⇒ max_position_embeddings − max_new_tokens
    prompt_overflow: str = "error"           # "error" | "truncate" (keep the last max_prompt_tokens)

    def validate(self) -> None:
        validate_policy(self.temperature, self.top_p)
        if not self.do_sample:
            raise ConfigError("generation.do_sample: must be true (the probe measures the sampling policy)")
        for key in ("max_new_tokens", "gen_batch_size", "tf_batch_size", "token_chunk_size"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"generation.{key}: must be >= 1, got {getattr(self, key)!r}")
        if self.prompt_overflow not in ("error", "truncate"):
            raise ConfigError(f"generation.prompt_overflow: must be 'error' or 'truncate', got {self.prompt_overflow!r}")
        if self.max_prompt_tokens is not None and int(self.max_prompt_tokens) < 1:
            raise ConfigError(f"generation.max_prompt_tokens: must be >= 1, got {self.max_prompt_tokens!r}")
        if isinstance(self.stop_strings, str) or any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ConfigError(f"generation.stop_strings: must be a list of non-empty strings, got {self.stop_strings!r}")


@dataclass
class BatchedSequences:
    """Generated (or saved) sequences in the packed, left-padded layout.

    sequences / attention_masks: [B, G, L] (long); prompt_lens: [B] padded prompt length Lp;
    gen_lens: [B][G] response lengths T; responses_text: [B][G] decoded responses (special tokens
    skipped); prompts: [B]; examples: [B] data-set records (gold answers) or None; prompt_ids: [B]
    global prompt ids or None.
    """

    sequences: Tensor
    prompt_lens: list[int]
    gen_lens: list[list[int]]
    attention_masks: Tensor
    responses_text: list[list[str]]
    prompts: list[str] | None = None
    examples: list | None = None
    prompt_ids: list[int] | None = None

    @property
    def num_prompts(self) -> int:
        return int(self.sequences.shape[0])

    @property
    def num_responses_per_prompt(self) -> int:
        return int(self.sequences.shape[1])

    def subset(self, prompt_indices: Sequence[int]) -> BatchedSequences:
        """The same layout restricted to the listed prompts (used for microbatches)."""
        idx = [int(i) for i in prompt_indices]
        index = torch.tensor(idx, dtype=torch.long, device=self.sequences.device)

        def pick(xs):
            return None if xs is None else [xs[i] for i in idx]

        return BatchedSequences(
            sequences=self.sequences.index_select(0, index),
            prompt_lens=[self.prompt_lens[i] for i in idx],
            gen_lens=[list(self.gen_lens[i]) for i in idx],
            attention_masks=self.attention_masks.index_select(0, index),
            responses_text=[list(self.responses_text[i]) for i in idx],
            prompts=pick(self.prompts), examples=pick(self.examples), prompt_ids=pick(self.prompt_ids),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain tensors / lists / dicts only (loadable with torch.load(weights_only=True))."""
        examples = None
        if self.examples is not None:
            examples = [dataclasses.asdict(ex) if dataclasses.is_dataclass(ex) else dict(ex) for ex in self.examples]
        return {
            "sequences": self.sequences.detach().cpu(), "attention_masks": self.attention_masks.detach().cpu(),
            "prompt_lens": [int(x) for x in self.prompt_lens],
            "gen_lens": [[int(t) for t in row] for row in self.gen_lens],
            "responses_text": [list(r) for r in self.responses_text],
            "prompts": None if self.prompts is None else list(self.prompts),
            "examples": examples,
            "prompt_ids": None if self.prompt_ids is None else [int(p) for p in self.prompt_ids],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BatchedSequences:
        examples = d.get("examples")
        if examples is not None:
            examples = [_example_from_dict(e) for e in examples]
        return cls(sequences=d["sequences"], prompt_lens=list(d["prompt_lens"]),
                   gen_lens=[list(r) for r in d["gen_lens"]], attention_masks=d["attention_masks"],
                   responses_text=[list(r) for r in d["responses_text"]], prompts=d.get("prompts"),
                   examples=examples, prompt_ids=d.get("prompt_ids"))


def _example_from_dict(e: Any) -> Any:
    if not isinstance(e, Mapping):
        return e
    try:
        from entropy_experiments.datasets import Example
    except ImportError:  # pragma: no cover - the datasets package ships with this one
        return dict(e)
    names = {f.name for f in dataclasses.fields(Example)}
    return Example(**e) if set(e) == names else dict(e)


@dataclass
class LogprobResults:
    """Teacher-forcing results, per [b][g] over the T generated tokens (see module docstring for naming).

    logprobs: log p tensors [T]; entropies: naive surprisal −log q (numpy [T]); sequence_logprobs:
    Σ log p; rb_entropies: RB entropies H_k of q (numpy [T]; empty list unless compute_rb); rewards;
    rb_entropies_torch: graph-carrying H_k (with-grad path, compute_rb and rb_requires_grad);
    baseline_feats_torch: [T, 7] detached features (BASELINE_FEATURE_NAMES); token_logqs: log q [T];
    sequence_logqs: Σ log q (accumulated in float64); token_logps_train / token_entropies_train: log-prob
    and entropy under softmax(logits/τ) with no nucleus, what RL trainers score (graph on the with-grad path).
    """

    logprobs: list[list[Tensor]]
    entropies: list[list[np.ndarray]]
    sequence_logprobs: list[list[float]]
    rb_entropies: list[list[np.ndarray]]
    rewards: list[list[float]]
    rb_entropies_torch: list[list[Tensor]] | None = None
    baseline_feats_torch: list[list[Tensor]] | None = None
    token_logqs: list[list[Tensor]] | None = None
    sequence_logqs: list[list[float]] | None = None
    token_logps_train: list[list[Tensor]] | None = None
    token_entropies_train: list[list[Tensor]] | None = None


@dataclass
class DiagnosticsResults:
    diagnostics: list[list[DiagnosticsPack]]


# ----------------------------------------------------------------------------------- config parsing
_GEN_FIELDS = {f.name for f in dataclasses.fields(GenerationConfig)}


def _as_plain_dict(config: Any) -> dict[str, Any]:
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if hasattr(config, "model_dump"):
        return dict(config.model_dump())
    if isinstance(config, Mapping):
        return dict(config)
    raise ConfigError(f"SequenceProcessor config: expected GenerationConfig, dict or ProbeConfig, got {type(config).__name__}")


def _parse_config(config: Any) -> tuple[GenerationConfig, PrecisionConfig, str, dict[str, Any]]:
    """→ (generation, precision, reward spec, batch_config dict)."""
    if config is None:
        config = GenerationConfig()
    if isinstance(config, GenerationConfig):
        gen, prec, reward, batch = dataclasses.replace(config), PrecisionConfig(), "tag_pref", {}
    else:
        d = _as_plain_dict(config)
        gen_d = dict(d.get("generation") or {})
        for key in gen_d:
            if key not in _GEN_FIELDS:
                hint = closest_match(key, _GEN_FIELDS)
                raise ConfigError(f"unknown key 'generation.{key}'" + (f" (did you mean 'generation.{hint}'?)" if hint else ""))
        gen = GenerationConfig(**gen_d)
        prec = PrecisionConfig.from_dict(d.get("precision"))
        reward = str((d.get("reward") or {}).get("name", "tag_pref"))
        batch = dict(d.get("batch_config") or {})
    if prec.token_chunk_size is not None:  # the probe config keeps the chunk size under `precision`
        gen.token_chunk_size = int(prec.token_chunk_size)
    gen.stop_strings = list(gen.stop_strings or [])
    gen.validate()
    return gen, prec, reward, batch


# ------------------------------------------------------------------------------- stop-rule helpers
def _stopping_criteria_base():
    from transformers import StoppingCriteria

    return StoppingCriteria


class _StopStringCriterion(_stopping_criteria_base()):
    """HF StoppingCriteria: True for rows whose response (after `prompt_len`) newly contains a stop string.

    Each step decodes only a short window of the newest tokens (long enough to hold any stop
    string); a window hit is confirmed on the whole response so far. The post-hoc rule in
    `SequenceProcessor._response_length` stays authoritative: this criterion only saves compute and
    never stops a row earlier than that rule would cut it.
    """

    def __init__(self, tokenizer, stop_strings: list[str], prompt_len: int):
        self.tokenizer = tokenizer
        self.stop_strings = list(stop_strings)
        self.prompt_len = prompt_len
        self.window = max(len(s.encode("utf-8")) for s in self.stop_strings) + 2

    def contains_stop(self, ids: Sequence[int]) -> bool:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return any(s in text for s in self.stop_strings)

    def __call__(self, input_ids: Tensor, scores: Tensor | None = None, **kwargs) -> Tensor:
        gen = input_ids[:, self.prompt_len:]
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if gen.shape[1] == 0:
            return done
        windows = self.tokenizer.batch_decode(gen[:, -self.window:].tolist(), skip_special_tokens=False,
                                              clean_up_tokenization_spaces=False)
        for r, text in enumerate(windows):
            if any(s in text for s in self.stop_strings) and self.contains_stop(gen[r].tolist()):
                done[r] = True
        return done


@contextlib.contextmanager
def _neutral_generation_config(model: nn.Module) -> Iterator[None]:
    """Temporarily give the model (and a PEFT wrapper's base) a blank HF GenerationConfig.

    transformers fills every generate() setting left at None from `model.generation_config`
    (e.g. a checkpoint's min_p, repetition_penalty or suppress_tokens). Blanking it for the call
    guarantees the only logits rule is ours.
    """
    from transformers import GenerationConfig as HFGenerationConfig

    holders = [model]
    if hasattr(model, "get_base_model"):
        holders.append(model.get_base_model())
    saved = []
    for holder in holders:
        if getattr(holder, "generation_config", None) is not None:
            saved.append((holder, holder.generation_config))
            holder.generation_config = HFGenerationConfig()
    try:
        yield
    finally:
        for holder, cfg in saved:
            holder.generation_config = cfg


@contextlib.contextmanager
def _eager_attention(model: nn.Module) -> Iterator[None]:
    """Switch a transformers model to eager attention for the block (forward-mode AD needs it)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(inner, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current in (None, "eager") or not hasattr(inner, "set_attn_implementation"):
        yield
        return
    inner.set_attn_implementation("eager")
    try:
        yield
    finally:
        inner.set_attn_implementation(current)


def chunk_seed(seed: int, index: int) -> int:
    """The torch seed of generation chunk `index` in a call seeded with `seed` (`seed_per_chunk`).

    Chunk 0 uses `seed` itself (a one-chunk call draws exactly what a plain seeded call draws); later
    chunks get a hash of (seed, index), so any chunk can be regenerated alone — which is what lets a
    resumed run skip the chunks it saved and still produce the batch an uninterrupted run produces.
    """
    if index == 0:
        return int(seed)
    import hashlib

    digest = hashlib.sha256(f"{int(seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _oom_reason(exc: BaseException) -> str | None:
    """A one-line description when `exc` is an out-of-memory error (torch.OutOfMemoryError, or a
    RuntimeError saying "out of memory" from older builds / other backends), else None."""
    oom_type = getattr(torch, "OutOfMemoryError", None)
    text = str(exc).strip()
    if (oom_type is not None and isinstance(exc, oom_type)) or (
            isinstance(exc, RuntimeError) and "out of memory" in text.lower()):
        return text.splitlines()[0][:200] if text else type(exc).__name__
    return None


def _unless_out_of_memory(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(fn(), None), or (None, reason) when fn ran out of memory; every other error propagates.

    Returning instead of re-raising drops the exception (and the frames holding its tensors) before
    the caller retries with fewer rows."""
    try:
        return fn(), None
    except NumericsError:
        raise
    except Exception as exc:
        reason = _oom_reason(exc)
        if reason is None:
            raise
        return None, reason


def _release_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _tf_phase(with_grad: bool, compute_rb: bool, override: bool) -> str:
    """What a teacher-forcing call is for in the probe, for error messages."""
    if with_grad:
        return "teacher forcing with grad (E backward)" if compute_rb else "teacher forcing with grad (U gradient)"
    if override:
        return "teacher forcing at θ + η·v (ΔH(η) scoring)"
    return "teacher forcing (E scoring)"


@dataclass
class _TFBatch:
    """One teacher-forcing forward: R rows, their scored positions, flat row indices into [R·K, V]."""

    index: int
    pairs: list[tuple[int, int]]        # (b, g) of each row
    input_ids: Tensor                   # [R, L']
    attention_mask: Tensor              # [R, L']
    position_ids: Tensor                # [R, L']
    logit_positions: Tensor             # [K] positions whose logits are needed
    rows: Tensor                        # [N] indices into the flattened [R·K] logits
    tokens: Tensor                      # [N] scored tokens
    lengths: list[int]                  # T of each row (Σ = N)


# ------------------------------------------------------------------------------------- the engine
class SequenceProcessor:
    """Batched generation and teacher-forced scoring under one sampling policy (seed 004).

    `model` may be a plain HF causal LM, a PEFT model, or wrapped in DDP (unwrapped to `_mdl_target`,
    PEFT kept). `config` is a GenerationConfig, a dict with sections {"generation", "precision"}
    (+ optional "reward": {"name"}, "batch_config": {"dataset_path", "pool_size"}) or a ProbeConfig.
    The process-wide matmul switches of the precision profile are applied at construction unless
    `apply_precision=False`.
    """

    def __init__(self, model: nn.Module, tokenizer, config: Any = None, logger: logging.Logger | None = None,
                 *, apply_precision: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.logger = logger or logging.getLogger("entropy_experiments.sequence_processor")
        self.config, self.precision, self._reward_spec, self._batch_cfg = _parse_config(config)
        self._mdl_target = unwrap_model(model)
        self._fo_cfg = self.precision.func_override
        self._tf_cfg = self.precision.tf_nograd
        self._tf_grad_cfg = self.precision.tf_withgrad
        if apply_precision:
            apply_global_precision(self.precision)
        self.pad_token_id, self.eos_token_ids = self._resolve_special_ids()
        self._params_zero: dict[str, Tensor] | None = None
        self._supports_logits_to_keep = self._forward_accepts("logits_to_keep")
        self._warned: set[str] = set()
        # Optional store of completed generation chunks (results.GenerationChunkStore): seed_per_chunk
        # calls save each chunk there and reuse the ones a killed run saved.
        self.chunk_store = None

    # ------------------------------------------------------------------ setup helpers
    @property
    def device(self) -> torch.device:
        return next(self._mdl_target.parameters()).device

    @property
    def _hf_model(self) -> nn.Module:
        """The transformers model itself (inside a PEFT wrapper, if any)."""
        target = self._mdl_target
        return target.get_base_model() if hasattr(target, "get_base_model") else target

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (used for the EOS-probability diagnostic)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def _resolve_special_ids(self) -> tuple[int, list[int]]:
        cfg, tok = self.config, self.tokenizer
        if cfg.eos_token_id is not None:
            eos = [cfg.eos_token_id] if isinstance(cfg.eos_token_id, int) else list(cfg.eos_token_id)
        else:
            eos = []
            if getattr(tok, "eos_token_id", None) is not None:
                eos.append(int(tok.eos_token_id))
            model_eos = getattr(getattr(self._hf_model, "generation_config", None), "eos_token_id", None)
            for e in ([model_eos] if isinstance(model_eos, int) else list(model_eos or [])):
                if int(e) not in eos:
                    eos.append(int(e))
        if not eos:
            raise ConfigError("generation.eos_token_id: the tokenizer has no EOS token; set generation.eos_token_id")
        pad = cfg.pad_token_id
        if pad is None:
            pad = tok.pad_token_id if getattr(tok, "pad_token_id", None) is not None else eos[0]
        return int(pad), [int(e) for e in eos]

    def _forward_accepts(self, name: str) -> bool:
        try:
            params = inspect.signature(self._hf_model.forward).parameters
        except (TypeError, ValueError):
            return False
        return name in params

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.logger.warning(message)

    def _shrink_after_oom(self, rows: int, reason: str, where: str, *, can_split: bool = True) -> int:
        """Halve the rows per forward after running out of memory (logged); DeviceError at 1 row."""
        if rows <= 1 or not can_split:
            hint = ("a single row does not fit: lower generation.max_new_tokens or use a device with more memory"
                    if rows <= 1 else "this pass needs its rows in one forward: lower estimator.microbatch_size")
            raise DeviceError(f"out of memory during {where} at {rows} row(s) per forward ({reason}); {hint}")
        new = max(1, rows // 2)
        self.logger.warning("out of memory during %s at %d rows per forward; retrying with %d (%s)",
                            where, rows, new, reason)
        _release_memory()
        return new

    def _progress(self, iterable, desc: str, total: int | None = None):
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc, total=total, disable=None, leave=False)

    # ------------------------------------------------------------------ parameter overrides
    def _build_params_override(self, v_named: Mapping[str, Tensor], eta: float) -> dict[str, Tensor]:
        """θ + η·v on the named parameters (formed in func_override.dtype ≥ fp32), live views elsewhere."""
        return build_params_override(self._mdl_target, v_named, eta, dtype=str_to_dtype(self._fo_cfg.dtype),
                                     cast_params=self._fo_cfg.cast_params)

    def _build_state_override(self, v_named: Mapping[str, Tensor] | None, eta: float, *,
                              param_dtype: torch.dtype | None = None, include_buffers: bool = False,
                              buffer_dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        return build_state_override(self._mdl_target, v_named, eta, param_dtype=param_dtype,
                                    include_buffers=include_buffers, buffer_dtype=buffer_dtype)

    def _zero_mapping(self) -> dict[str, Tensor]:
        """The params-only η = 0 mapping: detached views of the live parameters.

        Rebuilt per call (it costs no copies), so it stays right if the model was moved or its
        parameters were replaced since the last call.
        """
        self._params_zero = live_params_mapping(self._mdl_target)
        return self._params_zero

    def _fc_logits_noautocast(self, input_ids: Tensor, attention_mask: Tensor,
                              params_mapping: Mapping[str, Tensor], **kwargs) -> Tensor:
        """One no-grad forward via functional_call, autocast disabled, use_cache=False → logits [n, L, V].

        Position ids default to the mask's (left padding), as everywhere else in this class.
        """
        if "position_ids" not in kwargs:
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        with torch.no_grad(), forward_precision_ctx(False, "float32", self.device.type):
            out = torch.func.functional_call(self._mdl_target, dict(params_mapping), args=(),
                                             kwargs=dict(input_ids=input_ids, attention_mask=attention_mask,
                                                         use_cache=False, **kwargs), strict=False)
        return out.logits

    # ------------------------------------------------------------------ prompts and data
    def sample_prompts(self, dataset_name: str, split: str, num_prompts: int, seed: int | None = None
                       ) -> tuple[list[str], list]:
        """`num_prompts` distinct prompts drawn with a local `random.Random(seed)` → (prompts, examples)."""
        pool = self._load_pool(dataset_name, split)
        if num_prompts > len(pool):
            raise DataError(f"{dataset_name}/{split}: {num_prompts} distinct prompts requested but the pool has {len(pool)}")
        rng = random.Random(seed)
        examples = [pool[i] for i in rng.sample(range(len(pool)), num_prompts)]
        return [ex.question for ex in examples], examples

    def _load_pool(self, dataset_name: str, split: str, max_prompts_pool: int | None = None) -> list:
        from entropy_experiments.datasets import load_examples

        pool = load_examples(dataset_name, split, dataset_path=self._batch_cfg.get("dataset_path"),
                             pool_size=self._batch_cfg.get("pool_size"))
        if max_prompts_pool is not None:
            pool = pool[: int(max_prompts_pool)]
        if not pool:
            raise DataError(f"{dataset_name}/{split}: the prompt pool is empty")
        return pool

    def _max_prompt_tokens(self) -> int | None:
        if self.config.max_prompt_tokens is not None:
            return int(self.config.max_prompt_tokens)
        limit = getattr(getattr(self._hf_model, "config", None), "max_position_embeddings", None)
        if limit is None:
            return None
        room = int(limit) - int(self.config.max_new_tokens)
        if room < 1:
            raise ConfigError(f"generation.max_new_tokens={self.config.max_new_tokens} leaves no room for a prompt "
                              f"in the model's context of {limit} tokens")
        return room

    def _tokenize_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
        """Token ids of each prompt (no padding), checked against max_prompt_tokens."""
        if isinstance(prompts, str):
            raise DataError("prompts: expected a list of strings, got a single string")
        ids = [list(x) for x in self.tokenizer(list(prompts), padding=False)["input_ids"]]
        limit = self._max_prompt_tokens()
        for i, row in enumerate(ids):
            if not row:
                raise DataError(f"prompt {i} is empty after tokenisation")
            if limit is not None and len(row) > limit:
                if self.config.prompt_overflow == "truncate":
                    self.logger.warning("prompt %d has %d tokens; keeping its last %d (generation.prompt_overflow: "
                                        "truncate)", i, len(row), limit)
                    ids[i] = row[-limit:]
                else:
                    raise DataError(f"prompt {i} has {len(row)} tokens, more than generation.max_prompt_tokens={limit} "
                                    "(set generation.prompt_overflow: truncate to keep its last tokens)")
        return ids

    def _left_pad(self, token_lists: Sequence[Sequence[int]], length: int | None = None) -> tuple[Tensor, Tensor]:
        """Left-pad to one length → (ids [n, Lp], mask [n, Lp]) on the model's device."""
        Lp = length if length is not None else max(len(t) for t in token_lists)
        ids = torch.full((len(token_lists), Lp), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(token_lists), Lp), dtype=torch.long)
        for i, row in enumerate(token_lists):
            if row:
                ids[i, Lp - len(row):] = torch.tensor(row, dtype=torch.long)
                mask[i, Lp - len(row):] = 1
        return ids.to(self.device), mask.to(self.device)

    # ------------------------------------------------------------------ generation
    def _hf_generation_config(self, *, output_scores: bool):
        """Generation settings with every HF warper neutral: our LogitsProcessor is the only rule."""
        from transformers import GenerationConfig as HFGenerationConfig

        return HFGenerationConfig(
            do_sample=True, temperature=1.0, top_p=1.0, top_k=0, typical_p=1.0, min_p=None,
            repetition_penalty=1.0, no_repeat_ngram_size=0, num_beams=1, num_return_sequences=1,
            max_new_tokens=int(self.config.max_new_tokens), min_new_tokens=None, min_length=0,
            pad_token_id=self.pad_token_id, eos_token_id=list(self.eos_token_ids), use_cache=True,
            renormalize_logits=False, output_scores=output_scores, return_dict_in_generate=output_scores,
        )

    def _response_length(self, gen_tokens: Sequence[int]) -> int:
        """T by the stop rule (MATH.md §1) for the tokens generated after the prompt.

        First EOS (included); else — or earlier — the token completing a stop string, found by
        binary search on the prefix length ("contains" is monotone in the prefix); else all tokens.
        """
        tokens = [int(t) for t in gen_tokens]
        eos = set(self.eos_token_ids)
        t_eos = next((i + 1 for i, t in enumerate(tokens) if t in eos), None)
        before_eos = (t_eos - 1) if t_eos is not None else len(tokens)
        if self.config.stop_strings and before_eos > 0:
            probe = _StopStringCriterion(self.tokenizer, self.config.stop_strings, 0)
            if probe.contains_stop(tokens[:before_eos]):
                lo, hi = 1, before_eos  # smallest k with a stop string in tokens[:k]
                while lo < hi:
                    mid = (lo + hi) // 2
                    if probe.contains_stop(tokens[:mid]):
                        hi = mid
                    else:
                        lo = mid + 1
                return lo
        return t_eos if t_eos is not None else len(tokens)

    def _generate_rows(self, input_ids: Tensor, attention_mask: Tensor, *, past_key_values: Any = None,
                       output_scores: bool = False) -> tuple[list[list[int]], list[Tensor] | None]:
        """Sample one response per row of the left-padded prompts [R, Lp] with HF generate (KV cache).

        `past_key_values`: optionally a cache already holding the first Lp − 1 prompt positions of
        every row (see `_shared_prompt_cache`); generate then only runs the last prompt token.
        Returns the responses cut at T (token id lists) and, with `output_scores`, HF's processed
        scores per step ([R, V] each: the logits it sampled from, after every processor).
        """
        from transformers import LogitsProcessorList, StoppingCriteriaList

        if self._mdl_target.training:
            self._warn_once("training", "SequenceProcessor: the model is in train() mode (dropout on); "
                                        "the probe expects eval()")
        Lp = int(input_ids.shape[1])
        processors = LogitsProcessorList([SamplingPolicyLogitsProcessor(self.config.temperature, self.config.top_p)])
        criteria = StoppingCriteriaList()
        if self.config.stop_strings:
            criteria.append(_StopStringCriterion(self.tokenizer, self.config.stop_strings, Lp))
        extra = {} if past_key_values is None else {"past_key_values": past_key_values}
        # Autocast off, as in scoring: tokens are drawn from the same fp32 logits they are scored by.
        with torch.no_grad(), _neutral_generation_config(self._mdl_target), \
                forward_precision_ctx(False, "float32", self.device.type):
            out = self._mdl_target.generate(
                input_ids=input_ids, attention_mask=attention_mask,
                generation_config=self._hf_generation_config(output_scores=output_scores),
                logits_processor=processors, stopping_criteria=criteria, **extra,
            )
        sequences = out.sequences if output_scores else out
        generated = sequences[:, Lp:].tolist()
        responses = [row[: self._response_length(row)] for row in generated]
        return responses, (list(out.scores) if output_scores else None)

    def _shared_prompt_cache(self, input_ids: Tensor, attention_mask: Tensor, prompt_index: Tensor) -> Any:
        """KV cache of the first Lp − 1 positions of each distinct prompt, expanded to the rows.

        With G > 1 responses per prompt, running each prompt once instead of G times divides the
        prefill cost (which dominates for long prompts on CPU) by G. input_ids / attention_mask:
        [P, Lp] distinct prompts; prompt_index: [R] the prompt of each row. Position ids come from
        the mask, as generate computes them, so the continuation sees identical positions.
        """
        prefix_ids, prefix_mask = input_ids[:, :-1], attention_mask[:, :-1]
        position_ids = (prefix_mask.long().cumsum(-1) - 1).masked_fill(prefix_mask == 0, 0)
        kwargs: dict[str, Any] = {"logits_to_keep": 1} if self._supports_logits_to_keep else {}
        with torch.no_grad(), forward_precision_ctx(False, "float32", self.device.type):
            out = self._mdl_target(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=position_ids,
                                   use_cache=True, **kwargs)
        cache = out.past_key_values
        cache.batch_select_indices(prompt_index.to(prefix_ids.device))
        return cache

    def _generate_chunk(self, ids: Tensor, mask: Tensor, prompt_index: Tensor, *, output_scores: bool = False
                        ) -> tuple[list[list[int]], list[Tensor] | None]:
        """Generate the rows `prompt_index` (indices into the padded prompts ids/mask [B, Lp]).

        Rows that share a prompt share its prefill through `_shared_prompt_cache`.
        """
        unique, inverse = torch.unique(prompt_index, return_inverse=True)
        cache = None
        if len(unique) < len(prompt_index) and ids.shape[1] > 1:
            cache = self._shared_prompt_cache(ids[unique], mask[unique], inverse)
        return self._generate_rows(ids[prompt_index], mask[prompt_index], past_key_values=cache,
                                   output_scores=output_scores)

    def _pack(self, prompt_tokens: Sequence[Sequence[int]], responses: Sequence[Sequence[Sequence[int]]],
              prompts: Sequence[str] | None = None) -> BatchedSequences:
        """Packed layout from per-prompt token ids [B] and responses [B][G] (token id lists)."""
        B, G = len(prompt_tokens), len(responses[0]) if responses else 0
        Lp = max(len(p) for p in prompt_tokens)
        T_max = max((len(r) for row in responses for r in row), default=0)
        L = Lp + T_max
        seqs = torch.full((B, G, L), self.pad_token_id, dtype=torch.long)
        masks = torch.zeros((B, G, L), dtype=torch.long)
        for b, prompt in enumerate(prompt_tokens):
            p = torch.tensor(list(prompt), dtype=torch.long)
            seqs[b, :, Lp - len(prompt):Lp] = p
            masks[b, :, Lp - len(prompt):Lp] = 1
            for g, resp in enumerate(responses[b]):
                seqs[b, g, Lp:Lp + len(resp)] = torch.tensor(list(resp), dtype=torch.long)
                masks[b, g, Lp:Lp + len(resp)] = 1
        texts = [self.tokenizer.batch_decode([list(r) for r in row], skip_special_tokens=True) for row in responses]
        return BatchedSequences(sequences=seqs, prompt_lens=[Lp] * B, gen_lens=[[len(r) for r in row] for row in responses],
                                attention_masks=masks, responses_text=texts,
                                prompts=list(prompts) if prompts is not None else None)

    @contextlib.contextmanager
    def _seeded(self, seed: int | None) -> Iterator[None]:
        """Seed torch for the block without touching the caller's RNG state; no-op when seed is None."""
        if seed is None:
            yield
            return
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(int(seed))
            yield

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
        prompt_tokens = self._tokenize_prompts(prompts)
        ids, mask = self._left_pad(prompt_tokens)
        B, R = len(prompt_tokens), len(prompt_tokens) * G
        chunk = int(gen_batch_size or self.config.gen_batch_size)
        if seed_per_chunk and self.chunk_store is not None and done_chunks is None and on_chunk is None:
            done_chunks, on_chunk = self.chunk_store.open({
                "seed": int(seed), "G": int(G), "chunk": chunk, "prompt_tokens": prompt_tokens,
                "generation": dataclasses.asdict(self.config)})
            if done_chunks:
                self.logger.info("generation: reusing %d saved chunk(s) of %d", len(done_chunks), -(-R // chunk))
        responses: list[list[int]] = []
        state = {"limit": chunk}  # rows per generate call; shrinks for the rest of the call after an OOM
        starts = list(range(0, R, chunk))
        with contextlib.nullcontext() if seed_per_chunk else self._seeded(seed):
            for i, start in enumerate(self._progress(starts, "generate", total=len(starts))):
                stop = min(start + chunk, R)
                saved = (done_chunks or {}).get(i) if seed_per_chunk else None
                if saved is not None and len(saved) == stop - start:
                    responses.extend([list(map(int, r)) for r in saved])
                    continue
                reseed = chunk_seed(seed, i) if seed_per_chunk else None
                with self._seeded(reseed):
                    rows = self._generate_span(ids, mask, start, stop, G, i, state, reseed)
                if on_chunk is not None:
                    on_chunk(i, rows)
                responses.extend(rows)
        grouped = [responses[b * G:(b + 1) * G] for b in range(B)]
        return self._pack(prompt_tokens, grouped, prompts)

    def _generate_span(self, ids: Tensor, mask: Tensor, start: int, stop: int, G: int, index: int,
                       state: dict, reseed: int | None) -> list[list[int]]:
        """Rows [start, stop) in calls of at most state["limit"] rows, halving that limit on OOM.

        After an OOM the chunk starts again from its own seed (when it has one), so what it draws
        does not depend on how far the failed attempt got.
        """
        while True:
            limit = state["limit"]
            rows, reason = _unless_out_of_memory(partial(self._generate_span_once, ids, mask, start, stop, G, index, limit))
            if reason is None:
                return rows
            state["limit"] = self._shrink_after_oom(limit, reason, f"generation (chunk {index}, rows {start}-{stop - 1})")
            if reseed is not None:
                torch.manual_seed(int(reseed))

    def _generate_span_once(self, ids: Tensor, mask: Tensor, start: int, stop: int, G: int, index: int,
                            limit: int) -> list[list[int]]:
        """Rows [start, stop) of chunk `index` in calls of at most `limit` rows."""
        rows: list[list[int]] = []
        for s in range(start, stop, limit):
            prompt_index = torch.arange(s, min(s + limit, stop), device=ids.device) // G
            try:
                part, _ = self._generate_chunk(ids, mask, prompt_index)
            except NonFiniteLogitsError as exc:
                b, g = divmod(s + exc.row, G)
                raise NumericsError(f"non-finite logits in generation: chunk {index}, sequence b={b} g={g}, "
                                    f"token {getattr(exc, 'position', ids.shape[1]) - ids.shape[1]}") from None
            rows.extend(part)
        return rows

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
            seqs.prompt_ids = [_global_prompt_id(ex, i) for i, ex in enumerate(examples)]
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
        for key in ("prompts", "examples", "dataset_name", "num_prompts", "split"):
            if key in kwargs:
                raise ConfigError(f"generate_with_replacement_sampling: '{key}' cannot be passed here")
        pool = self._load_pool(dataset_name, split, max_prompts_pool)
        rng = random.Random(seed)
        drawn = [rng.randrange(len(pool)) for _ in range(int(total_sequences))]
        counts = Counter(drawn)
        self.logger.info("replacement sampling: pool %d prompts, %d draws, %d unique, largest repeat %d",
                         len(pool), len(drawn), len(counts), max(counts.values()))
        examples = [pool[i] for i in drawn]
        return self.generate_with_logprobs(prompts=[ex.question for ex in examples], G=1, seed=seed,
                                           examples=examples, **kwargs)

    # ------------------------------------------------------------------ rewards
    def _compute_rewards(self, prompts: Sequence[str], sequences: BatchedSequences,
                         examples: Sequence | None = None) -> list[list[float]]:
        """Rewards [B][G] through the reward registry (config `reward.name`, default tag_pref).

        Prompts without an example (no gold answer) get 0.0 with ONE loud warning; reward-function
        failures propagate (RewardError naming the prompt) rather than silently becoming zeros. The
        reward is called in its own convention (probe or TRL style, `rewards/calling.py`); TRL-style
        functions also get each response's token ids as `completion_ids`.
        """
        from entropy_experiments.rewards import compute_rewards, get_reward

        examples = examples if examples is not None else sequences.examples
        fn = get_reward(self._reward_spec)
        G = sequences.num_responses_per_prompt
        out: list[list[float]] = []
        for b, prompt in enumerate(prompts):
            example = examples[b] if examples is not None else None
            if example is None:
                self._warn_once("no_examples", "rewards: no data-set example (gold answer) for some prompts; "
                                               "their rewards are 0.0 — pass examples= with explicit prompts")
                out.append([0.0] * G)
                continue
            meta = getattr(example, "meta", None) or {}
            pid = f", prompt id {meta['global_prompt_id']}" if "global_prompt_id" in meta else ""
            rewards = compute_rewards(fn, prompt, list(sequences.responses_text[b]), example,
                                      completion_ids=self._completion_ids(sequences, b),
                                      where=f" (prompt {b + 1} of {len(prompts)}{pid})")
            out.append([float(r) for r in rewards])
        return out

    @staticmethod
    def _completion_ids(sequences: BatchedSequences, b: int) -> list[list[int]]:
        """Token ids of prompt b's G responses (the gen_lens[b][g] tokens after the padded prompt)."""
        start = sequences.prompt_lens[b]
        row = sequences.sequences[b]
        return [row[g, start:start + T].tolist() for g, T in enumerate(sequences.gen_lens[b])]

    # ------------------------------------------------------------------ teacher forcing: batching
    def _tf_batches(self, sequences: BatchedSequences, tf_batch_size: int | None) -> Iterator[_TFBatch]:
        """Split the B·G rows into forwards of `tf_batch_size` rows, each trimmed to its useful columns."""
        B, G = sequences.num_prompts, sequences.num_responses_per_prompt
        pairs = [(b, g) for b in range(B) for g in range(G)]
        size = int(tf_batch_size or self.config.tf_batch_size)
        for index, start in enumerate(range(0, B * G, size)):
            yield self._tf_batch(sequences, pairs[start:start + size], index)

    def _split_tf_batch(self, sequences: BatchedSequences, batch: _TFBatch, limit: int | None) -> list[_TFBatch]:
        """`batch` as forwards of at most `limit` rows (same batch index, for error messages)."""
        if limit is None or len(batch.pairs) <= limit:
            return [batch]
        return [self._tf_batch(sequences, batch.pairs[i:i + limit], batch.index)
                for i in range(0, len(batch.pairs), limit)]

    def _oom_guarded(self, sequences: BatchedSequences, batch: _TFBatch, fn: Callable[[_TFBatch], Any], *,
                     phase: str, can_split: bool, state: dict) -> list[tuple[_TFBatch, Any]]:
        """[(sub-batch, fn(sub-batch))]: `batch` in forwards of at most state["limit"] rows, the limit
        halved (logged) whenever one runs out of memory, down to 1 row, then DeviceError."""
        pending = self._split_tf_batch(sequences, batch, state.get("limit"))
        done: list[tuple[_TFBatch, Any]] = []
        while pending:
            sub = pending.pop(0)
            result, reason = _unless_out_of_memory(partial(fn, sub))
            if reason is None:
                done.append((sub, result))
                continue
            state["limit"] = self._shrink_after_oom(len(sub.pairs), reason, f"{phase} (batch {sub.index})",
                                                    can_split=can_split)
            pending[:0] = self._split_tf_batch(sequences, sub, state["limit"])
        return done

    def _tf_batch(self, sequences: BatchedSequences, chunk_pairs: list[tuple[int, int]], index: int) -> _TFBatch:
        """One forward over the rows `chunk_pairs` ((b, g) pairs), trimmed to its useful columns."""
        seqs, masks = sequences.sequences, sequences.attention_masks
        B, G, L = seqs.shape
        flat_ids, flat_mask = seqs.reshape(B * G, L), masks.reshape(B * G, L)
        rows = torch.tensor([b * G + g for b, g in chunk_pairs], dtype=torch.long)
        Lp = [int(sequences.prompt_lens[b]) for b, _ in chunk_pairs]
        T = [int(sequences.gen_lens[b][g]) for b, g in chunk_pairs]
        end = max(lp + t for lp, t in zip(Lp, T))
        mask = flat_mask[rows, :end]
        # Drop leading columns that are padding in every row (positions come from the mask).
        lead = int(mask.any(dim=0).long().argmax())
        ids = flat_ids[rows, lead:end].to(self.device)
        mask = mask[:, lead:].to(self.device)
        position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        first = min(Lp) - 1 - lead            # first position whose logits are needed
        K = end - 1 - lead - first            # positions first … end−2
        row_idx, tokens = [], []
        for r, (lp, t) in enumerate(zip(Lp, T)):
            offset = lp - 1 - lead - first
            row_idx.append(r * K + offset + torch.arange(t))
            tokens.append(ids[r, lp - lead: lp - lead + t])
        return _TFBatch(index=index, pairs=list(chunk_pairs), input_ids=ids, attention_mask=mask,
                        position_ids=position_ids,
                        logit_positions=torch.arange(first, first + K, device=self.device),
                        rows=torch.cat(row_idx).to(self.device), tokens=torch.cat(tokens),
                        lengths=T)

    def _forward_logits(self, batch: _TFBatch, mapping: Mapping[str, Tensor] | None, profile) -> Tensor:
        """Logits [R, K, V] at the batch's needed positions; live module when `mapping` is None."""
        kwargs: dict[str, Any] = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                                  "position_ids": batch.position_ids, "use_cache": False}
        if self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = batch.logit_positions
        with forward_precision_ctx(profile.autocast, profile.dtype, self.device.type):
            if mapping is None:
                out = self._mdl_target(**kwargs)
            else:
                out = torch.func.functional_call(self._mdl_target, dict(mapping), args=(), kwargs=kwargs, strict=False)
        logits = out.logits
        if not self._supports_logits_to_keep:
            logits = logits[:, batch.logit_positions]
        if profile.cast_logits_fp32 and logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return logits

    def _token_stats(self, logits: Tensor, batch: _TFBatch, *, diagnostics: bool, checkpoint: bool,
                     phase: str = "teacher forcing") -> dict[str, Tensor]:
        """Chunked policy statistics of the batch's scored tokens; NumericsError names (batch, b, g)."""
        try:
            return policy_token_stats(logits, batch.tokens, self.config.temperature, self.config.top_p,
                                      fp64=self.precision.entropy_fp64, chunk_size=self.config.token_chunk_size,
                                      rows=batch.rows, diagnostics=diagnostics, eos_token_id=self.eos_token_id,
                                      checkpoint=checkpoint)
        except NonFiniteLogitsError as exc:
            raise _located_numerics_error(batch, exc, phase) from None

    # ------------------------------------------------------------------ teacher forcing: public
    def teacher_force_logprobs(self, sequences: BatchedSequences, with_grad: bool = False,
                               tf_batch_size: int | None = None, compute_rb: bool = False,
                               return_baseline_features: bool = False,
                               params_override: Mapping[str, Tensor] | None = None,
                               buffers_override: Mapping[str, Tensor] | None = None) -> LogprobResults:
        """Score the generated tokens of `sequences` (see `_teacher_force`)."""
        lp, _ = self._teacher_force(sequences, with_grad=with_grad, tf_batch_size=tf_batch_size, compute_rb=compute_rb,
                                    return_baseline_features=return_baseline_features, params_override=params_override,
                                    buffers_override=buffers_override, diagnostics=False)
        return lp

    def teacher_force_logprobs_with_diagnostics(self, sequences: BatchedSequences, with_grad: bool = False,
                                                tf_batch_size: int | None = None, compute_rb: bool = False,
                                                return_baseline_features: bool = False,
                                                params_override: Mapping[str, Tensor] | None = None,
                                                buffers_override: Mapping[str, Tensor] | None = None
                                                ) -> tuple[LogprobResults, DiagnosticsResults]:
        """As `teacher_force_logprobs`, plus per-sequence `DiagnosticsPack`s from the same pass."""
        lp, diags = self._teacher_force(sequences, with_grad=with_grad, tf_batch_size=tf_batch_size,
                                        compute_rb=compute_rb, return_baseline_features=return_baseline_features,
                                        params_override=params_override, buffers_override=buffers_override,
                                        diagnostics=True)
        return lp, diags

    def _teacher_force(self, sequences: BatchedSequences, *, with_grad: bool, tf_batch_size: int | None,
                       compute_rb: bool, return_baseline_features: bool, params_override: Mapping[str, Tensor] | None,
                       buffers_override: Mapping[str, Tensor] | None, diagnostics: bool
                       ) -> tuple[LogprobResults, DiagnosticsResults | None]:
        """Both paths share batching and token maths; they differ only in how logits are produced.

        No-grad: `torch.func.functional_call` with `params_override` (θ + η·v) or the η = 0 mapping
        of live views; forward under precision.func_override when an override is given, else
        precision.tf_nograd; outputs detached on CPU. With-grad: the live module under
        precision.tf_withgrad; `logprobs` / `token_logqs` (and `rb_entropies_torch` when compute_rb and
        rb_requires_grad) carry the graph; chunk maths is checkpointed so its vocabulary-sized
        intermediates are recomputed in backward instead of kept.
        """
        if with_grad and (params_override is not None or buffers_override is not None):
            raise ValueError("teacher_force_logprobs: with_grad=True evaluates the live module; "
                             "params_override/buffers_override are for the no-grad path")
        want_diag = diagnostics or return_baseline_features
        if with_grad:
            mapping, profile = None, self._tf_grad_cfg
        else:
            mapping = dict(params_override) if params_override is not None else self._zero_mapping()
            if buffers_override is not None:
                mapping.update(buffers_override)
            profile = self._fo_cfg if params_override is not None else self._tf_cfg
        B, G = sequences.num_prompts, sequences.num_responses_per_prompt
        per_seq: dict[tuple[int, int], dict[str, Tensor]] = {}
        batches = list(self._tf_batches(sequences, tf_batch_size))
        grad_ctx = torch.enable_grad() if with_grad else torch.no_grad()
        phase = _tf_phase(with_grad, compute_rb, params_override is not None)
        # A with-grad caller that fixes tf_batch_size needs each of its batches in ONE forward (the
        # backward row hooks count rows per forward), so that pass cannot be split after an OOM.
        can_split = not (with_grad and tf_batch_size is not None)
        state: dict = {}

        def run(batch: _TFBatch) -> dict[str, Tensor]:
            logits = self._forward_logits(batch, mapping, profile)
            return self._token_stats(logits, batch, diagnostics=want_diag, checkpoint=with_grad, phase=phase)

        with grad_ctx:
            for batch in self._progress(batches, "teacher forcing" + (" (grad)" if with_grad else "")):
                for sub, stats in self._oom_guarded(sequences, batch, run, phase=phase, can_split=can_split,
                                                    state=state):
                    split = {k: torch.split(v, sub.lengths) for k, v in stats.items()}
                    for r, pair in enumerate(sub.pairs):
                        per_seq[pair] = {k: split[k][r] for k in split}
        return self._assemble(per_seq, B, G, sequences, with_grad=with_grad, compute_rb=compute_rb,
                              baseline=return_baseline_features, diagnostics=diagnostics)

    def _assemble(self, per_seq: dict[tuple[int, int], dict[str, Tensor]], B: int, G: int,
                  sequences: BatchedSequences, *, with_grad: bool, compute_rb: bool, baseline: bool,
                  diagnostics: bool) -> tuple[LogprobResults, DiagnosticsResults | None]:
        def grid(fn):
            return [[fn(per_seq[(b, g)], b, g) for g in range(G)] for b in range(B)]

        def keep(t: Tensor) -> Tensor:
            return t if with_grad else t.detach().cpu()

        logq_np = grid(lambda s, b, g: s["logq"].detach().double().cpu().numpy())
        lp = LogprobResults(
            logprobs=grid(lambda s, b, g: keep(s["logp"])),
            entropies=[[-x for x in row] for row in logq_np],
            sequence_logprobs=grid(lambda s, b, g: float(s["logp"].detach().double().sum())),
            rb_entropies=grid(lambda s, b, g: s["rb_entropy"].detach().double().cpu().numpy()) if compute_rb else [],
            rewards=[[0.0] * G for _ in range(B)],
            token_logqs=grid(lambda s, b, g: keep(s["logq"])),
            sequence_logqs=[[float(x.sum()) for x in row] for row in logq_np],
            token_logps_train=grid(lambda s, b, g: keep(s["logp_train"])),
            token_entropies_train=grid(lambda s, b, g: keep(s["entropy_train"])),
        )
        if with_grad and compute_rb and self.config.rb_requires_grad:
            lp.rb_entropies_torch = grid(lambda s, b, g: s["rb_entropy"])
        if baseline:
            lp.baseline_feats_torch = grid(lambda s, b, g: baseline_features(s, self.config.max_new_tokens).cpu())
        diags = None
        if diagnostics:
            dd = DistributionDiagnostics(self.config.top_p, self.config.temperature, self.eos_token_id,
                                         fp64=self.precision.entropy_fp64, chunk_size=self.config.token_chunk_size)
            diags = DiagnosticsResults(diagnostics=grid(lambda s, b, g: dd.from_token_stats(
                s, _response_tokens(sequences, b, g))))
        return lp, diags

    # ------------------------------------------------------------------ directional derivatives
    def teacher_force_directional(self, sequences: BatchedSequences, v_named: Mapping[str, Tensor], *,
                                  tf_batch_size: int | None = None) -> list[list[dict[str, Tensor]]]:
        """Per [b][g]: `logq`, `rb_entropy`, `d_logq`, `d_rb_entropy`, each float64 [T] on CPU.

        d_x = D_v x = d/dη x(θ + η·v) at η = 0, exact, by forward-mode AD (`torch.func.jvp`) through
        `functional_call` with the named parameters as primals and v as tangents, under eager
        attention (MATH.md §6). Token maths in float64. The forward uses precision.func_override.
        """
        base = self._zero_mapping()
        names = resolve_param_names(base, list(v_named))
        primal_names = [names[k] for k in v_named]
        tangents = {}
        for key, name in names.items():
            theta, v = base[name], v_named[key]
            if tuple(v.shape) != tuple(theta.shape):
                raise ConfigError(f"update vector: '{key}' has shape {tuple(v.shape)}, parameter has {tuple(theta.shape)}")
            tangents[name] = v.detach().to(device=theta.device, dtype=theta.dtype)
        primals = {name: base[name] for name in primal_names}
        B, G = sequences.num_prompts, sequences.num_responses_per_prompt
        out: list[list[dict[str, Tensor] | None]] = [[None] * G for _ in range(B)]
        profile = self._fo_cfg
        with _eager_attention(self._mdl_target), torch.no_grad():
            phase, state = "teacher forcing (jvp, E directional derivatives)", {}

            def run(batch: _TFBatch) -> tuple:
                def scores(p: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
                    logits = self._forward_logits(batch, {**base, **p}, profile)
                    st = policy_token_stats(logits, batch.tokens, self.config.temperature, self.config.top_p,
                                            fp64=True, chunk_size=self.config.token_chunk_size, rows=batch.rows)
                    return st["logq"], st["rb_entropy"]

                try:
                    return torch.func.jvp(scores, (primals,), (tangents,))
                except NonFiniteLogitsError as exc:
                    raise _located_numerics_error(batch, exc, phase) from None

            for batch in self._progress(list(self._tf_batches(sequences, tf_batch_size)), "teacher forcing (jvp)"):
                for sub, ((logq, ent), (d_logq, d_ent)) in self._oom_guarded(sequences, batch, run, phase=phase,
                                                                             can_split=True, state=state):
                    parts = [torch.split(t.detach().cpu(), sub.lengths) for t in (logq, ent, d_logq, d_ent)]
                    for r, (b, g) in enumerate(sub.pairs):
                        out[b][g] = {"logq": parts[0][r], "rb_entropy": parts[1][r],
                                     "d_logq": parts[2][r], "d_rb_entropy": parts[3][r]}
        return out  # type: ignore[return-value]


def _located_numerics_error(batch: _TFBatch, exc: NonFiniteLogitsError,
                            phase: str = "teacher forcing") -> NumericsError:
    """Turn a flat scored-row index into the (phase, batch, b, g, token) the user can look up."""
    r = int(np.searchsorted(np.cumsum(batch.lengths), exc.row, side="right"))
    b, g = batch.pairs[r]
    return NumericsError(f"non-finite logits in {phase}: batch {batch.index}, sequence b={b} g={g}, "
                         f"token {exc.row - sum(batch.lengths[:r])}")


def _response_tokens(sequences: BatchedSequences, b: int, g: int) -> Tensor:
    Lp, T = int(sequences.prompt_lens[b]), int(sequences.gen_lens[b][g])
    return sequences.sequences[b, g, Lp:Lp + T]


def _global_prompt_id(example: Any, default: int) -> int:
    meta = getattr(example, "meta", None)
    if meta is None and isinstance(example, Mapping):
        meta = example.get("meta")
    if isinstance(meta, Mapping) and "global_prompt_id" in meta:
        return int(meta["global_prompt_id"])
    return int(default)
