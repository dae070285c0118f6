"""How many calls lie between `probe/recipe.run` and the computation of a reported number (the hops a reader follows).

    .venv/bin/python bench/se_path.py [--target NAME ...] [--json OUT]

Runs one probe on the tests' tiny random Qwen2 with a random LoRA and a trained AdamW (tests/probe_helpers.py's
`make_probe`, B_E 8, B_U 4, G 2, two U groups) and follows it with a profiler hook (sys.setprofile). Each time a
function named by --target is called, the chain of the project's frames from `recipe.run` down to it is recorded
(frames outside entropy_experiments/, torch's and numpy's, and comprehensions are not hops). The default target is SE_E of δH₁: the
statistic `_delta_h1_per_token_stat` evaluated on a delete-one replicate (a call under `jackknife_replicates`).
Printed per target: the hops (calls after `recipe.run`), the files they cross, and the chain.
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

PACKAGE = REPO / "entropy_experiments"
START = ("probe/recipe.py", "run")
SE_E_OF_DELTA_H1 = "_delta_h1_per_token_stat@jackknife_replicates"


def project_frame(frame) -> tuple[str, str] | None:
    """(file relative to the package, function) of a frame of the project's code; None for any other frame."""
    path = Path(frame.f_code.co_filename)
    if not path.is_relative_to(PACKAGE):
        return None
    return path.relative_to(PACKAGE).as_posix(), frame.f_code.co_name


def chain_of(frame) -> list[tuple[str, str]] | None:
    """The project's frames from recipe.run (excluded) down to `frame` (included), outermost first; None when
    recipe.run is not on the stack."""
    chain = []
    while frame is not None:
        where = project_frame(frame)
        if where == START:
            return chain[::-1]
        if where is not None and not where[1].startswith("<"):  # a comprehension is no call a reader follows
            chain.append(where)
        frame = frame.f_back
    return None


class PathTracer:
    """Records the first chain from recipe.run to each target ("function" or "function@caller_on_the_chain")."""

    def __init__(self, targets: list[str]) -> None:
        self.targets = {t: tuple(t.split("@", 1)) for t in targets}
        self.chains: dict[str, list[tuple[str, str]]] = {}

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        for target, (name, *under) in self.targets.items():
            if target in self.chains or frame.f_code.co_name != name:
                continue
            chain = chain_of(frame)
            if chain is not None and all(any(fn == u for _, fn in chain) for u in under):
                self.chains[target] = chain


def tiny_probe(work: Path):
    """The tests' tiny probe set-up (two U groups so that SE_U exists beside SE_E)."""
    from entropy_experiments.testing.tiny_model import build_tiny_model_dir
    from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts

    model_dir = build_tiny_model_dir(work / "tiny")
    data = write_prompts(work / "prompts.jsonl", SHORT_PROMPTS)
    return make_probe(model_dir, data, {"variance": {"enabled": True, "u_groups": 2}})


def measure(targets: list[str]) -> dict[str, list[tuple[str, str]]]:
    import torch

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="se-path-") as tmp:
        probe = tiny_probe(Path(tmp))
        tracer = PathTracer(targets)
        sys.setprofile(tracer)
        try:
            probe.run()
        finally:
            sys.setprofile(None)
    return tracer.chains


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", nargs="+", default=[SE_E_OF_DELTA_H1],
                        help="function names, each optionally @ a function that must be on its chain")
    parser.add_argument("--json", type=Path, default=None, help="write the chains here")
    args = parser.parse_args(argv)
    logging.disable(logging.CRITICAL)
    chains = measure(args.target)
    for target in args.target:
        chain = chains.get(target)
        if chain is None:
            print(f"{target}: not reached from recipe.run")
            continue
        files = {f for f, _ in chain}
        print(f"{target}: {len(chain)} calls in {len(files)} files after recipe.run")
        print("   " + " → ".join(f"{f.removesuffix('.py')}.{fn}" for f, fn in chain))
    if args.json is not None:
        args.json.write_text(json.dumps(chains, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
