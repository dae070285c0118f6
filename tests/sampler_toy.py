"""E batches drawn by a sampler that is NOT the scored policy, for the sampler-correction tests (docs/maths.md §12).

The sampler is the policy's own model with another temperature (and/or nucleus) applied inside the sampler
only, through the one sampling rule `policy.sampling_policy.sampling_logits`, in float64, and optionally a logit
bias {token id: b} added to the sampler's logits after it (a = z/τ + b, e.g. on EOS, which moves the length
distribution and so the entropy the probe measures). Its exact per-token log q_s (bias included) fills
`Batch.sampler_logqs`, so the probe's importance weights s_i = q_θ(y_i)/q_s(y_i) are known exactly up to the
probe's own fp32 scoring of ℓ.

- `draw_from_sampler(E, model64, tokenizer, temperature=..., max_new=..., seed=..., logit_bias=...)`: a new E batch with the same
  prompts as `E` (same rows, same prompt padding) and responses drawn ancestrally from the sampler, with
  `sampler_logqs` filled;
- `sampler_token_logqs(E, model64, temperature=..., logit_bias=...)`: the [B, G, L] float32 log q_s of the responses already in
  `E` (e.g. the policy's own log q, for a "sampler equal to the policy" batch);
- `with_sampler_logqs(E, logqs)`: `E` with that tensor as its `sampler_logqs` (None: the uncorrected batch).

`model64` is a float64 copy of the policy model (`copy.deepcopy(probe.model).double()`); rows that share a
prompt go through one forward without padding (a causal model's logits at a position do not see later ones,
so right padding of the responses changes nothing).
"""

from __future__ import annotations

import dataclasses

import torch

from entropy_experiments.data.batch import Batch
from entropy_experiments.policy.sampling_policy import sampling_logits


def prompt_ids_of(E: Batch, b: int) -> list[int]:
    """The (unpadded) prompt token ids of E's prompt b."""
    Lp = E.prompt_lens[b]
    keep = E.attention_masks[b, 0, :Lp].bool()
    return [int(t) for t in E.sequences[b, 0, :Lp][keep].tolist()]


def _rows_by_prompt(E: Batch) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """{prompt ids: [(b, g), ...]} over every row of E."""
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for b in range(E.num_prompts):
        key = tuple(prompt_ids_of(E, b))
        groups.setdefault(key, []).extend((b, g) for g in range(E.num_responses_per_prompt))
    return groups


@torch.no_grad()
def _sampler_logq(model64, x: torch.Tensor, temperature: float, top_p: float,
                  logit_bias: dict[int, float] | None) -> torch.Tensor:
    """log q_s(· | x[:, :j+1]) for every position j: [n, len, V] float64 (the bias added after τ and top_p)."""
    logits = model64(input_ids=x).logits.double()
    a = sampling_logits(logits, temperature, top_p)
    if logit_bias:
        bias = torch.zeros(a.shape[-1], dtype=a.dtype)
        for token, b in logit_bias.items():
            bias[token] = b
        a = a + bias
    return torch.log_softmax(a, dim=-1)


@torch.no_grad()
def _draw(model64, prompt: list[int], n: int, *, temperature: float, top_p: float,
          logit_bias: dict[int, float] | None, max_new: int, eos: int, gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """n responses to `prompt` from the sampler: (tokens [n, max_new] right-padded with eos, lengths [n]); a
    response ends at its first eos (included) or after max_new tokens."""
    x = torch.tensor([prompt] * n, dtype=torch.long)
    done = torch.zeros(n, dtype=torch.bool)
    lengths = torch.full((n,), max_new, dtype=torch.long)
    for k in range(max_new):
        probs = _sampler_logq(model64, x, temperature, top_p, logit_bias)[:, -1].exp()
        tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
        tok = torch.where(done, torch.full_like(tok, eos), tok)
        ended = ~done & (tok == eos)
        lengths[ended] = k + 1
        done |= ended
        x = torch.cat([x, tok[:, None]], dim=1)
    return x[:, len(prompt):], lengths.tolist()


def sampler_token_logqs(E: Batch, model64, *, temperature: float, top_p: float = 1.0,
                        logit_bias: dict[int, float] | None = None) -> torch.Tensor:
    """[B, G, L] float32: log q_s of each response token of E under the sampler (temperature, top_p, logit bias),
    0 elsewhere."""
    out = torch.zeros(E.sequences.shape, dtype=torch.float32)
    for prompt, rows in _rows_by_prompt(E).items():
        width = max(E.gen_lens[b][g] for b, g in rows)
        resp = torch.stack([E.sequences[b, g, E.prompt_lens[b]:E.prompt_lens[b] + width] for b, g in rows])
        x = torch.cat([torch.tensor([list(prompt)] * len(rows), dtype=torch.long), resp], dim=1)
        logq = _sampler_logq(model64, x, temperature, top_p, logit_bias)[:, len(prompt) - 1:-1]
        token_logq = logq.gather(-1, resp[..., None])[..., 0]
        for j, (b, g) in enumerate(rows):
            T, Lp = E.gen_lens[b][g], E.prompt_lens[b]
            out[b, g, Lp:Lp + T] = token_logq[j, :T].float()
    return out


def draw_from_sampler(E: Batch, model64, tokenizer, *, temperature: float, max_new: int, seed: int,
                      top_p: float = 1.0, logit_bias: dict[int, float] | None = None) -> Batch:
    """A batch with E's prompts (rows, padding, ids, advantages) whose responses the sampler drew, with its exact
    `sampler_logqs`."""
    gen = torch.Generator().manual_seed(seed)
    eos = int(tokenizer.eos_token_id)
    B, G = E.num_prompts, E.num_responses_per_prompt
    L = max(E.prompt_lens) + max_new
    sequences = torch.full((B, G, L), eos, dtype=E.sequences.dtype)
    masks = torch.zeros((B, G, L), dtype=E.attention_masks.dtype)
    gen_lens = [[0] * G for _ in range(B)]
    texts = [[""] * G for _ in range(B)]
    for prompt, rows in _rows_by_prompt(E).items():
        tokens, lengths = _draw(model64, list(prompt), len(rows), temperature=temperature, top_p=top_p,
                                logit_bias=logit_bias, max_new=max_new, eos=eos, gen=gen)
        for j, (b, g) in enumerate(rows):
            Lp, T = E.prompt_lens[b], lengths[j]
            sequences[b, g, :Lp] = E.sequences[b, g, :Lp]
            masks[b, g, :Lp] = E.attention_masks[b, g, :Lp]
            sequences[b, g, Lp:Lp + T] = tokens[j, :T]
            masks[b, g, Lp:Lp + T] = 1
            gen_lens[b][g] = T
            texts[b][g] = tokenizer.decode(tokens[j, :T].tolist(), skip_special_tokens=True)
    drawn = dataclasses.replace(E, sequences=sequences, attention_masks=masks, gen_lens=gen_lens,
                                responses_text=texts, sampler_logqs=None)
    logqs = sampler_token_logqs(drawn, model64, temperature=temperature, top_p=top_p, logit_bias=logit_bias)
    drawn = with_sampler_logqs(drawn, logqs)
    drawn.validate("sampler-drawn E")
    return drawn


def with_sampler_logqs(E: Batch, logqs: torch.Tensor | None) -> Batch:
    """E with `logqs` as its sampler log-probs (None: as if the sampler were the policy — no correction)."""
    return dataclasses.replace(E, sampler_logqs=logqs)
