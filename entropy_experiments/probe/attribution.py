"""The attribution phase (docs/attribution.md): which U prompt groups push δH₁ and which E tokens change their
entropy along the step, from what the earlier phases computed (estimators/attribution.py for the maths).

- U groups: from the SE_U jackknife's leave-one-group-out directions (no extra pass); needs the error bars
  (`variance.enabled`) and at least two groups.
- E tokens: H_t and lr·D_v H_t per realised token, unless `output.token_attribution` is off. D_v H_t is exact where
  a forward-mode pass along v was made anyway (the `jvp` pieces method's scores, or the second order's order-2
  pass, probe/tangent.py, handed in as `along_v`); otherwise, with `output.token_attribution_method:
  finite_difference` (the default), a difference of the per-token entropies of the ΔH passes at θ ± η·v
  (estimators/token_derivatives.py; `token_choice` picks the η), and with `jvp` the order-1 pass along v that
  tangent.py makes for it. Their sum is the `direct_only` predictor. Under the sampler's weights (docs/maths.md
  §12) each token's dH carries its sequence's s_i, and D is the weighted one.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from ..config import ProbeConfig
from ..data.batch import Batch
from ..estimators.attribution import TokenAttribution, influence_summary, token_summary, u_group_influences
from ..estimators.delta_h import DeltaH
from ..estimators.error_bars import ErrorBars
from ..estimators.objective_gradient import split_into_groups, u_terms
from ..estimators.sequence_scores import SequenceScores
from ..estimators.token_derivatives import (
    ERROR_SHARE_MAX,
    FORWARD_ETA_MAX,
    TokenPassChoice,
    token_derivatives,
    token_errors,
    token_pass_choice,
)
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


def token_choice(config: ProbeConfig) -> TokenPassChoice | None:
    """The ΔH passes whose per-token entropies give D_v H_t (`token_derivatives.token_pass_choice` over the
    importance η grid); None: the attribution takes a forward-mode pass (`output.token_attribution_method: jvp`,
    the attribution off, or no ΔH pass)."""
    out = config.output
    if not out.token_attribution or out.token_attribution_method != "finite_difference" or not config.importance.enabled:
        return None
    return token_pass_choice(config.delta_h_etas())


def token_rows(config: ProbeConfig, res: DeltaH1Result, along_v: SequenceScores | None,
               truth: DeltaH | None) -> tuple[list[Tensor], list[Tensor], dict]:
    """(H_t, D_v H_t per E sequence, how D_v H_t was made {method, eta, errors: its estimated error per token per
    sequence or None}): exact from jvp scores where a pass made them (the E pass's, else `along_v`), else the
    difference of the ΔH passes (`truth`) that `token_choice` names."""
    for scores in (res.scores, along_v):
        if scores is not None and scores.d_entropy is not None:
            return scores.token_entropies, scores.d_entropy, {"method": "jvp", "eta": None, "errors": None}
    choice = token_choice(config)
    if choice is None or truth is None or any(e not in truth.token_entropies for e in choice.etas()):
        raise ValueError("the token attribution needs E's jvp scores along v or the ΔH passes' per-token "
                         "entropies: neither was made")
    base = res.scores.token_entropies
    d = token_derivatives(choice, truth.token_entropies, base)
    return base, d, {"method": f"{choice.kind}_difference", "eta": choice.eta,
                     "errors": token_errors(choice, truth.token_entropies, base)}


def error_summary(how: dict, errors: TokenAttribution | None, tokens: TokenAttribution) -> dict:
    """results.json `attribution.E_tokens.dH_error`: the largest estimated error of a token's dH (nats, like dH),
    its share of the largest |dH_t|, how it was estimated, and `warning` past ERROR_SHARE_MAX."""
    if how["method"] == "jvp":
        return {"max": 0.0, "share_of_largest": 0.0, "basis": "exact (forward mode), to fp32 rounding"}
    if errors is None:
        return {"max": None, "share_of_largest": None,
                "basis": f"forward difference at η ≤ {FORWARD_ETA_MAX:g}: no pair to estimate its error; measured "
                         "against the jvp at most 1.9 % of the largest |dH_t| (docs/attribution.md)"}
    largest = float(np.abs(tokens.dH).max()) if len(tokens) else 0.0
    worst = float(np.abs(errors.dH).max()) if len(errors) else 0.0
    share = worst / largest if largest > 0 else None
    out = {"max": worst, "share_of_largest": share,
           "basis": f"{how['method']} at η {how['eta']:g}: truncation estimated from the other passes "
                    "(estimators/token_derivatives.py)"}
    if share is None or share > ERROR_SHARE_MAX:
        out["warning"] = (f"attribution: a token's dH (the {how['method'].replace('_', ' ')} at η {how['eta']:g}) "
                          f"may be off by up to {worst:.2g}, {'?' if share is None else f'{share:.0%}'} of the "
                          f"largest |dH_t| (warned above {ERROR_SHARE_MAX:.0%}): set "
                          "output.token_attribution_method: jvp for the exact values")
    return out


def e_token_attribution(policy: Policy, E: Batch, res: DeltaH1Result,
                        rows: tuple[list[Tensor], list[Tensor], dict]) -> tuple[dict, dict]:
    """(results.json `attribution.E_tokens`, the E_tokens table's columns) of every realised E token from `rows`
    (`token_rows`: H_t, D_v H_t per sequence and how D_v H_t was made)."""
    entropies, derivatives, how = rows
    tokens = TokenAttribution.from_scores(entropies, derivatives, res.learning_rate, res.sampler_weights)
    errors = (None if how["errors"] is None
              else TokenAttribution.from_scores(entropies, how["errors"], res.learning_rate, res.sampler_weights))
    ids = response_token_ids(E, [len(h) for h in entropies])
    tokenizer = policy.tokenizer if policy.tokenizer is not None else policy.engine.tokenizer
    texts = tokenizer.batch_decode([[t] for t in ids])  # each token decoded on its own
    columns = {"sequence": tokens.sequence, "position": tokens.position, "token_id": ids, "token": texts,
               "H": tokens.H, "dH": tokens.dH}
    summary = token_summary(tokens, float(res.coefficients.D), ids, texts, TOP_K_TOKENS)
    return {**summary, "dH_method": how["method"], "dH_eta": how["eta"],
            "dH_error": error_summary(how, errors, tokens)}, columns


def attribution_phase(config: ProbeConfig, policy: Policy, E: Batch, U: Batch, res: DeltaH1Result, bars: ErrorBars,
                      along_v: SequenceScores | None, truth: DeltaH | None = None) -> tuple[dict, dict | None]:
    """(results.json `attribution` {U_groups, U_summary, E_tokens} with None for what is off, E token columns);
    `along_v`: E's scores with their derivatives along v from the shared pass (None: none made); `truth`: the ΔH
    passes (their per-token entropies at the η of `token_choice`)."""
    out: dict = {"U_groups": None, "U_summary": None, "E_tokens": None}
    u = u_attribution(config, U, res, bars)
    if u is not None:
        out["U_groups"], out["U_summary"] = u["groups"], u["summary"]
    columns = None
    if config.output.token_attribution:
        out["E_tokens"], columns = e_token_attribution(policy, E, res, token_rows(config, res, along_v, truth))
    return out, columns
