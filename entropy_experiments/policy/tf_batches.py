"""Teacher-forcing batches: the B·G rows of a Batch as forwards trimmed to their useful columns.

The logits at absolute position i − 1 score the token at position i (docs/maths.md §1): a batch lists the
positions whose logits are needed and, per scored token, its flat row in the [R·K, V] logits. Running
out of memory splits a batch into halves (down to one row) and retries.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from entropy_experiments.data.batch import Batch
from entropy_experiments.policy.oom import shrink_after_oom, unless_out_of_memory

__all__ = ["TFBatch", "run_with_oom_retry", "split_tf_batch", "tf_batch", "tf_batches"]


@dataclass
class TFBatch:
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


def tf_batches(sequences: Batch, size: int, device: torch.device) -> Iterator[TFBatch]:
    """Split the B·G rows into forwards of `size` rows, each trimmed to its useful columns."""
    B, G = sequences.num_prompts, sequences.num_responses_per_prompt
    pairs = [(b, g) for b in range(B) for g in range(G)]
    for index, start in enumerate(range(0, B * G, size)):
        yield tf_batch(sequences, pairs[start:start + size], index, device)


def tf_batch(sequences: Batch, chunk_pairs: list[tuple[int, int]], index: int,
             device: torch.device) -> TFBatch:
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
    ids = flat_ids[rows, lead:end].to(device)
    mask = mask[:, lead:].to(device)
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    first = min(Lp) - 1 - lead            # first position whose logits are needed
    K = end - 1 - lead - first            # positions first … end−2
    row_idx, tokens = [], []
    for r, (lp, t) in enumerate(zip(Lp, T)):
        offset = lp - 1 - lead - first
        row_idx.append(r * K + offset + torch.arange(t))
        tokens.append(ids[r, lp - lead: lp - lead + t])
    return TFBatch(index=index, pairs=list(chunk_pairs), input_ids=ids, attention_mask=mask,
                   position_ids=position_ids,
                   logit_positions=torch.arange(first, first + K, device=device),
                   rows=torch.cat(row_idx).to(device), tokens=torch.cat(tokens),
                   lengths=T)


def split_tf_batch(sequences: Batch, batch: TFBatch, limit: int | None,
                   device: torch.device) -> list[TFBatch]:
    """`batch` as forwards of at most `limit` rows (same batch index, for error messages)."""
    if limit is None or len(batch.pairs) <= limit:
        return [batch]
    return [tf_batch(sequences, batch.pairs[i:i + limit], batch.index, device)
            for i in range(0, len(batch.pairs), limit)]


def run_with_oom_retry(sequences: Batch, batch: TFBatch, fn: Callable[[TFBatch], Any], *, phase: str,
                       can_split: bool, state: dict, device: torch.device,
                       logger: logging.Logger) -> list[tuple[TFBatch, Any]]:
    """[(sub-batch, fn(sub-batch))]: `batch` in forwards of at most state["limit"] rows, the limit
    halved (logged) whenever one runs out of memory, down to 1 row, then DeviceError."""
    pending = split_tf_batch(sequences, batch, state.get("limit"), device)
    done: list[tuple[TFBatch, Any]] = []
    while pending:
        sub = pending.pop(0)
        result, reason = unless_out_of_memory(partial(fn, sub))
        if reason is None:
            done.append((sub, result))
            continue
        state["limit"] = shrink_after_oom(len(sub.pairs), reason, f"{phase} (batch {sub.index})", logger,
                                          can_split=can_split)
        pending[:0] = split_tf_batch(sequences, sub, state["limit"], device)
    return done
