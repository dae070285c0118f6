"""Benchmarks of the policy engine: memory of the chunked token maths, teacher-forcing
throughput and generation throughput, each printed as a ratio measured side by side with PASS/FAIL.

    .venv/bin/python bench/bench_sequence_processor.py [--threads N] [--skip-memory | --memory-only]

1. Memory: per-token log q, RB entropy and log p for 1024 tokens at vocab 151,936 (Qwen's size),
   chunked (`policy_token_stats`: at most the config's chunk rows and `CHUNK_ELEMENTS` entries per
   chunk) vs the plain full-tensor float64 computation (`_plain_full`, the reference), at
   (τ, top_p) = (1, 1) and (0.7, 0.9). Each side runs in a fresh subprocess; peak extra memory = the
   kernel's peak RSS (VmHWM, reset just before the maths) − the RSS at that moment (the logits are
   already allocated). Targets: memory ratio ≤ 1/32, max |Δ| vs the reference ≤ 1e-12, and no slower
   (time ratio chunked / full ≤ 1).
2. Teacher forcing (no grad) with RB entropies, log q and diagnostics vs a bare forward of the same
   model on the same batch (embedded SmolLM2, CPU). Target: ≥ 0.75× the bare forward's tokens/s.
3. Generation: `generate_batched` vs a raw `model.generate` (HF sampling with the same settings and
   the same stop string) at the same batch size (target ≥ 0.9×), and vs the one-prompt-at-a-time
   reference loop (target ≥ 3×).
Timings alternate the two sides of each comparison and take the median of the repeats, which
keeps the ratios honest on a machine shared with other jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

VOCAB, TOKENS = 151_936, 1024


# ------------------------------------------------------------------------------------ 1. memory
def _status_mb(field: str) -> float:
    """VmRSS / VmHWM (peak resident set) of this process from /proc, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS (Linux ≥ 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def _plain_full(logits: torch.Tensor, tokens: torch.Tensor, tau: float, top_p: float):
    """What one would write without chunking: whole-tensor float64 log-softmaxes."""
    from entropy_experiments.policy.sampling_policy import sampling_logits

    idx = tokens.unsqueeze(-1)
    # the same nucleus rule (membership decided on the fp32 logits), values in float64
    kept = torch.isfinite(sampling_logits(logits, tau, top_p))
    a = (logits.double() / tau).masked_fill(~kept, float("-inf"))
    del kept
    logq_all = torch.log_softmax(a, dim=-1)
    q = logq_all.exp()
    entropy = -(q * torch.where(q > 0, logq_all, torch.zeros_like(logq_all))).sum(-1)
    logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, idx).squeeze(-1)
    return logq_all.gather(-1, idx).squeeze(-1), entropy, logp


def memory_worker(mode: str, chunk: int, tau: float, top_p: float, out: str) -> None:
    """Subprocess body: allocate the logits, take the baseline, run one method, report."""
    from entropy_experiments.policy.sampling_policy import token_logq_and_entropy

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, VOCAB, generator=g).mul_(4.0)
    tokens = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    tokens[::2] = logits[::2].argmax(-1)  # half the tokens are likely ones (finite log q under top_p)
    _reset_peak()
    base = _status_mb("VmRSS")
    t0 = time.perf_counter()
    with torch.no_grad():
        if mode == "full":
            logq, ent, logp = _plain_full(logits, tokens, tau, top_p)
        else:
            logq, ent, logp = token_logq_and_entropy(logits, tokens, tau, top_p, fp64=True, chunk_size=chunk)
    seconds = time.perf_counter() - t0
    torch.save({"logq": logq, "ent": ent, "logp": logp}, out)
    print(json.dumps({"extra_mb": _status_mb("VmHWM") - base, "seconds": seconds}))


def bench_memory(chunk: int) -> list[bool]:
    """Part 1: one PASS/FAIL per policy (memory ratio, max |Δ| and time ratio against their targets)."""
    from entropy_experiments.policy.sampling_policy import CHUNK_ELEMENTS

    rows = max(1, min(chunk, CHUNK_ELEMENTS // VOCAB))
    results = []
    for tau, top_p in ((1.0, 1.0), (0.7, 0.9)):
        runs = {}
        with tempfile.TemporaryDirectory() as tmp:
            for mode in ("full", "chunked"):
                path = os.path.join(tmp, f"{mode}.pt")
                proc = subprocess.run([sys.executable, __file__, "--memory-worker", mode, str(chunk), str(tau),
                                       str(top_p), path], capture_output=True, text=True, check=True)
                runs[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
                runs[mode]["values"] = torch.load(path, weights_only=True)
        full, chunked = runs["full"], runs["chunked"]
        diff = 0.0
        for key in ("logq", "ent", "logp"):
            a, b = full["values"][key], chunked["values"][key]
            finite = torch.isfinite(a)
            assert torch.equal(finite, torch.isfinite(b)), "the two methods disagree on -inf log q"
            diff = max(diff, float((a[finite] - b[finite]).abs().max()))
        ratio, time_ratio = chunked["extra_mb"] / full["extra_mb"], chunked["seconds"] / full["seconds"]
        ok = ratio <= 1 / 32 and diff <= 1e-12 and time_ratio <= 1.0
        results.append(ok)
        print(f"[memory] τ={tau} top_p={top_p}: {TOKENS} tokens × vocab {VOCAB}, chunks of {rows} rows "
              f"(≤ {chunk} rows, ≤ {CHUNK_ELEMENTS} entries): peak extra {chunked['extra_mb']:.0f} MB "
              f"(chunked) vs {full['extra_mb']:.0f} MB (full) → ratio {ratio:.4f} (target ≤ 1/32 = "
              f"{1 / 32:.4f}), max |Δ| {diff:.1e} (target ≤ 1e-12), time {chunked['seconds']:.2f}s vs "
              f"{full['seconds']:.2f}s → ratio {time_ratio:.3f} (target ≤ 1)  {'PASS' if ok else 'FAIL'}")
    return results


# ------------------------------------------------------------------------------------ timing helpers
def _time(fn, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def _interleaved(fns: dict, rounds: int, repeats: int = 1) -> dict[str, float]:
    """Median seconds per call of each fn, alternating them round by round (after one warm-up each)."""
    for fn in fns.values():
        fn()
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(_time(fn, repeats))
    return {k: statistics.median(v) for k, v in samples.items()}


def load_smollm2():
    from transformers import AutoModelForCausalLM

    from entropy_experiments.checkpoint.base_model import load_tokenizer, resolve_base_model

    path = resolve_base_model("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return model, load_tokenizer("smollm2-135m-instruct")


def bench_prompts(n: int) -> list[str]:
    from entropy_experiments.data.datasets import load_examples

    return [ex.question for ex in load_examples("gsm_symbolic_r1_template", "train", pool_size=max(n, 8))[:n]]


# ------------------------------------------------------------------------------------ 2. teacher forcing
def bench_teacher_forcing(model, tok, rounds: int) -> bool:
    from entropy_experiments.policy.engine import PolicyEngine
    from entropy_experiments.policy.generation_config import parse_settings

    B, T = 8, 64
    sp = PolicyEngine(model, tok, parse_settings({"generation": {"max_new_tokens": T, "tf_batch_size": B},
                                                  "precision": {"entropy_fp64": True}}))
    prompts = bench_prompts(B)
    g = torch.Generator().manual_seed(0)
    responses = [[torch.randint(0, len(tok), (T - 8 * (b % 3),), generator=g).tolist()] for b in range(B)]
    seqs = sp.pack(sp.tokenize_prompts(prompts), responses, prompts)
    ids = seqs.sequences[:, 0]
    mask = seqs.attention_masks[:, 0]
    n_tokens = sum(sum(r) for r in seqs.gen_lens)

    def bare():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)

    def bare_response_logits():  # the stricter baseline: logits only where tokens are scored, as we do
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=T + 1)

    def ours():
        sp.teacher_force_logprobs_with_diagnostics(seqs, compute_rb=True)

    t = _interleaved({"bare": bare, "bare_kept": bare_response_logits, "ours": ours}, rounds)
    ratio, strict = t["bare"] / t["ours"], t["bare_kept"] / t["ours"]
    ok = ratio >= 0.75
    print(f"[teacher forcing] SmolLM2, {B} sequences ({ids.shape[1]} positions, {n_tokens} scored tokens): "
          f"bare forward {n_tokens / t['bare']:.0f} tok/s, no-grad TF + RB + log q + diagnostics (fp64) "
          f"{n_tokens / t['ours']:.0f} tok/s → ratio {ratio:.2f} (target ≥ 0.75)  {'PASS' if ok else 'FAIL'}; "
          f"vs a bare forward with logits only at the last {T + 1} positions "
          f"({n_tokens / t['bare_kept']:.0f} tok/s): {strict:.2f}")
    return ok


# ------------------------------------------------------------------------------------ 3. generation
def bench_generation(model, tok, rounds: int) -> list[bool]:
    from entropy_experiments.policy.engine import PolicyEngine
    from entropy_experiments.policy.generation_config import GenerationConfig, parse_settings
    from entropy_experiments.policy.reference_sampler import sample_one_at_a_time

    n_prompts, G, T = 4, 4, 48
    prompts = bench_prompts(n_prompts)
    cfg = GenerationConfig(max_new_tokens=T, gen_batch_size=n_prompts * G)
    sp = PolicyEngine(model, tok, parse_settings(cfg))
    enc = tok(prompts, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"].repeat_interleave(G, 0), enc["attention_mask"].repeat_interleave(G, 0)
    counts = {}

    def raw():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=T, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             stop_strings=["</answer>"], tokenizer=tok)
        counts["raw"] = sum(sp.response_length(row) for row in out[:, ids.shape[1]:].tolist())

    def batched():
        counts["batched"] = sum(map(sum, sp.generate_batched(prompts, G).gen_lens))

    def one_at_a_time():
        counts["loop"] = sum(map(sum, sample_one_at_a_time(model, tok, prompts, G, cfg).gen_lens))

    with torch.random.fork_rng():
        torch.manual_seed(0)
        t = _interleaved({"raw": raw, "batched": batched}, max(1, rounds - 1))
        t_loop = _time(one_at_a_time, 1)
    rate = {"raw": counts["raw"] / t["raw"], "batched": counts["batched"] / t["batched"], "loop": counts["loop"] / t_loop}
    r_raw, r_loop = rate["batched"] / rate["raw"], rate["batched"] / rate["loop"]
    ok_raw, ok_loop = r_raw >= 0.9, r_loop >= 3.0
    print(f"[generation] SmolLM2, batch {n_prompts}×{G}, max_new_tokens {T}: generate_batched {rate['batched']:.1f} tok/s, "
          f"raw model.generate {rate['raw']:.1f} tok/s → ratio {r_raw:.2f} (target ≥ 0.9)  {'PASS' if ok_raw else 'FAIL'}")
    print(f"[generation] generate_batched vs one-prompt-at-a-time loop ({rate['loop']:.1f} tok/s) → ratio {r_loop:.1f} "
          f"(target ≥ 3)  {'PASS' if ok_loop else 'FAIL'}")
    return [ok_raw, ok_loop]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-worker":
        mode, chunk, tau, top_p, out = sys.argv[2:7]
        memory_worker(mode, int(chunk), float(tau), float(top_p), out)
        return 0
    from entropy_experiments.policy.generation_config import GenerationConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--chunk", type=int, default=GenerationConfig().token_chunk_size)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-memory", action="store_true", help="skip part 1 (memory of the token maths)")
    parser.add_argument("--memory-only", action="store_true", help="run only part 1 (no model needed)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    ok = [] if args.skip_memory else bench_memory(args.chunk)
    if not args.memory_only:
        model, tok = load_smollm2()
        ok.append(bench_teacher_forcing(model, tok, args.rounds))
        ok += bench_generation(model, tok, args.rounds)
    print(f"{sum(ok)}/{len(ok)} targets met in {time.perf_counter() - t0:.0f}s")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    raise SystemExit(main())
