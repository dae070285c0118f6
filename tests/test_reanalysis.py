"""Re-analysis: one run's saved samples analysed under two objectives in two new run directories
(`entropy-probe run --config NEW --reuse-samples RUN_DIR --out NEW_DIR`)."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.run_helpers import logging_restored, make_run_setup, results

pytestmark = pytest.mark.e2e  # runs whole probes (scripts/test.sh -m "not e2e" skips them)

REPO_ROOT = Path(__file__).resolve().parents[1]

LIGHT = {"importance": {"enabled": False}, "second_order": {"enabled": False}, "predictors": {"enabled": False}}
DAPO = {"loss_type": "dapo", "scale_rewards": "group"}


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from entropy_experiments import cli

    out, err = io.StringIO(), io.StringIO()
    with logging_restored(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def _config(folder, config: dict, **changes) -> str:
    d = yaml.safe_load(yaml.safe_dump(config))
    for section, values in changes.items():
        d[section] = {**d.get(section, {}), **values} if isinstance(values, dict) else values
    path = folder / f"cfg_{len(list(folder.glob('cfg_*')))}.yaml"
    path.write_text(yaml.safe_dump(d))
    return str(path)


def _bench_delta_h1(run_dir, specs: list[str]) -> dict[str, float]:
    """δH₁ per objective as bench/compare_objectives.py prints it."""
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    try:
        import compare_objectives
    finally:
        sys.path.pop(0)
    out = io.StringIO()
    with logging_restored(), contextlib.redirect_stdout(out):
        assert compare_objectives.main([str(run_dir), *[a for s in specs for a in ("--objective", s)]]) == 0
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s*(\S+): δH₁ = (\S+)", out.getvalue(), re.MULTILINE)}


def test_two_objectives_on_the_same_samples(tiny_model_dir, tmp_path):
    config_path, config = make_run_setup(tmp_path / "setup", tiny_model_dir, **LIGHT)
    source = tmp_path / "source"
    code, _, err = _cli(["run", "--config", str(config_path), "--out", str(source)])
    assert code == 0, err[-2000:]
    a, b = tmp_path / "default", tmp_path / "dapo"
    for target, objective in ((a, {}), (b, DAPO)):
        cfg = _config(tmp_path, config, objective=objective, variance={"u_groups": 2})
        code, _, err = _cli(["run", "--config", cfg, "--reuse-samples", str(source), "--out", str(target)])
        assert code == 0, err[-2000:]
    for name in ("E_batch.pt", "U_batch.pt"):
        assert (a / name).read_bytes() == (b / name).read_bytes() == (source / name).read_bytes()
    ra, rb = results(a), results(b)
    assert ra["samples"]["reused_from"] == str(source.resolve())
    assert ra["checkpoint"]["tokenizer"]["source"] == "base_model"  # make-checkpoint saves no tokenizer
    assert ra["deltaH1"] != rb["deltaH1"]
    assert results(source)["deltaH1"] == ra["deltaH1"]  # same objective, same samples: the same number
    bench = _bench_delta_h1(source, ["default", "loss_type=dapo,scale_rewards=group"])
    assert ra["deltaH1"] == pytest.approx(bench["default"], rel=1e-4)
    assert rb["deltaH1"] == pytest.approx(bench["loss_type=dapo,scale_rewards=group"], rel=1e-4)

    refused = _config(tmp_path, config, batch_config={**config["batch_config"], "B_E": 3})
    code, _, err = _cli(["run", "--config", refused, "--reuse-samples", str(source), "--out", str(tmp_path / "no")])
    line = err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("error: --reuse-samples") and "batch_config.B_E: 4 in the saved run, 3 now" in line
    assert "Traceback" not in err and not (tmp_path / "no").exists()
