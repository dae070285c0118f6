"""Re-analysis: another run's saved E / U samples analysed with different settings, in a new run directory.

    entropy-probe run --config new.yaml --reuse-samples RUN_DIR --out NEW_DIR

The analysis settings (objective, estimator, importance, variance, second order, predictors, precision,
learning_rate, output) may differ from RUN_DIR's config.yaml; a setting that decided what was sampled
(`SAMPLING_KEYS`: the seed, checkpoint, data, generation, sampler, reward) may not — it is refused with one
line naming the first key that differs. The saved batch files are copied byte for byte into the new run
directory, and results.json records where they came from (`samples.reused_from`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ..config import ProbeConfig, load_config
from ..errors import ConfigError
from ..report.run_dir import BATCH_FILES, CONFIG_FILE, RunDirectory

# Top-level keys and whole sections whose every key decided the samples.
SAMPLING_KEYS = ("seed", "checkpoint", "batch_config", "sampler", "reward")
# Generation keys that do not change what is sampled (teacher-forcing batch size, a gradient switch).
ANALYSIS_GENERATION_KEYS = frozenset({"tf_batch_size", "rb_requires_grad"})


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(_flatten(sub, f"{prefix}.{key}"))
        return out
    return {prefix: value}


def sampling_settings(config: ProbeConfig) -> dict[str, Any]:
    """{dotted key: value} of every setting that decided the samples."""
    d = config.to_dict()
    out: dict[str, Any] = {}
    for key in SAMPLING_KEYS:
        out.update(_flatten(d[key], key))
    for key, value in d["generation"].items():
        if key not in ANALYSIS_GENERATION_KEYS:
            out.update(_flatten(value, f"generation.{key}"))
    return out


def first_sampling_difference(saved: ProbeConfig, new: ProbeConfig) -> str | None:
    """'key: saved value → new value' of the first sampling setting that differs, or None."""
    a, b = sampling_settings(saved), sampling_settings(new)
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return f"{key}: {a.get(key)!r} in the saved run, {b.get(key)!r} now"
    return None


def reusable_samples(source: str | Path, config: ProbeConfig) -> tuple[dict, dict]:
    """The (E, U) batches of run directory `source`, after checking that `config` samples as its run did."""
    source = Path(source)
    if not (source / CONFIG_FILE).is_file():
        raise ConfigError(f"--reuse-samples {source}: not a run directory (no {CONFIG_FILE})")
    difference = first_sampling_difference(load_config(source / CONFIG_FILE), config)
    if difference is not None:
        raise ConfigError(f"--reuse-samples {source}: a sampling setting differs ({difference}); re-analysis may "
                          "change only the analysis (objective, estimator, importance, variance, second_order, "
                          "predictors, precision, learning_rate)")
    run = RunDirectory(source)
    E, U = run.load_batch("E"), run.load_batch("U")
    if E is None or U is None:
        raise ConfigError(f"--reuse-samples {source}: no saved E_batch.pt / U_batch.pt (output.save_batches was off, "
                          "or the run stopped before sampling finished)")
    return E, U


def copy_samples(source: str | Path, target: Path) -> None:
    """Copy the saved batch files byte for byte into the new run directory."""
    for name in BATCH_FILES.values():
        shutil.copyfile(Path(source) / name, Path(target) / name)
