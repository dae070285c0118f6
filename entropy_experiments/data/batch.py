"""The packed batch dict that flows from sampling into ProbeComponents (batch contract, docs/development.md "Layout").

Keys: sequences [B,G,L] (token ids, prompt left-padded to one length), attention_masks [B,G,L],
prompt_lens [B] (the padded prompt length), gen_lens [B][G], advantages [B,G] (zeros for E),
rewards [B][G], max_lengths [B] (== max_g gen_lens[b]), prompt_ids [B], num_prompts,
num_responses_per_prompt; plus prompts [B] and responses_text [B][G] for the run directory.
Every batch is checked by `validate_batch` where it is packed or loaded. The one batch type: packing
(`pack_batch`), prompt subsets (`subset_batch`, with the policy's `take_prompts` / `take_rows`) and
concatenation across ranks (`concat_batches`) all live here; its teacher-forcing view is
`policy.sequences.batch_to_sequences`. The advantages are the objective's (`estimators/objectives.py`):
the caller forms them and hands them in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..policy.sequences import BatchedSequences, take_prompts, take_rows


class BatchContractError(ValueError):
    """A packed batch violates the batch contract (docs/development.md "Layout"): a bug upstream, or a corrupt saved batch."""


def pack_batch(seqs: BatchedSequences, rewards: list[list[float]] | None,
               advantages: Tensor | None = None) -> dict[str, Any]:
    """Pack a `BatchedSequences` (+ rewards [B][G] and advantages [B, G]) into the batch dict.

    E batches pass no rewards and no advantages (zeros); U batches pass the contract's mean-centred
    A = r − mean_g r (`estimators.objectives.advantages`; the trainer objective forms its own, possibly
    std-scaled, advantages from `rewards`).
    """
    B, G = seqs.sequences.shape[:2]
    rewards = rewards if rewards is not None else [[0.0] * G for _ in range(B)]
    reward_tensor = torch.tensor(rewards, dtype=torch.float32).reshape(B, G)
    advantages = torch.zeros(B, G) if advantages is None else advantages.float().reshape(B, G)
    batch = {
        "sequences": seqs.sequences.cpu(),
        "attention_masks": seqs.attention_masks.cpu(),
        "prompt_lens": [int(x) for x in seqs.prompt_lens],
        "gen_lens": [[int(t) for t in row] for row in seqs.gen_lens],
        "advantages": advantages,
        "rewards": [[float(r) for r in row] for row in reward_tensor.tolist()],
        "max_lengths": [max(int(t) for t in row) for row in seqs.gen_lens],
        "prompt_ids": [int(p) for p in (seqs.prompt_ids or range(B))],
        "num_prompts": int(B),
        "num_responses_per_prompt": int(G),
        "prompts": list(seqs.prompts or [""] * B),
        "responses_text": [list(r) for r in (seqs.responses_text or [[""] * G for _ in range(B)])],
    }
    validate_batch(batch)
    return batch


def validate_batch(batch: dict[str, Any], name: str = "batch") -> None:
    """Check every invariant of the contract; raise BatchContractError naming the first violation."""
    required = ("sequences", "attention_masks", "prompt_lens", "gen_lens", "advantages", "rewards",
                "max_lengths", "prompt_ids", "num_prompts", "num_responses_per_prompt")
    for key in required:
        if key not in batch:
            raise BatchContractError(f"{name}: missing key '{key}'")
    seq = batch["sequences"]
    if seq.dim() != 3:
        raise BatchContractError(f"{name}: sequences must be [B,G,L], got shape {tuple(seq.shape)}")
    B, G, L = seq.shape
    if batch["num_prompts"] != B or batch["num_responses_per_prompt"] != G:
        raise BatchContractError(f"{name}: num_prompts/num_responses_per_prompt {batch['num_prompts']}/"
                                 f"{batch['num_responses_per_prompt']} disagree with sequences {B}x{G}")
    if tuple(batch["attention_masks"].shape) != (B, G, L):
        raise BatchContractError(f"{name}: attention_masks shape {tuple(batch['attention_masks'].shape)} != {(B, G, L)}")
    if tuple(batch["advantages"].shape) != (B, G):
        raise BatchContractError(f"{name}: advantages shape {tuple(batch['advantages'].shape)} != {(B, G)}")
    for key in ("prompt_lens", "max_lengths", "prompt_ids", "gen_lens", "rewards"):
        if len(batch[key]) != B:
            raise BatchContractError(f"{name}: {key} has {len(batch[key])} entries, expected {B}")
    for b in range(B):
        lens = batch["gen_lens"][b]
        if len(lens) != G or len(batch["rewards"][b]) != G:
            raise BatchContractError(f"{name}: prompt {b} has {len(lens)} gen_lens / "
                                     f"{len(batch['rewards'][b])} rewards, expected {G}")
        if min(lens) < 1:
            raise BatchContractError(f"{name}: prompt {b} has an empty response (gen_len 0)")
        if batch["max_lengths"][b] != max(lens):
            raise BatchContractError(f"{name}: max_lengths[{b}]={batch['max_lengths'][b]} != max(gen_lens)={max(lens)}")
        if batch["prompt_lens"][b] + max(lens) > L:
            raise BatchContractError(f"{name}: prompt {b}: prompt_len + gen_len exceeds L={L}")


def subset_batch(batch: dict[str, Any], prompt_indices: list[int]) -> dict[str, Any]:
    """The batch restricted to the given prompts (keeps the padded layout; num_prompts updated)."""
    out = dict(batch)
    for key in ("sequences", "attention_masks", "advantages"):
        out[key] = take_prompts(batch[key], prompt_indices)
    for key in ("prompt_lens", "gen_lens", "rewards", "max_lengths", "prompt_ids", "prompts", "responses_text"):
        if key in batch and batch[key] is not None:
            out[key] = take_rows(batch[key], prompt_indices)
    if "rewards_per_function" in batch:
        out["rewards_per_function"] = {name: take_rows(rows, prompt_indices)
                                       for name, rows in batch["rewards_per_function"].items()}
    out["num_prompts"] = len(prompt_indices)
    return out


def concat_batches(parts: Sequence[dict], pad_id: int) -> dict:
    """Concatenate packed batches (prompt-major) into one, re-padding to a common layout.

    Each part has its own padded prompt length Lp and total length L; the result left-pads every
    prompt to the largest Lp and right-pads to the largest response, so that every (prompt, response)
    keeps its tokens and mask (teacher forcing trims the shared padding of each forward again).
    """
    parts = [p for p in parts if p is not None and p["num_prompts"] > 0]
    if len(parts) == 1:
        return parts[0]
    G = parts[0]["num_responses_per_prompt"]
    if any(p["num_responses_per_prompt"] != G for p in parts):
        raise ValueError("concat_batches: parts have different numbers of responses per prompt")
    Lp = max(max(p["prompt_lens"]) for p in parts)
    T = max(max(p["max_lengths"]) for p in parts)
    L = Lp + T
    seqs, masks = [], []
    for p in parts:
        B, _, Lx = p["sequences"].shape
        s = torch.full((B, G, L), pad_id, dtype=p["sequences"].dtype)
        m = torch.zeros((B, G, L), dtype=p["attention_masks"].dtype)
        for b in range(B):
            shift = Lp - p["prompt_lens"][b]
            width = min(Lx, L - shift)
            s[b, :, shift:shift + width] = p["sequences"][b, :, :width]
            m[b, :, shift:shift + width] = p["attention_masks"][b, :, :width]
        seqs.append(s)
        masks.append(m)
    out: dict[str, Any] = {
        "sequences": torch.cat(seqs), "attention_masks": torch.cat(masks),
        "prompt_lens": [Lp] * sum(p["num_prompts"] for p in parts),
        "advantages": torch.cat([p["advantages"] for p in parts]),
        "num_prompts": sum(p["num_prompts"] for p in parts), "num_responses_per_prompt": G,
    }
    for key in ("gen_lens", "rewards", "max_lengths", "prompt_ids", "prompts", "responses_text"):
        if all(key in p and p[key] is not None for p in parts):
            out[key] = [x for p in parts for x in p[key]]
    if all("rewards_per_function" in p for p in parts):  # U: each reward function's values, and the weights
        out["rewards_per_function"] = {name: [row for p in parts for row in p["rewards_per_function"][name]]
                                       for name in parts[0]["rewards_per_function"]}
        out["reward_weights"] = parts[0]["reward_weights"]
    validate_batch(out, "gathered batch")
    return out


def count_tokens(batch: dict[str, Any]) -> int:
    """Total response tokens Σ_b Σ_g T_bg."""
    return int(sum(sum(row) for row in batch["gen_lens"]))


def zero_advantage_prompts(batch: dict[str, Any]) -> int:
    """Prompts whose advantages are all zero (they add nothing to the U gradient)."""
    return int((batch["advantages"].abs().sum(dim=1) == 0).sum())
