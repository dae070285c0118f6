"""Benchmark of the probe's sampler: new tokens/s and seconds for one E batch per rows-per-call, dtype and engine.

    .venv/bin/python bench/bench_sampling.py [--checkpoint DIR] [--device cpu|cuda] [--B-E 32] [--G 1]
                                             [--max-new-tokens 64] [--rows 1 4 8 16 32] [--dtypes fp32 bf16]
                                             [--engines generate static_cache continuous_batching]
                                             [--threads N]

The model is `--checkpoint DIR` (a plain HF model directory, e.g. one `entropy-probe make-checkpoint --synthetic`
wrote, or a published model) or by default the embedded SmolLM2-135M. The same B_E prompts (the default data set's
first ones) are sampled by `PolicyEngine.generate_batched` under every combination, side by side in one run;
"auto" in `--rows` is the probe's gen_batch_size auto. An fp32 sampler with an integer row count draws
chunk-seeded (as the probe always did), the continuous_batching engine cb_chunk_seeded (transformers' continuous
batching, its own draws and log-probs), everything else row-keyed (docs/sampling.md).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entropy_experiments.data.datasets import load_examples
from entropy_experiments.data.prompt_rendering import render_prompts
from entropy_experiments.policy.engine import PolicyEngine
from entropy_experiments.policy.generation_config import parse_settings


def load(checkpoint: str | None, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if checkpoint is None:
        from entropy_experiments.models.embedded import ensure_embedded_model

        checkpoint = str(ensure_embedded_model())
    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    return model.to(device).eval(), tok


def measure(model, tok, prompts, G: int, rows, dtype: str, engine: str, max_new: int) -> dict:
    settings = parse_settings({"generation": {"max_new_tokens": max_new, "gen_batch_size": rows, "stop_strings": [],
                                              "sampler_dtype": dtype, "sampler_engine": engine}})
    policy = PolicyEngine(model, tok, settings)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    policy.generate_batched(prompts, G, seed=1, seed_per_chunk=True)
    seconds = time.perf_counter() - t0
    gen = dict(policy.last_generation)
    gen["seconds"] = seconds
    gen["tokens_per_s"] = gen["new_tokens"] / seconds
    return gen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--B-E", type=int, default=32)
    ap.add_argument("--G", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rows", nargs="+", default=["1", "4", "8", "16", "32"])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--engines", nargs="+", default=["generate"])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load(args.checkpoint, args.device)
    examples = load_examples("gsm_symbolic_r1_template", "train", pool_size=max(args.B_E, 8))[:args.B_E]
    prompts = [list(r.token_ids) for r in render_prompts(tok, examples, None)]
    print(f"device {args.device}, threads {torch.get_num_threads()}, E = {args.B_E} prompts x G {args.G}, "
          f"max_new_tokens {args.max_new_tokens}")
    print(f"{'rows':>5} {'dtype':>5} {'engine':>19} {'draws':>15} {'rows used':>9} {'tokens':>7} {'s':>7} {'tok/s':>7}")
    for rows, dtype, engine in itertools.product(args.rows, args.dtypes, args.engines):
        gen = measure(model, tok, prompts, args.G, rows if rows == "auto" else int(rows), dtype, engine,
                      args.max_new_tokens)
        print(f"{rows:>5} {dtype:>5} {engine:>19} {gen['draws']:>15} {gen['rows_per_call']:>9} "
              f"{gen['new_tokens']:>7} {gen['seconds']:>7.1f} {gen['tokens_per_s']:>7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
