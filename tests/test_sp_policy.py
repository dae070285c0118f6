"""The sampling policy's maths against brute-force references (no model needed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from entropy_experiments.errors import ConfigError, NumericsError
from entropy_experiments.policy.distribution_diagnostics import DistributionDiagnostics
from entropy_experiments.policy.sampling_policy import (
    SamplingPolicyLogitsProcessor,
    TokenStatsRequest,
    nucleus_keep_mask,
    policy_token_stats,
    sampling_logits,
    token_logq_and_entropy,
)

POLICIES = [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.7, 0.9)]


def brute_force(z: np.ndarray, tok: int, tau: float, top_p: float) -> dict[str, float]:
    """One row, plain numpy float64, written from docs/maths.md §1 with explicit loops."""
    a = z.astype(np.float64) / tau
    p = np.exp(a - a.max())
    p /= p.sum()
    order = sorted(range(len(a)), key=lambda i: -p[i])
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:  # the crossing token was the previous one
            break
        kept.append(i)
        mass += p[i]
    q = np.zeros_like(p)
    q[kept] = p[kept] / p[kept].sum()
    raw = np.exp(z - z.max())
    raw /= raw.sum()
    entropy = -sum(q[i] * math.log(q[i]) for i in kept if q[i] > 0)
    return {"logq": math.log(q[tok]) if q[tok] > 0 else -math.inf, "rb_entropy": entropy,
            "logp": math.log(raw[tok]), "kept": sorted(kept), "q": q}


def random_logits(n=7, V=50, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * scale


@pytest.mark.parametrize("tau,top_p", POLICIES)
def test_token_stats_match_brute_force(tau, top_p):
    z = random_logits()
    # Score the top token of half the rows and a random in-nucleus token elsewhere (finite log q).
    tokens = torch.tensor([int(torch.argmax(z[i])) if i % 2 else int(torch.argsort(z[i])[-3]) for i in range(len(z))])
    logq, ent, logp = token_logq_and_entropy(z, tokens, tau, top_p, fp64=True, chunk_size=3)
    for i in range(len(z)):
        ref = brute_force(z[i].double().numpy(), int(tokens[i]), tau, top_p)
        assert logq[i].item() == pytest.approx(ref["logq"], abs=1e-10)
        assert ent[i].item() == pytest.approx(ref["rb_entropy"], abs=1e-10)
        assert logp[i].item() == pytest.approx(ref["logp"], abs=1e-10)
    assert logq.dtype == ent.dtype == logp.dtype == torch.float64


def test_nucleus_rule_keeps_crossing_token_and_at_least_one():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    z = probs.log()
    kept = lambda p: torch.isfinite(sampling_logits(z, 1.0, p))[0].nonzero().flatten().tolist()
    assert kept(0.45) == [0]          # the first token crosses 0.45
    assert kept(0.6) == [0, 1]        # 0.5 < 0.6 → the crossing token (0.3) is included
    assert kept(0.85) == [0, 1, 2]
    assert kept(1e-6) == [0]          # never empty
    assert kept(1.0) == [0, 1, 2, 3]
    for p in (0.3, 0.6, 0.9, 0.97):
        assert kept(p) == brute_force(z[0].numpy(), 0, 1.0, p)["kept"]


def full_sort_mask(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """The rule by a stable descending sort of the whole vocabulary (ties in index order)."""
    probs = torch.softmax(z.float(), dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cum = sorted_probs.cumsum(-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    return torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before < top_p)


@pytest.mark.parametrize("topk", [2, 5, 1000])
def test_topk_boundary_search_equals_a_full_sort(topk):
    """Top-k search, full-sort fallback for large nuclei and index-order ties all give the sorted rule."""
    g = torch.Generator().manual_seed(0)
    smooth = torch.randn(30, 60, generator=g) * 1.5
    tied = torch.randint(0, 3, (30, 60), generator=g).float()     # many exactly equal probabilities
    for z in (smooth, tied):
        for top_p in (0.05, 0.3, 0.7, 0.95, 0.999):
            assert torch.equal(nucleus_keep_mask(z, top_p, topk=topk), full_sort_mask(z, top_p)), (topk, top_p)


def test_top_p_one_is_the_fast_path():
    z = random_logits()
    assert sampling_logits(z, 1.0, 1.0) is z                    # no copy, no sort, no mask
    assert torch.equal(sampling_logits(z, 0.5, 1.0), z / 0.5)


def test_masked_tokens_get_minus_inf_logq():
    z = random_logits(n=1, V=20)
    worst = int(torch.argmin(z[0]))
    logq, ent, _ = token_logq_and_entropy(z, torch.tensor([worst]), 1.0, 0.5)
    assert logq.item() == -math.inf and math.isfinite(ent.item())


@pytest.mark.parametrize("fp64", [True, False])
def test_chunking_and_rows_do_not_change_values(fp64):
    z = random_logits(n=11, V=40, seed=3)
    tokens = torch.randint(0, 40, (11,), generator=torch.Generator().manual_seed(1))
    ref = policy_token_stats(z, tokens, TokenStatsRequest(0.7, 0.9, fp64=fp64, chunk_size=1000, diagnostics=True,
                                                          eos_token_id=5))
    for chunk in (1, 4):
        got = policy_token_stats(z, tokens, TokenStatsRequest(0.7, 0.9, fp64=fp64, chunk_size=chunk, diagnostics=True,
                                                              eos_token_id=5))
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-12 if fp64 else 1e-5, equal_nan=True)
    # rows= gathers from a larger [M, V] tensor without the caller copying it.
    big = torch.cat([random_logits(n=5, V=40, seed=9), z])
    rows = torch.arange(5, 16)
    got = policy_token_stats(big, tokens, TokenStatsRequest(0.7, 0.9, fp64=fp64, chunk_size=4), rows=rows)
    for k in got:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-12 if fp64 else 1e-5)
    assert ref["logq"].dtype == (torch.float64 if fp64 else torch.float32)


@pytest.mark.parametrize("tau,top_p", POLICIES)
def test_gradients_match_gradcheck_and_have_no_nans(tau, top_p):
    z = random_logits(n=4, V=12, seed=5).double().requires_grad_(True)
    tokens = torch.argmax(z.detach(), dim=-1)

    def f(x):
        logq, ent, logp = token_logq_and_entropy(x, tokens, tau, top_p, chunk_size=3)
        return logq, ent, logp

    assert torch.autograd.gradcheck(f, (z,), eps=1e-6, atol=1e-6)
    # checkpointed chunks give the same gradient
    w = torch.randn(4, dtype=torch.float64)
    g1, = torch.autograd.grad((f(z)[1] * w).sum(), z)
    _, ent, _ = token_logq_and_entropy(z, tokens, tau, top_p, chunk_size=3, checkpoint=True)
    g2, = torch.autograd.grad((ent * w).sum(), z)
    assert torch.isfinite(g1).all()
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)


def test_forward_mode_matches_reverse_mode():
    z = random_logits(n=5, V=30, seed=7).double()
    dz = torch.randn_like(z)
    tokens = torch.argmax(z, dim=-1)
    for tau, top_p in POLICIES:
        def f(x, tau=tau, top_p=top_p):
            return token_logq_and_entropy(x, tokens, tau, top_p, chunk_size=2)[:2]

        with torch.no_grad():  # the SP runs forward mode without autograd (in-place work buffers)
            _, (d_logq, d_ent) = torch.func.jvp(f, (z,), (dz,))
        zr = z.clone().requires_grad_(True)
        logq, ent = f(zr)
        for out, tangent in ((logq, d_logq), (ent, d_ent)):
            rows = [torch.autograd.grad(out[i], zr, retain_graph=True)[0] for i in range(len(out))]
            expected = torch.stack([(r * dz).sum() for r in rows])
            torch.testing.assert_close(tangent, expected, rtol=1e-10, atol=1e-10)


def test_diagnostics_match_brute_force():
    z = random_logits(n=3, V=25, seed=11)
    tokens = torch.argmax(z, dim=-1)
    eos = 4
    pack = DistributionDiagnostics(top_p=0.8, temperature=0.7, eos_token_id=eos).compute_from_logits(z, tokens)
    for i in range(3):
        ref = brute_force(z[i].double().numpy(), int(tokens[i]), 0.7, 0.8)
        q = ref["q"]
        qs = np.sort(q)[::-1]
        a = z[i].double().numpy() / 0.7
        tempered = np.exp(a - a.max()) / np.exp(a - a.max()).sum()
        kept = q > 0
        mean_a = float((q[kept] * a[kept]).sum())
        assert pack.step.rb_entropy[i] == pytest.approx(ref["rb_entropy"], abs=1e-10)
        assert pack.step.top1_prob[i] == pytest.approx(qs[0], abs=1e-12)
        assert pack.step.margin[i] == pytest.approx(qs[0] - qs[1], abs=1e-12)
        assert pack.step.collision[i] == pytest.approx((q ** 2).sum(), abs=1e-12)
        assert pack.step.renyi2[i] == pytest.approx(-math.log((q ** 2).sum()), abs=1e-10)
        assert pack.step.eff_support[i] == pytest.approx(math.exp(ref["rb_entropy"]), rel=1e-10)
        assert pack.step.head_mass[i] == pytest.approx(tempered[kept].sum(), abs=1e-12)
        assert pack.step.tail_mass[i] == pytest.approx(1 - tempered[kept].sum(), abs=1e-12)
        assert pack.step.logit_var[i] == pytest.approx(float((q[kept] * (a[kept] - mean_a) ** 2).sum()), abs=1e-9)
        assert pack.step.eos_prob[i] == pytest.approx(q[eos], abs=1e-12)
        assert pack.step.surprisal[i] == pytest.approx(-ref["logq"], abs=1e-10)
    assert pack.seq.T == 3
    assert pack.seq.rb_entropy_sum == pytest.approx(pack.step.rb_entropy.sum())
    assert pack.seq.surprisal_sum == pytest.approx(pack.step.surprisal.sum())


def test_logits_processor_is_the_same_rule():
    z = random_logits()
    proc = SamplingPolicyLogitsProcessor(0.7, 0.9)
    assert torch.equal(proc(torch.zeros(7, 1, dtype=torch.long), z), sampling_logits(z, 0.7, 0.9))


def test_policy_validation_and_nonfinite_errors():
    with pytest.raises(ConfigError, match="top_p"):
        SamplingPolicyLogitsProcessor(1.0, 1.5)
    with pytest.raises(ConfigError, match="temperature"):
        SamplingPolicyLogitsProcessor(0.0, 1.0)
    z = random_logits()
    z[4, 3] = float("nan")
    with pytest.raises(NumericsError, match="row 4"):
        token_logq_and_entropy(z, torch.zeros(7, dtype=torch.long), 1.0, 1.0, chunk_size=2)


def full_tensor_reference(z: torch.Tensor, tokens: torch.Tensor, tau: float, top_p: float) -> dict:
    """Whole-[N, V] float64 maths, no chunks; the nucleus by a full stable sort of the fp32 z/τ."""
    kept = full_sort_mask(z / tau, top_p)
    a = z.double() / tau
    logq_all = torch.log_softmax(a.masked_fill(~kept, -math.inf), dim=-1)
    logp_train_all = torch.log_softmax(a, dim=-1)
    idx = tokens.unsqueeze(-1)
    return {
        "logq": logq_all.gather(-1, idx).squeeze(-1),
        "rb_entropy": -(logq_all.exp() * logq_all.masked_fill(~kept, 0.0)).sum(-1),
        "logp": torch.log_softmax(z.double(), dim=-1).gather(-1, idx).squeeze(-1),
        "logp_train": logp_train_all.gather(-1, idx).squeeze(-1),
        "entropy_train": -(logp_train_all.exp() * logp_train_all).sum(-1),
    }


@pytest.mark.parametrize("scale", [1.0, 4.0])  # large nuclei (past the first top-k) and small ones
@pytest.mark.parametrize("chunk", [1, 5, 7, 37, 256])  # 5 and 7 do not divide the 37 tokens
def test_chunks_equal_a_full_tensor_reference(chunk, scale):
    z = random_logits(n=37, V=1000, seed=13, scale=scale)
    tokens = torch.randint(0, 1000, (37,), generator=torch.Generator().manual_seed(2))
    tokens[::2] = z[::2].argmax(-1)  # half inside the nucleus, the rest mostly outside (log q = −inf)
    tau, top_p = 0.7, 0.9
    ref = full_tensor_reference(z, tokens, tau, top_p)
    assert torch.isinf(ref["logq"]).any() and torch.isfinite(ref["logq"]).any()
    rows = torch.arange(40).flip(0)[3:]  # the same 37 rows, gathered from a larger tensor
    big = torch.cat([z.flip(0), random_logits(n=3, V=1000, seed=14)])
    runs = {  # name: (logits, keyword arguments)
        "no grad (shared buffers)": (z, {"chunk_size": chunk}),
        "rows=": (big, {"chunk_size": chunk, "rows": rows}),
        "entry budget": (z, {"chunk_size": 256, "chunk_elements": chunk * 1000}),
        "autograd": (z.clone().requires_grad_(True), {"chunk_size": chunk}),
    }
    for name, (logits, kwargs) in runs.items():
        with torch.set_grad_enabled(name == "autograd"):
            options = {k: v for k, v in kwargs.items() if k != "rows"}
            got = policy_token_stats(logits, tokens, TokenStatsRequest(tau, top_p, **options), rows=kwargs.get("rows"))
        for key, want in ref.items():
            assert got[key].dtype == torch.float64
            torch.testing.assert_close(got[key].detach(), want, rtol=0, atol=1e-12, msg=f"{name}: {key}")


def test_chunks_share_buffers_instead_of_allocating():
    """Without autograd, the chunks allocate nothing vocabulary-sized beyond the shared buffers' slots."""
    from torch.profiler import ProfilerActivity, profile

    N, V, chunk = 64, 20000, 8
    z = random_logits(n=N, V=V, seed=3, scale=4.0)
    tokens = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(4))
    for kwargs in ({}, {"rows": torch.arange(N).flip(0)}, {"diagnostics": True, "eos_token_id": 3}):
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            options = {k: v for k, v in kwargs.items() if k != "rows"}
            policy_token_stats(z, tokens, TokenStatsRequest(0.7, 0.9, chunk_size=chunk, **options), rows=kwargs.get("rows"))
        big = [ev.cpu_memory_usage for ev in prof.events()
               if not ev.cpu_children and ev.cpu_memory_usage >= chunk * V]
        assert len(big) <= 4, (kwargs, big)  # slots "a", "e", "mask" (+ "z" with rows=), not 8 chunks' worth
