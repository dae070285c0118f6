"""A real tiny run set-up shared by the reliability tests: prompts file, checkpoint, config file,
and running `entropy-probe` as a fresh subprocess (the way a user does)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.probe_helpers import SHORT_PROMPTS, merge_sections, write_prompts

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def logging_restored():
    """cli.main rebinds the package logger to the current sys.stderr and stops propagation; undo that
    so that later tests (caplog, capsys) in the same worker see an untouched logging setup."""
    names = ("entropy_experiments", "transformers", "peft", "accelerate")
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in names}
    try:
        yield
    finally:
        for n, (handlers, level, propagate) in saved.items():
            logger = logging.getLogger(n)
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate


def base_config(tiny_model_dir: Path, data: Path, **sections) -> dict:
    config = {
        "seed": 3,
        "checkpoint": {"base_model": str(tiny_model_dir), "device_map": "cpu"},
        "batch_config": {"dataset_name": "jsonl", "dataset_path": str(data), "B_E": 4, "B_U": 2, "G": 2},
        "generation": {"max_new_tokens": 8, "gen_batch_size": 8, "tf_batch_size": 8},
        "reward": {"name": "tests.probe_rewards:count_a"},
        "estimator": {"microbatch_size": 8},
        "importance": {"eta_list": [1.0e-4, 1.0e-3], "symmetric": True},
        "predictors": {"enabled": True},
        "output": {"plot": False},
    }
    merge_sections(config, sections)
    return config


def make_run_setup(folder: Path, tiny_model_dir: Path, **sections) -> tuple[Path, dict]:
    """(config file path, config dict): prompts, a 1-step checkpoint (make-checkpoint) and the probe config."""
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.make_checkpoint.trained import make_checkpoint

    folder.mkdir(parents=True, exist_ok=True)
    data = write_prompts(folder / "prompts.jsonl", SHORT_PROMPTS)
    config = base_config(tiny_model_dir, data, **sections)
    ckpt = folder / "ckpt"
    make_checkpoint(ckpt, config_from_dict(config), steps=1)
    config["checkpoint"]["checkpoint_path"] = str(ckpt)
    path = folder / "probe.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    return path, config


def subprocess_env(**extra: str) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **extra}


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "entropy_experiments.cli", *args]


def run_cli(args: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli_command(*args), cwd=cwd, env=subprocess_env(**env), capture_output=True,
                          text=True, timeout=timeout, check=False)


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text(encoding="utf-8"))


def numbers(res: dict) -> dict:
    """Everything in results.json that a repeated / resumed run must reproduce exactly: all but the timings, the
    environment and the `sampler` block's seconds and tokens/s (the record of how E and U were drawn — dtype,
    engine, draws, rows per call — and the correction computed from the batches are kept)."""
    drop = {"timing", "environment"}
    out = {k: v for k, v in res.items() if k not in drop}
    if isinstance(out.get("sampler"), dict):  # the sampler's seconds and tokens/s are timings
        out["sampler"] = {k: ({f: x for f, x in v.items() if f not in ("seconds", "tokens_per_s")}
                              if isinstance(v, dict) else v) for k, v in out["sampler"].items()}
    return out
