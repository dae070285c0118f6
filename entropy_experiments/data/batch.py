"""`Batch`: the one packed batch that flows from sampling through every phase of the probe.

Fields (the batch contract, docs/development.md "Layout"): sequences [B,G,L] (token ids, prompt left-padded to one length),
attention_masks [B,G,L], prompt_lens [B] (the padded prompt length), gen_lens [B][G], advantages [B,G]
(zeros for E), rewards [B][G], prompt_ids [B]; prompts [B] and responses_text [B][G] for the run
directory; on a U batch sampled with reward functions also rewards_per_function {name: [B][G]} and
reward_weights {name: weight}; sampler_logqs [B,G,L] (float32, aligned with sequences: at a response
position, log q_sampler of that token under the sampler that drew it; 0 elsewhere) when the sampler is not
the scored policy, else None (docs/maths.md §12). num_prompts, num_responses_per_prompt and max_lengths [B] (== max_g
gen_lens[b]) follow from these. Packing (`Batch.pack`), checks (`validate`), prompt subsets (`subset`),
concatenation across ranks (`Batch.concat`) and counts live here. The advantages are the objective's
(`estimators/objectives.py`): the caller forms them and hands them in.

The same type is what generation returns and teacher forcing scores (policy/): a batch just generated has
zero advantages and rewards, prompt_ids None unless the caller sets them, and may carry `examples` [B] (the
data-set records, e.g. gold answers; kept in memory, saved only by the seed API's batches).

On disk (E_batch.pt / U_batch.pt) and in the seed API (compat/) a batch is a plain dict with the same
keys plus the derived ones: `to_dict` / `from_dict` convert at that boundary only (`from_dict` checks
the dict, its stored counts included). `from_dict` also reads the seed API's older sequences dicts (no
advantages, rewards or counts; `examples` as plain dicts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Batch", "BatchContractError", "completion_ids", "take_prompts", "take_rows"]

_REQUIRED_KEYS = ("sequences", "attention_masks", "prompt_lens", "gen_lens", "advantages", "rewards",
                  "max_lengths", "prompt_ids", "num_prompts", "num_responses_per_prompt")
_OPTIONAL_KEYS = ("prompts", "responses_text", "rewards_per_function", "reward_weights", "sampler_logqs", "generation")
_PER_PROMPT_LISTS = ("prompt_lens", "gen_lens", "rewards", "prompt_ids", "prompts", "responses_text", "examples")
#: keys of the seed API's sequences dict (no advantages, rewards or counts)
_SEQUENCE_KEYS = ("sequences", "attention_masks", "prompt_lens", "gen_lens")


def take_prompts(tensor: Tensor, prompt_indices: Sequence[int]) -> Tensor:
    """The rows [b] of a [B, ...] tensor for the listed prompts, in that order (index on the tensor's device)."""
    index = torch.tensor([int(i) for i in prompt_indices], dtype=torch.long, device=tensor.device)
    return tensor[index]


def take_rows(rows: list | None, prompt_indices: Sequence[int]) -> list | None:
    """The entries of a per-prompt list [B] for the listed prompts (None stays None)."""
    return None if rows is None else [rows[int(i)] for i in prompt_indices]


def completion_ids(sequences: Batch, b: int) -> list[list[int]]:
    """Token ids of prompt b's G responses (the gen_lens[b][g] tokens after the padded prompt)."""
    start = sequences.prompt_lens[b]
    row = sequences.sequences[b]
    return [row[g, start:start + T].tolist() for g, T in enumerate(sequences.gen_lens[b])]


class BatchContractError(ValueError):
    """A packed batch violates the batch contract (docs/development.md "Layout"): a bug upstream, or a corrupt saved batch."""


@dataclass
class Batch:
    """A packed batch: generated, scored, E or U (see the module docstring for each field's shape).
    advantages and rewards left out are zeros."""

    sequences: Tensor
    attention_masks: Tensor
    prompt_lens: list[int]
    gen_lens: list[list[int]]
    advantages: Tensor | None = None
    rewards: list[list[float]] | None = None
    prompt_ids: list[int] | None = None
    prompts: list[str] | None = None
    responses_text: list[list[str]] | None = None
    rewards_per_function: dict[str, list[list[float]]] | None = None
    reward_weights: dict[str, float] | None = None
    sampler_logqs: Tensor | None = None
    generation: dict | None = None  # how the batch was drawn (the sampler's record: dtype, engine, draws, rows)
    examples: list | None = None  # the data-set records of the prompts (in memory; not in E_batch.pt / U_batch.pt)

    def __post_init__(self) -> None:
        B, G = int(self.sequences.shape[0]), int(self.sequences.shape[1]) if self.sequences.dim() > 1 else 0
        if self.advantages is None:
            self.advantages = torch.zeros(B, G)
        if self.rewards is None:
            self.rewards = [[0.0] * G for _ in range(B)]

    # ------------------------------------------------------------------ counts
    @property
    def num_prompts(self) -> int:
        return int(self.sequences.shape[0])

    @property
    def num_responses_per_prompt(self) -> int:
        return int(self.sequences.shape[1])

    @property
    def num_sequences(self) -> int:
        """B · G."""
        return self.num_prompts * self.num_responses_per_prompt

    @property
    def max_lengths(self) -> list[int]:
        """max_g T_bg per prompt."""
        return [max(int(t) for t in row) for row in self.gen_lens]

    def count_tokens(self) -> int:
        """Total response tokens Σ_b Σ_g T_bg."""
        return int(sum(sum(row) for row in self.gen_lens))

    def sampler_sequence_logq(self) -> Tensor | None:
        """[B, G] float64: Σ_t log q_sampler(y_t | y_<t) of each response (None: the sampler is the policy)."""
        if self.sampler_logqs is None:
            return None
        return self.sampler_logqs.double().sum(dim=-1)

    def sampler_response_logqs(self) -> list[Tensor] | None:
        """Per sequence n = b·G + g, the sampler's log q of each response token (float64 [T_bg]); None: the
        sampler is the policy."""
        if self.sampler_logqs is None:
            return None
        return [self.sampler_logqs[b, g, self.prompt_lens[b]:self.prompt_lens[b] + self.gen_lens[b][g]].double()
                for b in range(self.num_prompts) for g in range(self.num_responses_per_prompt)]

    def zero_advantage_prompts(self) -> int:
        """Prompts whose advantages are all zero (they add nothing to the U gradient)."""
        return int((self.advantages.abs().sum(dim=1) == 0).sum())

    # ------------------------------------------------------------------ making one
    @classmethod
    def pack(cls, seqs: Batch, rewards: list[list[float]] | None,
             advantages: Tensor | None = None) -> Batch:
        """A generated batch packed as an E or U batch (+ rewards [B][G] and advantages [B, G]): on the CPU,
        plain ints, prompt ids (0..B−1 unless set), prompts and responses_text filled, examples left out.

        E batches pass no rewards and no advantages (zeros); U batches pass the contract's mean-centred
        A = r − mean_g r (`estimators.objectives.advantages`; the trainer objective forms its own, possibly
        std-scaled, advantages from `rewards`).
        """
        B, G = seqs.sequences.shape[:2]
        rewards = rewards if rewards is not None else [[0.0] * G for _ in range(B)]
        reward_tensor = torch.tensor(rewards, dtype=torch.float32).reshape(B, G)
        batch = cls(
            sequences=seqs.sequences.cpu(),
            attention_masks=seqs.attention_masks.cpu(),
            prompt_lens=[int(x) for x in seqs.prompt_lens],
            gen_lens=[[int(t) for t in row] for row in seqs.gen_lens],
            advantages=torch.zeros(B, G) if advantages is None else advantages.float().reshape(B, G),
            rewards=[[float(r) for r in row] for row in reward_tensor.tolist()],
            prompt_ids=[int(p) for p in (seqs.prompt_ids or range(B))],
            prompts=list(seqs.prompts or [""] * B),
            responses_text=[list(r) for r in (seqs.responses_text or [[""] * G for _ in range(B)])],
            sampler_logqs=None if seqs.sampler_logqs is None else seqs.sampler_logqs.detach().float().cpu(),
        )
        batch.validate()
        return batch

    def validate(self, name: str = "batch") -> None:
        """Check every invariant of the contract; raise BatchContractError naming the first violation."""
        seq = self.sequences
        if seq.dim() != 3:
            raise BatchContractError(f"{name}: sequences must be [B,G,L], got shape {tuple(seq.shape)}")
        B, G, L = seq.shape
        if tuple(self.attention_masks.shape) != (B, G, L):
            raise BatchContractError(f"{name}: attention_masks shape {tuple(self.attention_masks.shape)} != "
                                     f"{(B, G, L)}")
        if self.sampler_logqs is not None and tuple(self.sampler_logqs.shape) != (B, G, L):
            raise BatchContractError(f"{name}: sampler_logqs shape {tuple(self.sampler_logqs.shape)} != {(B, G, L)}")
        if tuple(self.advantages.shape) != (B, G):
            raise BatchContractError(f"{name}: advantages shape {tuple(self.advantages.shape)} != {(B, G)}")
        for key in _PER_PROMPT_LISTS:
            rows = getattr(self, key)
            if rows is not None and len(rows) != B:
                raise BatchContractError(f"{name}: {key} has {len(rows)} entries, expected {B}")
        for b in range(B):
            lens = self.gen_lens[b]
            if len(lens) != G or len(self.rewards[b]) != G:
                raise BatchContractError(f"{name}: prompt {b} has {len(lens)} gen_lens / "
                                         f"{len(self.rewards[b])} rewards, expected {G}")
            if min(lens) < 1:
                raise BatchContractError(f"{name}: prompt {b} has an empty response (gen_len 0)")
            if self.prompt_lens[b] + max(lens) > L:
                raise BatchContractError(f"{name}: prompt {b}: prompt_len + gen_len exceeds L={L}")

    # ------------------------------------------------------------------ pieces
    def subset(self, prompt_indices: list[int]) -> Batch:
        """The batch restricted to the given prompts (keeps the padded layout)."""
        per_function = None
        if self.rewards_per_function is not None:
            per_function = {name: take_rows(rows, prompt_indices) for name, rows in self.rewards_per_function.items()}
        return Batch(
            sequences=take_prompts(self.sequences, prompt_indices),
            attention_masks=take_prompts(self.attention_masks, prompt_indices),
            advantages=take_prompts(self.advantages, prompt_indices),
            **{key: take_rows(getattr(self, key), prompt_indices) for key in _PER_PROMPT_LISTS},
            rewards_per_function=per_function, reward_weights=self.reward_weights,
            sampler_logqs=None if self.sampler_logqs is None else take_prompts(self.sampler_logqs, prompt_indices),
            generation=self.generation,
        )

    @staticmethod
    def concat(parts: Sequence[Batch | None], pad_id: int) -> Batch:
        """Concatenate packed batches (prompt-major) into one, re-padding to a common layout.

        Each part has its own padded prompt length Lp and total length L; the result left-pads every
        prompt to the largest Lp and right-pads to the largest response, so that every (prompt, response)
        keeps its tokens and mask (teacher forcing trims the shared padding of each forward again).
        """
        parts = [p for p in parts if p is not None and p.num_prompts > 0]
        if len(parts) == 1:
            return parts[0]
        G = parts[0].num_responses_per_prompt
        if any(p.num_responses_per_prompt != G for p in parts):
            raise ValueError("Batch.concat: parts have different numbers of responses per prompt")
        Lp = max(max(p.prompt_lens) for p in parts)
        L = Lp + max(max(p.max_lengths) for p in parts)
        if len({p.sampler_logqs is None for p in parts}) > 1:
            raise ValueError("Batch.concat: some parts carry sampler log-probs and some do not")
        padded = [_repadded(p, Lp, L, pad_id) for p in parts]
        lists = {key: (None if any(getattr(p, key) is None for p in parts)
                       else [x for p in parts for x in getattr(p, key)]) for key in _PER_PROMPT_LISTS[1:]}
        per_function = weights = None
        if all(p.rewards_per_function is not None for p in parts):  # U: each reward function's values, the weights
            per_function = {name: [row for p in parts for row in p.rewards_per_function[name]]
                            for name in parts[0].rewards_per_function}
            weights = parts[0].reward_weights
        sampler = None if parts[0].sampler_logqs is None else torch.cat([q for _, _, q in padded])
        out = Batch(sequences=torch.cat([s for s, _, _ in padded]), attention_masks=torch.cat([m for _, m, _ in padded]),
                    prompt_lens=[Lp] * sum(p.num_prompts for p in parts),
                    advantages=torch.cat([p.advantages for p in parts]), **lists,
                    rewards_per_function=per_function, reward_weights=weights, sampler_logqs=sampler,
                    generation=_gathered_record([p.generation for p in parts]))
        out.validate("gathered batch")
        return out

    # ------------------------------------------------------------------ the file / seed-API boundary
    def to_dict(self) -> dict[str, Any]:
        """The plain dict saved as E_batch.pt / U_batch.pt and handed out by the seed API (same keys and
        order as ever; optional keys that are None are left out)."""
        out: dict[str, Any] = {
            "sequences": self.sequences, "attention_masks": self.attention_masks,
            "prompt_lens": self.prompt_lens, "gen_lens": self.gen_lens, "advantages": self.advantages,
            "rewards": self.rewards, "max_lengths": self.max_lengths, "prompt_ids": self.prompt_ids,
            "num_prompts": self.num_prompts, "num_responses_per_prompt": self.num_responses_per_prompt,
        }
        for key in _OPTIONAL_KEYS:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.examples is not None:  # a seed-API batch's records, as plain dicts (torch.load weights_only)
            out["examples"] = [dataclasses.asdict(ex) if dataclasses.is_dataclass(ex) else dict(ex)
                               for ex in self.examples]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str = "batch") -> Batch:
        """A batch from its dict form (a saved E_batch.pt / U_batch.pt, or the seed API's), checked:
        every required key present, the stored counts and max_lengths agreeing with the tensors. The seed API's
        older sequences dict (an `examples` key and no counts) is read as a batch with zero rewards."""
        if "examples" in d and "num_prompts" not in d:
            return cls._from_sequences_dict(d, name)
        for key in _REQUIRED_KEYS:
            if key not in d:
                raise BatchContractError(f"{name}: missing key '{key}'")
        batch = cls(**{key: d[key] for key in ("sequences", "attention_masks", "prompt_lens", "gen_lens",
                                               "advantages", "rewards", "prompt_ids")},
                    **{key: d.get(key) for key in _OPTIONAL_KEYS}, examples=d.get("examples"))
        if batch.sequences.dim() == 3 and (d["num_prompts"] != batch.num_prompts
                                           or d["num_responses_per_prompt"] != batch.num_responses_per_prompt):
            raise BatchContractError(f"{name}: num_prompts/num_responses_per_prompt {d['num_prompts']}/"
                                     f"{d['num_responses_per_prompt']} disagree with sequences "
                                     f"{batch.num_prompts}x{batch.num_responses_per_prompt}")
        batch.validate(name)
        stored = d["max_lengths"]
        if len(stored) != batch.num_prompts:
            raise BatchContractError(f"{name}: max_lengths has {len(stored)} entries, expected {batch.num_prompts}")
        for b, (saved, actual) in enumerate(zip(stored, batch.max_lengths, strict=True)):
            if saved != actual:
                raise BatchContractError(f"{name}: max_lengths[{b}]={saved} != max(gen_lens)={actual}")
        return batch

    @classmethod
    def _from_sequences_dict(cls, d: Mapping[str, Any], name: str) -> Batch:
        """The seed API's sequences dict (sequences, attention_masks, prompt_lens, gen_lens, responses_text,
        prompts, examples, prompt_ids); the examples stay the plain dicts they were saved as."""
        for key in _SEQUENCE_KEYS:
            if key not in d:
                raise BatchContractError(f"{name}: missing key '{key}'")
        examples = d.get("examples")
        return cls(sequences=d["sequences"], attention_masks=d["attention_masks"], prompt_lens=list(d["prompt_lens"]),
                   gen_lens=[list(r) for r in d["gen_lens"]], prompt_ids=d.get("prompt_ids"), prompts=d.get("prompts"),
                   responses_text=None if d.get("responses_text") is None else [list(r) for r in d["responses_text"]],
                   examples=None if examples is None else list(examples))


def _gathered_record(records: list[dict | None]) -> dict | None:
    """The generation record of batches drawn side by side (one per rank): the first one's settings, the new
    tokens of all, the longest part's seconds (the parts ran at once) and the tokens/s that follow."""
    if any(r is None for r in records):
        return None
    out = dict(records[0])
    if all(isinstance(r.get("new_tokens"), int) and isinstance(r.get("seconds"), (int, float)) for r in records):
        out["new_tokens"] = sum(r["new_tokens"] for r in records)
        out["seconds"] = max(r["seconds"] for r in records)
        out["tokens_per_s"] = out["new_tokens"] / out["seconds"] if out["seconds"] > 0 else None
        out["parts"] = len(records)
    return out


def _repadded(part: Batch, Lp: int, L: int, pad_id: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """`part`'s sequences, masks (and sampler log-probs) moved into the [B, G, L] layout whose prompts end at Lp."""
    B, G, Lx = part.sequences.shape
    s = torch.full((B, G, L), pad_id, dtype=part.sequences.dtype)
    m = torch.zeros((B, G, L), dtype=part.attention_masks.dtype)
    q = None if part.sampler_logqs is None else torch.zeros((B, G, L), dtype=part.sampler_logqs.dtype)
    for b in range(B):
        shift = Lp - part.prompt_lens[b]
        width = min(Lx, L - shift)
        s[b, :, shift:shift + width] = part.sequences[b, :, :width]
        m[b, :, shift:shift + width] = part.attention_masks[b, :, :width]
        if q is not None:
            q[b, :, shift:shift + width] = part.sampler_logqs[b, :, :width]
    return s, m, q
