"""A PROJECTION (not a measurement) of the probe on one H100 for E responses of T tokens (README "Scaling").

    .venv/bin/python bench/project_gpu.py [--E 512] [--T 256] [--prompt 200] [--util 0.4]

FLOP and byte counts per phase from the architecture (models/synthetic.py, parameter counts exact) and the
probe's passes (default config: 3 η evaluated at ±η, second order and predictors on, U = 8 prompts × 4):
  sampling     prefill 2P per prompt token, decode 2P per response token; decode reads the weights once per
               step per generation batch (memory bound) and the KV cache
  U gradient   forward + activation backward: 4P per token
  E passes     one forward, two activation backwards (X_α, X_β + pieces): 6P per token
  ΔH per η     one no-grad forward: 2P per token
  second order forward-over-forward jvp (primal + two tangents): 6P per token
  predictors   direct_only: one more forward + backward, 4P per token
(P = parameters; + 4·L·S·d per token for eager attention). Time per phase = max(FLOP / (util · peak),
bytes / (util · bandwidth)). Peak: H100 SXM, fp32 without tensor cores (the probe's default: TF32 off)
67 TFLOP/s, bf16 dense tensor 989 TFLOP/s, HBM3 3.35 TB/s, 80 GB. Utilisation is an assumption, said.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H100 = {"fp32_flops": 67e12, "bf16_flops": 989e12, "bandwidth": 3.35e12, "memory": 80e9}
PASSES = {"U gradient": 4, "E passes": 6, "ΔH per η": 2, "second order": 6, "predictors": 4}


def phase_counts(spec, P: int, E: int, T: int, prompt: int, n_eta: int, U_seqs: int, gen_batch: int) -> dict:
    """{phase: (FLOP, bytes)} for one probe run (fp32 weights: 4 bytes a parameter)."""
    S = prompt + T
    attn = 4 * spec.num_hidden_layers * S * spec.hidden_size  # per token: QKᵀ and AV
    kv_per_token = 2 * spec.num_hidden_layers * spec.num_key_value_heads * (spec.hidden_size // spec.num_attention_heads) * 4
    weights = 4 * P
    seqs = E + U_seqs
    steps = -(-seqs // gen_batch) * T
    sampling_flop = seqs * (prompt * (2 * P + attn) + T * (2 * P + attn))
    sampling_bytes = steps * weights + seqs * T * S * kv_per_token  # weights per step + KV cache reads
    out = {"sampling": (sampling_flop, sampling_bytes)}
    microbatch = 4
    for phase, mult in PASSES.items():
        n_seq = U_seqs if phase == "U gradient" else E
        flop = n_seq * S * (mult * P + mult // 2 * attn)
        logits = n_seq * T * spec.vocab_size * 4 * 3  # logits written, read by the chunked maths, gradient
        passes = mult // 2
        byt = passes * -(-n_seq // microbatch) * weights + logits
        if phase == "ΔH per η":
            flop, byt, phase = flop * n_eta, byt * n_eta, f"ΔH ({n_eta} η)"
        out[phase] = (flop, byt)
    return out


def main() -> int:
    from entropy_experiments.models.synthetic import parameter_count, spec_named
    from entropy_experiments.policy.memory_budget import ModelShape, grad_row_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--E", type=int, default=512)
    parser.add_argument("--T", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens per sequence (assumed)")
    parser.add_argument("--util", type=float, default=0.4, help="assumed fraction of peak FLOP/s and bandwidth")
    parser.add_argument("--gen-batch", type=int, default=128, help="sequences per generate() call")
    args = parser.parse_args()
    print(f"PROJECTION, one H100 SXM, fp32 runtime (TF32 off), utilisation {args.util:.0%} of peak assumed; "
          f"E = {args.E} × T = {args.T} response tokens, {args.prompt} prompt tokens, U = 8 × 4, 3 η at ±η, "
          "second order and predictors on")
    for name in ("qwen2.5-1.5b", "qwen2.5-7b"):
        spec = spec_named(name)
        P = parameter_count(spec)
        counts = phase_counts(spec, P, args.E, args.T, args.prompt, n_eta=6, U_seqs=32, gen_batch=args.gen_batch)
        print(f"\n{name}: P = {P / 1e9:.2f} B, fp32 weights {4 * P / 1e9:.1f} GB (bf16 base: {2 * P / 1e9:.1f} GB)")
        total_s = total_flop = 0.0
        for phase, (flop, byt) in counts.items():
            seconds = max(flop / (args.util * H100["fp32_flops"]), byt / (args.util * H100["bandwidth"]))
            total_s, total_flop = total_s + seconds, total_flop + flop
            print(f"  {phase:13s} {flop:9.2e} FLOP  {byt:9.2e} B  → {seconds:7.1f} s")
        row = grad_row_bytes(ModelShape(spec.num_hidden_layers, spec.hidden_size, spec.intermediate_size,
                                        spec.num_attention_heads, spec.vocab_size), args.prompt + args.T, args.T)
        rows = int((H100["memory"] * 0.9 - 4 * P) // row)
        print(f"  total         {total_flop:9.2e} FLOP → {total_s / 60:.1f} min; with-grad memory ≈ {row / 1e9:.2f} GB "
              f"a sequence → microbatch ≤ {rows} in 90 % of 80 GB beside the fp32 weights")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
