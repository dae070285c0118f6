"""The attribution phase (docs/attribution.md): which U prompt groups push δH₁ and which E tokens change their
entropy along the step, from what the earlier phases computed (estimators/attribution.py for the maths).

- U groups: from the SE_U jackknife's leave-one-group-out directions (no extra pass); needs the error bars
  (`variance.enabled`) and at least two groups.
- E tokens: H_t and lr·D_v H_t per realised token from the forward-mode jvp scores of E along v — the same
  scores the `jvp` pieces method already made (reused), else the scores of the one pass along v that the probe
  shares between the second order and the attribution (probe/tangent.py, handed in as `along_v`), unless
  `output.token_attribution` is off. Their sum is the `direct_only` predictor. Under the sampler's weights
  (docs/maths.md §12) each token's dH carries its sequence's s_i, and D is the weighted one.
"""

from __future__ import annotations

from ..config import ProbeConfig
from ..data.batch import Batch
from ..estimators.attribution import TokenAttribution, influence_summary, token_summary, u_group_influences
from ..estimators.error_bars import ErrorBars
from ..estimators.objective_gradient import split_into_groups, u_terms
from ..estimators.sequence_scores import SequenceScores
from .results import DeltaH1Result, Policy

TOP_K_TOKENS = 20


def u_attribution(config: ProbeConfig, U: Batch, res: DeltaH1Result, bars: ErrorBars) -> dict | None:
    """{groups: [...] sorted by |influence|, summary} (None: no leave-one-group-out directions)."""
    if len(bars.loo_directions) < 2:
        return None
    groups = split_into_groups(U.num_prompts, len(res.u_gradients.group_sizes))
    if [len(g) for g in groups] != list(res.u_gradients.group_sizes):
        raise ValueError(f"U groups {res.u_gradients.group_sizes} are not the contiguous split of "
                         f"{U.num_prompts} prompts")
    terms = u_terms(U, config.objective_options())
    advantages = [[t.advantage for t in row] for row in terms]
    rows = u_group_influences(res.delta_h1, res.X_hat, bars.loo_directions, res.learning_rate, groups,
                              U.rewards, advantages)
    return {"groups": rows, "summary": influence_summary(res.delta_h1, rows)}


def response_token_ids(E: Batch, lengths: list[int]) -> list[int]:
    """The realised response tokens of every E sequence (sequence n = b·G + g), flat, in order."""
    G = E.num_responses_per_prompt
    ids = []
    for n, T in enumerate(lengths):
        b, g = divmod(n, G)
        start = int(E.prompt_lens[b])
        ids.extend(int(t) for t in E.sequences[b, g, start:start + T].tolist())
    return ids


def e_token_attribution(policy: Policy, E: Batch, res: DeltaH1Result,
                        along_v: SequenceScores | None) -> tuple[dict, dict]:
    """(results.json `attribution.E_tokens`, the E_tokens table's columns) of every realised E token, from the E
    pass's jvp scores when it made them, else from `along_v` (the scores of the shared pass along v)."""
    scores = res.scores if res.scores.d_entropy is not None else along_v
    if scores is None or scores.d_entropy is None:
        raise ValueError("the token attribution needs E's jvp scores along v: none were made")
    tokens = TokenAttribution.from_scores(scores.token_entropies, scores.d_entropy, res.learning_rate,
                                          res.sampler_weights)
    ids = response_token_ids(E, [len(h) for h in scores.token_entropies])
    tokenizer = policy.tokenizer if policy.tokenizer is not None else policy.engine.tokenizer
    texts = tokenizer.batch_decode([[t] for t in ids])  # each token decoded on its own
    columns = {"sequence": tokens.sequence, "position": tokens.position, "token_id": ids, "token": texts,
               "H": tokens.H, "dH": tokens.dH}
    return token_summary(tokens, float(res.coefficients.D), ids, texts, TOP_K_TOKENS), columns


def attribution_phase(config: ProbeConfig, policy: Policy, E: Batch, U: Batch, res: DeltaH1Result, bars: ErrorBars,
                      along_v: SequenceScores | None) -> tuple[dict, dict | None]:
    """(results.json `attribution` {U_groups, U_summary, E_tokens} with None for what is off, E token columns);
    `along_v`: E's scores with their derivatives along v from the shared pass (None: none made)."""
    out: dict = {"U_groups": None, "U_summary": None, "E_tokens": None}
    u = u_attribution(config, U, res, bars)
    if u is not None:
        out["U_groups"], out["U_summary"] = u["groups"], u["summary"]
    columns = None
    if config.output.token_attribution:
        out["E_tokens"], columns = e_token_attribution(policy, E, res, along_v)
    return out, columns
