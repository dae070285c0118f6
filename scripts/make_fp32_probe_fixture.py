"""The fixture of a whole probe run by the code before the sampler correction: tests/fixtures/probe_fp32_run.json.

    git archive 6dd0da8 | tar -x -C /tmp/before        # main before the sampler correction was merged
    PYTHONPATH=/tmp/before OMP_NUM_THREADS=1 python scripts/make_fp32_probe_fixture.py tests/fixtures/probe_fp32_run.json

It runs `entropy-probe make-checkpoint` and `entropy-probe run` in process on the tiny random Qwen2
(entropy_experiments/testing/tiny_model.py), every phase on, with the config sections in SECTIONS (an integer
gen_batch_size: the chunk-seeded fp32 draws), and writes the sections, results.json less its timings and
environment, per_sequence.jsonl and the E / U token ids, with the CPU kernel set torch dispatched to
(`cpu_capability`). tests/test_sampler_e2e.py reruns the same sections with the current code (and
`generation.sampler_dtype: fp32`) on whatever CPU runs the tests: the token ids must be equal, every number
within its fp32 rounding measured on that run's E (tests/recorded_run.py). The shipped fixture was recorded
with AVX2 kernels (`ATEN_CPU_CAPABILITY=avx2` reproduces it bit for bit).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

SECTIONS = {
    "batch_config": {"B_E": 8},
    "generation": {"gen_batch_size": 4},
    "importance": {"eta_list": [1.0e-3], "symmetric": True},
    "second_order": {"enabled": True, "method": "jvp"},
    "predictors": {"enabled": True},
    "variance": {"enabled": True},
    "output": {"plot": False, "token_attribution": True},
}


def run_record(run_dir: Path) -> dict:
    """What a run directory says, minus what differs between two runs of the same config (timings, environment)."""
    res = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    rows = [json.loads(line) for line in (run_dir / "per_sequence.jsonl").read_text(encoding="utf-8").splitlines()]
    E, U = (torch.load(run_dir / name, weights_only=True) for name in ("E_batch.pt", "U_batch.pt"))
    return {"results": {k: v for k, v in res.items() if k not in ("timing", "environment")},
            "per_sequence": rows,
            "E_sequences": E["sequences"].tolist(), "U_sequences": U["sequences"].tolist()}


def main(out: Path) -> None:
    from entropy_experiments import cli
    from entropy_experiments.testing.tiny_model import build_tiny_model_dir
    from tests.run_helpers import make_run_setup

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config, _ = make_run_setup(folder / "setup", build_tiny_model_dir(folder / "tiny"), **SECTIONS)
        assert cli.main(["run", "--config", str(config), "--out", str(folder / "run")]) == 0
        record = {"sections": SECTIONS, "torch": torch.__version__,
                  "cpu_capability": torch.backends.cpu.get_cpu_capability(), **run_record(folder / "run")}
    out.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
