"""ProbeComponents: pure compute on packed batches (no sampling).

Given the evaluation batch E and the update batch U (batch dicts, see `batches.py`) it computes
- Ȳ-side: the U gradient g = ∇L_U (Dr-GRPO, MATH.md §4), kept per group of prompts for the U jackknife,
  and the update direction v per unit learning rate from the loaded AdamW state;
- X-side: X̂ = ∇L_X by a microbatched backward (MATH.md §3). With baseline none one pass suffices:
  L_X = (L_α − Ĥ·L_β)/D where L_α = Σ[H_ik + α_ik ℓ_ik] and L_β = Σ β_ik ℓ_ik need only each
  sequence's own entropies, so each microbatch's forward feeds two backward passes (∇L_α, ∇L_β) and
  Ĥ, D are applied at the end. The per-sequence pieces a_i = D_v L_α,i, r_i = D_v L_β,i for the error
  bars come out of the same backward passes (`row_directional`). With the loo_position baseline the
  coefficients need every sequence first: E is scored with forward-mode derivatives (jvp), then one
  backward of the full surrogate runs;
- bars_dot = X̂·v (float64) and δH₁ = lr·bars_dot.
All teacher forcing goes through the SequenceProcessor; the model stays in eval() (no dropout).

Distributed (`dist`, see distributed.py): every loop over microbatches runs only this rank's contiguous
share of the microbatches a single process would run; buffers are accumulated in float64 and summed
over ranks with one flat all-reduce, per-sequence values are gathered in global order. With one
process `dist` is SINGLE and every reduction is a no-op.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from .checkpoint.learning_rate import resolve_learning_rate
from .data.batch import batch_to_sequences, subset_batch, zero_advantage_prompts
from .distributed import SINGLE, DistContext
from .errors import ConfigError, NumericsError
from .estimators import objectives
from .estimators import update_direction as adam
from .estimators.surrogate import (
    SurrogateCoefficients,
    directional_pieces,
    entropy_estimate,
    sequence_coefficients,
    surrogate_coefficients,
    surrogate_loss,
    weighted_logq_sum,
)
from .row_directional import RowDirectionalDerivatives, linear_directions

NamedTensors = dict[str, Tensor]


@dataclass
class EScores:
    """Teacher-forced quantities on E, one entry per sequence in (prompt, response) order.

    token_logqs / token_entropies: ℓ_ik and H_ik, float64 [T_i]; d_logq / d_entropy: their directional
    derivatives along v (per unit lr), or None when not requested; unit_of_sequence: the independent
    unit (E prompt) each sequence belongs to, for the jackknife.
    """

    token_logqs: list[Tensor]
    token_entropies: list[Tensor]
    unit_of_sequence: list[int]
    d_logq: list[Tensor] | None = None
    d_entropy: list[Tensor] | None = None

    @property
    def lengths(self) -> Tensor:
        return torch.tensor([len(x) for x in self.token_logqs], dtype=torch.float64)

    @property
    def seq_entropies(self) -> Tensor:
        return torch.stack([h.sum() for h in self.token_entropies])


@dataclass
class UGradients:
    """g = Σ_k g_k of the trainer objective over K groups of U prompts (each g_k already carries the loss's
    whole-batch normaliser, so the g_k add up to g)."""

    total: NamedTensors
    groups: list[NamedTensors]
    group_sizes: list[int]
    loss: float
    zero_advantage_prompts: int
    leave_one_out_scales: list[float] | None = None   # c_k: g₍₋k₎ = c_k·(g − g_k) (objectives.py)


@dataclass
class DeltaH1Result:
    delta_h1: float
    bars_dot: float
    learning_rate: float
    Xbar: NamedTensors
    Ybar: NamedTensors                      # v, the update direction per unit lr
    coefficients: SurrogateCoefficients
    scores: EScores
    u_gradients: UGradients
    update_info: dict
    timings: dict = field(default_factory=dict)
    pieces: tuple[Tensor, Tensor] | None = None   # (a [N], r [N]) when the E pass produced them
    pieces_method: str | None = None               # "backward_hooks" | "jvp" | None (not computed)


def _flatten(nested: list[list]) -> list:
    return [x for row in nested for x in row]


def chunked(items: list, size: int) -> list[list]:
    """Consecutive slices of `items` of length `size` (the last may be shorter)."""
    return [items[i:i + size] for i in range(0, len(items), size)]


def split_into_groups(n_items: int, n_groups: int) -> list[list[int]]:
    """Contiguous near-equal groups of range(n_items) (numpy.array_split semantics)."""
    return [list(map(int, g)) for g in np.array_split(np.arange(n_items), n_groups) if len(g)]


class ProbeComponents:
    """Pure compute on packed E / U batches; see the module docstring."""

    def __init__(self, model, config, logger: logging.Logger | None = None, *, sequence_processor,
                 dist: DistContext | None = None):
        self.model = model
        self.config = config
        self.logger = logger or logging.getLogger("entropy_experiments.probe")
        self.sp = sequence_processor
        self.dist = dist or SINGLE
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters (is the LoRA adapter loaded trainable?)")
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.objective = config.objective_options()

    # ------------------------------------------------------------------ helpers
    def _progress(self, iterable, desc: str, total: int | None = None):
        return tqdm(iterable, desc=desc, total=total, leave=False, disable=None)

    def _prompts_per_microbatch(self, batch: dict) -> int:
        """Whole prompts per backward microbatch: estimator.microbatch_size sequences, at least one prompt."""
        return max(1, self.config.estimator.microbatch_size // batch["num_responses_per_prompt"])

    def _grad(self, loss: Tensor, where: str, retain_graph: bool = False) -> list[Tensor]:
        if not torch.isfinite(loss):
            raise NumericsError(f"non-finite loss ({loss.item()}) in {where}")
        grads = torch.autograd.grad(loss, self.params, allow_unused=True, retain_graph=retain_graph)
        return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, self.params)]

    def _zeros(self, dtype: torch.dtype = torch.float32) -> NamedTensors:
        return {n: torch.zeros_like(p, dtype=dtype) for n, p in zip(self.param_names, self.params)}

    def _prompt_chunks(self, batch: dict) -> list[list[int]]:
        """The backward microbatches (whole prompts) a single process runs, in order."""
        return chunked(list(range(batch["num_prompts"])), self._prompts_per_microbatch(batch))

    # ------------------------------------------------------------------ U side
    def accumulate_sum_Y(self, U_batch: dict, groups: list[list[int]] | None = None) -> UGradients:
        """∇L_U of the trainer's objective (`objective.*`, objectives.py), accumulated per group of prompts
        (default: one group). Prompts that cannot contribute (all-zero advantages, no KL / entropy term)
        are skipped: their contribution to the gradient is exactly zero."""
        self.model.eval()
        options = self.objective
        B_U = U_batch["num_prompts"]
        groups = groups or [list(range(B_U))]
        terms = objectives.batch_terms(torch.tensor(U_batch["rewards"], dtype=torch.float64),
                                       torch.tensor(U_batch["gen_lens"]), options)
        active = [objectives.contributes(row, options) for row in terms]
        per_mb = self._prompts_per_microbatch(U_batch)
        total_loss = 0.0
        # Work items (group k, microbatch of live prompts) in single-process order; this rank runs its share.
        items = [(k, idx) for k, group in enumerate(groups) for idx in chunked([p for p in group if active[p]], per_mb)]
        group_grads = [self._zeros(torch.float64) for _ in groups]
        for k, idx in self._progress(self.dist.chunk_slice(items), "U backward (trainer objective gradient)"):
            loss = self._objective_loss(subset_batch(U_batch, idx), [terms[p] for p in idx])
            for name, g in zip(self.param_names, self._grad(loss, f"U backward, prompts {idx}")):
                group_grads[k][name] += g.double()
            total_loss += float(loss.detach())
        if self.dist.enabled:  # one flat all-reduce of the K group buffers (+ the loss)
            flat = {f"{k}/{n}": t for k, buf in enumerate(group_grads) for n, t in buf.items()}
            flat["loss"] = torch.tensor([total_loss], dtype=torch.float64)
            flat = self.dist.all_reduce_named(flat, "U gradient all-reduce")
            group_grads = [{n: flat[f"{k}/{n}"] for n in buf} for k, buf in enumerate(group_grads)]
            total_loss = float(flat["loss"][0])
        total = self._zeros(torch.float64)
        for buf in group_grads:
            for name in total:
                total[name] += buf[name]
        group_grads = [{n: t.float() for n, t in buf.items()} for buf in group_grads]
        total = {n: t.float() for n, t in total.items()}
        loo = (objectives.leave_one_out_scales(torch.tensor(U_batch["gen_lens"]), groups, options)
               if len(groups) >= 2 else None)
        return UGradients(total=total, groups=group_grads, group_sizes=[len(g) for g in groups],
                          loss=total_loss, zero_advantage_prompts=zero_advantage_prompts(U_batch),
                          leave_one_out_scales=loo)

    def _objective_loss(self, sub: dict, terms: list[list[objectives.SequenceTerms]]) -> Tensor:
        """The objective's share of one microbatch of U prompts (graph through the trainer log-probs)."""
        options = self.objective
        seqs = batch_to_sequences(sub)
        lp = self.sp.teacher_force_logprobs(seqs, with_grad=True, compute_rb=False)
        ref = self._reference_logps(seqs) if options.needs_reference else None
        loss = 0.0
        for j, row in enumerate(terms):
            for g, term in enumerate(row):
                loss = loss + objectives.sequence_loss(
                    lp.token_logps_train[j][g], term, options,
                    ref_logps=None if ref is None else ref[j][g].to(lp.token_logps_train[j][g].device),
                    entropies=lp.token_entropies_train[j][g])
        return loss

    def _reference_logps(self, seqs) -> list[list[Tensor]]:
        """The reference policy's trainer log-probs (the base model: the adapter disabled), no graph."""
        if not hasattr(self.model, "disable_adapter"):
            raise ConfigError("objective.kl_coef > 0 needs a PEFT adapter: the KL reference is the base model "
                              "with the adapter disabled")
        with self.model.disable_adapter():
            lp = self.sp.teacher_force_logprobs(seqs, with_grad=False, compute_rb=False)
        return lp.token_logps_train

    def learning_rate(self, optimizer) -> float:
        """The configured learning_rate, else the optimizer's saved lr (all non-empty param groups must agree;
        0 is a ConfigError): `checkpoint_layout.resolve_learning_rate`."""
        return resolve_learning_rate(self.config.learning_rate, optimizer.param_groups).value

    def update_direction(self, grads: NamedTensors, optimizer) -> tuple[NamedTensors, dict]:
        """v per unit lr from g and the optimizer's saved state (MATH.md §4) + a description of it."""
        est = self.config.estimator
        params = {n: p.detach() for n, p in zip(self.param_names, self.params)}
        hyper = adam.hyper_by_name(optimizer, self.param_names)
        state = adam.adam_state_by_name(optimizer, self.param_names)
        max_norm = self.objective.max_grad_norm
        v = adam.update_direction(est.update_direction, params, grads, state, hyper, max_grad_norm=max_norm)
        grad_norm, coef = adam.clip_coefficient(grads, max_norm)
        first = hyper[self.param_names[0]]
        info = {
            "direction": est.update_direction,
            "norm": adam.named_norm(v),
            "grad_norm": grad_norm,
            "clipped": bool(coef < 1.0),
            "max_grad_norm": max_norm,
            "objective": self.objective.to_dict(),
            "hyperparameters": {"lr": first.lr, "betas": [first.beta1, first.beta2], "eps": first.eps,
                                "weight_decay": first.weight_decay, "amsgrad": first.amsgrad,
                                "step": int(state[self.param_names[0]]["step"])},
        }
        return v, info

    # ------------------------------------------------------------------ E side
    def score_E(self, E_batch: dict, v_named: NamedTensors | None = None) -> EScores:
        """ℓ_ik and H_ik on E (no graph); with `v_named`, also their exact derivatives along v (forward mode)."""
        G = E_batch["num_responses_per_prompt"]
        units = [b for b in range(E_batch["num_prompts"]) for _ in range(G)]
        if self.dist.enabled:  # score this rank's prompts (whole teacher-forcing chunks), gather in order
            tf = int(self.config.generation.tf_batch_size)
            mine = self.dist.prompt_slice(E_batch["num_prompts"], max(1, tf // G))
            local = self._local().score_E(subset_batch(E_batch, mine), v_named) if mine else None
            fields = ("token_logqs", "token_entropies", "d_logq", "d_entropy")
            rows = {} if local is None else {
                b * G + g: tuple(None if getattr(local, f) is None else getattr(local, f)[j * G + g] for f in fields)
                for j, b in enumerate(mine) for g in range(G)}
            gathered = self.dist.gather_rows(rows, len(units), "E scores gather")
            cols = list(zip(*gathered))
            return EScores(token_logqs=list(cols[0]), token_entropies=list(cols[1]), unit_of_sequence=units,
                           d_logq=list(cols[2]) if v_named is not None else None,
                           d_entropy=list(cols[3]) if v_named is not None else None)
        seqs = batch_to_sequences(E_batch)
        if v_named is not None:
            rows = _flatten(self.sp.teacher_force_directional(seqs, v_named))
            return EScores(token_logqs=[r["logq"].double() for r in rows],
                           token_entropies=[r["rb_entropy"].double() for r in rows],
                           d_logq=[r["d_logq"].double() for r in rows],
                           d_entropy=[r["d_rb_entropy"].double() for r in rows], unit_of_sequence=units)
        lp = self.sp.teacher_force_logprobs(seqs, with_grad=False, compute_rb=True)
        return EScores(token_logqs=[torch.as_tensor(t).double() for t in _flatten(lp.token_logqs)],
                       token_entropies=[torch.as_tensor(h).double() for h in _flatten(lp.rb_entropies)],
                       unit_of_sequence=units)

    def coefficients(self, scores: EScores) -> SurrogateCoefficients:
        est = self.config.estimator
        return surrogate_coefficients(scores.token_entropies, normalize=est.normalize, x_mode=est.x_mode,
                                      baseline=est.baseline)

    def accumulate_sum_X(self, E_batch: dict, coefs: SurrogateCoefficients) -> NamedTensors:
        """X̂ = ∇L_X by a microbatched backward of the surrogate (MATH.md §3), fp32 buffers."""
        self.model.eval()
        G = E_batch["num_responses_per_prompt"]
        X = self._zeros(torch.float64)
        for idx in self._progress(self.dist.chunk_slice(self._prompt_chunks(E_batch)), "E backward (entropy surrogate)"):
            sub = subset_batch(E_batch, idx)
            lp = self.sp.teacher_force_logprobs(batch_to_sequences(sub), with_grad=True, compute_rb=True)
            seq_ids = [b * G + g for b in idx for g in range(G)]
            loss = surrogate_loss(_flatten(lp.token_logqs), _flatten(lp.rb_entropies_torch),
                                  [coefs.coefficient(n) for n in seq_ids], coefs.D)
            for name, g in zip(self.param_names, self._grad(loss, f"E backward, prompts {idx}")):
                X[name] += g.double()
        X = self.dist.all_reduce_named(X, "X̂ all-reduce")
        return {n: t.float() for n, t in X.items()}

    def accumulate_X_one_pass(self, E_batch: dict, v_named: NamedTensors | None
                              ) -> tuple[NamedTensors, EScores, SurrogateCoefficients, tuple[Tensor, Tensor] | None]:
        """X̂, the E scores, the coefficients and (with `v_named`) the pieces (a, r) from ONE forward per microbatch.

        Valid for baseline none only (the coefficients α, β of a sequence depend on its own entropies).
        Per microbatch: forward with graph; backward of L_α → buffer X_α and per-row a_i; backward of
        L_β → X_β and r_i (skipped when β ≡ 0: causal + per_sequence). Then X̂ = (X_α − Ĥ X_β)/D.
        """
        est = self.config.estimator
        if est.baseline != "none":
            raise ValueError("accumulate_X_one_pass needs estimator.baseline none")
        self.model.eval()
        G = E_batch["num_responses_per_prompt"]
        N = E_batch["num_prompts"] * G
        directions = linear_directions(self.model, v_named) if v_named is not None else None
        if v_named is not None and directions is None:
            raise ValueError("backward-hook pieces need every trainable parameter to be an nn.Linear weight/bias")
        X_alpha, X_beta = self._zeros(torch.float64), self._zeros(torch.float64)
        local_rows: dict[int, tuple[Tensor, Tensor]] = {}
        a = torch.zeros(N, dtype=torch.float64)
        r = torch.zeros(N, dtype=torch.float64)
        rows = RowDirectionalDerivatives(directions or {})
        # α_ik and Ĥ·β_ik nearly cancel (entropy-to-go vs Ĥ × tokens-to-go), so ∇L_α and Ĥ∇L_β would be
        # two large fp32 gradients whose difference is X̂. Backpropagating α − s·β with s = the first
        # microbatch's Ĥ keeps the buffers small; X̂ = (X_α' − (Ĥ − s)·X_β)/D is the same algebra.
        # Distributed: every rank must use the same shift (that of the first microbatch, which rank 0 runs).
        shift: float | None = None
        shift_shared = False
        with rows:
            for idx in self._progress(self.dist.chunk_slice(self._prompt_chunks(E_batch)),
                                      "E backward (entropy surrogate)"):
                sub = subset_batch(E_batch, idx)
                seq_ids = [b * G + g for b in idx for g in range(G)]
                # One teacher-forcing forward per microbatch, so batch row j is sequence seq_ids[j].
                lp = self.sp.teacher_force_logprobs(batch_to_sequences(sub), with_grad=True, compute_rb=True,
                                                    tf_batch_size=len(seq_ids))
                l_mb, h_mb = _flatten(lp.token_logqs), _flatten(lp.rb_entropies_torch)
                coefs = [sequence_coefficients(h, normalize=est.normalize, x_mode=est.x_mode) for h in h_mb]
                if not shift_shared:
                    shift = self.dist.broadcast_float(self._entropy_of(h_mb) if self.dist.is_main else None,
                                                      "E shift broadcast")
                    shift_shared = True
                loss_alpha = surrogate_loss(l_mb, h_mb, [al - shift * be for al, be in coefs], 1.0)
                has_beta = any(bool(be.any()) for _, be in coefs)
                rows.reset(len(seq_ids))
                for name, g in zip(self.param_names, self._grad(loss_alpha, f"E backward, prompts {idx}",
                                                                retain_graph=has_beta)):
                    X_alpha[name] += g.double()
                a[seq_ids] = rows.values
                if has_beta:
                    loss_beta = weighted_logq_sum(l_mb, [be for _, be in coefs])
                    rows.reset(len(seq_ids))
                    for name, g in zip(self.param_names, self._grad(loss_beta, f"E backward (β), prompts {idx}")):
                        X_beta[name] += g.double()
                    r[seq_ids] = rows.values
                for j, n in enumerate(seq_ids):
                    local_rows[n] = (l_mb[j].detach().double().cpu(), h_mb[j].detach().double().cpu())
        if not shift_shared:  # a rank without microbatches still takes part in the broadcast
            shift = self.dist.broadcast_float(None, "E shift broadcast")
        if self.dist.enabled:  # one flat all-reduce: X_α, X_β and the per-sequence a, r (zero off this rank)
            flat = {**{f"alpha/{n}": t for n, t in X_alpha.items()}, **{f"beta/{n}": t for n, t in X_beta.items()},
                    "a": a, "r": r}
            flat = self.dist.all_reduce_named(flat, "X̂ all-reduce")
            X_alpha = {n: flat[f"alpha/{n}"] for n in X_alpha}
            X_beta = {n: flat[f"beta/{n}"] for n in X_beta}
            a, r = flat["a"], flat["r"]
        gathered = self.dist.gather_rows(local_rows, N, "E scores gather")
        logqs = [row[0] for row in gathered]
        entropies = [row[1] for row in gathered]
        scores = EScores(token_logqs=logqs, token_entropies=entropies,
                         unit_of_sequence=[b for b in range(E_batch["num_prompts"]) for _ in range(G)])
        coefficients = self.coefficients(scores)
        residual = coefficients.H_hat - (shift or 0.0)
        X = {n: ((X_alpha[n].double() - residual * X_beta[n].double()) / coefficients.D).float() for n in X_alpha}
        return X, scores, coefficients, ((a + (shift or 0.0) * r, r) if v_named is not None else None)

    def _local(self) -> ProbeComponents:
        """The same components without distribution (for a rank's own slice)."""
        return ProbeComponents(self.model, self.config, self.logger, sequence_processor=self.sp)

    def _entropy_of(self, token_entropies: list[Tensor]) -> float:
        """Ĥ of a list of per-sequence entropy tensors under estimator.normalize (no graph)."""
        h = torch.stack([t.detach().double().sum() for t in token_entropies])
        lengths = torch.tensor([len(t) for t in token_entropies], dtype=torch.float64)
        return entropy_estimate(h, lengths, self.config.estimator.normalize)

    def pieces_method(self, want_pieces: bool) -> str:
        """How the E side runs: "one_pass" (no pieces), "backward_hooks", or "jvp" (see the module docstring)."""
        var, est = self.config.variance, self.config.estimator
        if est.baseline != "none":
            return "jvp" if want_pieces else "two_pass"
        if not want_pieces:
            return "one_pass"
        if var.directional == "jvp":
            return "jvp"
        hooks_ok = linear_directions(self.model, {n: p for n, p in zip(self.param_names, self.params)}) is not None
        # HF marks checkpointed stacks with `module.gradient_checkpointing = True`; a recomputed forward
        # would register the row hooks twice.
        hooks_ok = hooks_ok and not any(getattr(m, "gradient_checkpointing", False) is True
                                        for m in self.model.modules())
        if var.directional == "backward_hooks" and not hooks_ok:
            raise ConfigError("variance.directional=backward_hooks needs every trainable parameter to be an "
                              "nn.Linear weight or bias and gradient checkpointing off; use auto or jvp")
        return "backward_hooks" if hooks_ok else "jvp"

    # ------------------------------------------------------------------ the pure entry point
    def compute_delta_h1_from_batches(self, E_batch: dict, U_batch: dict, optimizer, *,
                                      u_groups: list[list[int]] | None = None,
                                      per_sequence_pieces: bool = False) -> DeltaH1Result:
        """δH₁ = lr · X̂·v from packed batches and the loaded optimizer.

        U goes first: v is needed by the E pass when `per_sequence_pieces` is on. Returns a
        `DeltaH1Result` (delta_h1, bars_dot, Xbar, Ybar = v, timings, pieces, ...).
        """
        timings = {}
        t0 = time.perf_counter()
        u_grads = self.accumulate_sum_Y(U_batch, u_groups)
        v, info = self.update_direction(u_grads.total, optimizer)
        info["u_loss"] = u_grads.loss
        timings["U_gradient_and_direction"] = time.perf_counter() - t0

        method = self.pieces_method(per_sequence_pieces)
        pieces = None
        if method in ("one_pass", "backward_hooks"):
            t0 = time.perf_counter()
            X, scores, coefs, pieces = self.accumulate_X_one_pass(E_batch, v if method == "backward_hooks" else None)
            timings["E_backward"] = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            scores = self.score_E(E_batch, v if method == "jvp" else None)
            coefs = self.coefficients(scores)
            timings["E_scoring"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            X = self.accumulate_sum_X(E_batch, coefs)
            timings["E_backward"] = time.perf_counter() - t0
            if method == "jvp":
                pieces = directional_pieces(scores.d_logq, scores.d_entropy, coefs)

        lr = self.learning_rate(optimizer)
        bars_dot = adam.named_dot(X, v)
        return DeltaH1Result(delta_h1=lr * bars_dot, bars_dot=bars_dot, learning_rate=lr, Xbar=X, Ybar=v,
                             coefficients=coefs, scores=scores, u_gradients=u_grads, update_info=info,
                             timings=timings, pieces=pieces,
                             pieces_method=method if method in ("backward_hooks", "jvp") else None)

    def pieces(self, result: DeltaH1Result) -> tuple[Tensor, Tensor]:
        """(a [N], r [N]) per-sequence directional pieces; Σ gives X̂·v = (Σa − Ĥ Σr)/D."""
        if result.pieces is None:
            raise ValueError("per-sequence pieces need compute_delta_h1_from_batches(per_sequence_pieces=True)")
        return result.pieces
