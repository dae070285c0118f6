"""How often loading a checkpoint re-enters the project's modules (the rooms a reader of the code revisits).

    .venv/bin/python bench/load_reentries.py [--layout own|verl|both] [--sequence] [--json OUT]

Traces `checkpoint.load.load_for_probe` (locate → layout → base model → adapter → tokenizer → optimizer state → lr)
while it loads a tiny checkpoint as the tests do: `own` is this project's layout written by `save_checkpoint`
around the tests' tiny random Qwen2 with a LoRA and one AdamW step; `verl` is the verl FSDP2 fixture of
tests/fixtures/framework_checkpoints (its tiny base built as tests/test_framework_checkpoints.py builds it). A warm-up
load runs first, untraced, so that imports and first-use caches do not count. Counted (tests/module_stays.py):
stays (maximal stretches in one module), entries by a call into load.py, tokenizer_source.py and framework.py,
and returns (stays that come back to a module the code left).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WATCHED = ("checkpoint.load", "checkpoint.tokenizer_source", "checkpoint.framework")
VERL = REPO / "tests" / "fixtures" / "framework_checkpoints" / "verl" / "global_step_1"


def own_checkpoint(work: Path) -> Path:
    """A tiny random Qwen2 + LoRA with one AdamW step, saved in this project's layout."""
    import torch

    from entropy_experiments.checkpoint.adapter import create_lora_model
    from entropy_experiments.checkpoint.writer import save_checkpoint
    from entropy_experiments.testing.tiny_model import build_tiny_model_dir

    base = build_tiny_model_dir(work / "base")
    model = create_lora_model(str(base), r=4, alpha=8, device_map="cpu")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    sum((p.float() ** 2).sum() for p in params).backward()
    optimizer.step()
    return save_checkpoint(model, optimizer, work / "ckpt")


def verl_base(work: Path) -> Path:
    """The tiny base the verl fixture was trained on."""
    from entropy_experiments.testing.tiny_model import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(vocab_size=272)
    build_tiny_model(len(tokenizer), tokenizer.eos_token_id, hidden_size=16, num_layers=1).save_pretrained(work)
    tokenizer.save_pretrained(work)
    return work


def checkpoint_section(layout: str, work: Path):
    from entropy_experiments.config import config_from_dict

    if layout == "own":
        checkpoint = {"checkpoint_path": str(own_checkpoint(work / "own"))}
    else:
        checkpoint = {"checkpoint_path": str(VERL), "base_model": str(verl_base(work / "verl_base"))}
    return config_from_dict({"checkpoint": {**checkpoint, "device_map": "cpu"}}).checkpoint


def measure(layout: str, work: Path) -> dict:
    """The stays of one `load_for_probe` of a tiny checkpoint of `layout`, after an untraced warm-up load."""
    from entropy_experiments.checkpoint.load import load_for_probe
    from tests.module_stays import StayTracer

    ck = checkpoint_section(layout, work)
    load_for_probe(ck, None)
    with StayTracer() as tracer:
        load_for_probe(ck, None)
    stays = tracer.result
    return {"layout": layout, "stays": len(stays.stays), "returns": stays.returns(), "modules": len(stays.visits()),
            "entries": {m: stays.entries(m) for m in WATCHED}, "sequence": stays.stays}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", choices=("own", "verl", "both"), default="both")
    parser.add_argument("--sequence", action="store_true", help="print the stays in order")
    parser.add_argument("--json", type=Path, default=None, help="write the counts and the stays here")
    args = parser.parse_args(argv)
    logging.disable(logging.CRITICAL)
    results = []
    with tempfile.TemporaryDirectory(prefix="load-reentries-") as tmp:
        for layout in (("own", "verl") if args.layout == "both" else (args.layout,)):
            results.append(measure(layout, Path(tmp)))
    for r in results:
        entries = ", ".join(f"{m.split('.')[-1]}.py {n}" for m, n in r["entries"].items())
        print(f"{r['layout']:>4}: {r['returns']} returns in {r['stays']} stays ({r['modules']} modules); "
              f"entered by a call: {entries}")
        if args.sequence:
            print("      " + " → ".join(f"{m}({how[0]})" for m, how in r["sequence"]))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
