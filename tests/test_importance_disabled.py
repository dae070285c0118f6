"""`importance.enabled: false` end to end through `entropy-probe run` and `entropy-probe report` on the tiny
model: the run completes with δH₁ only — results.json valid with `true` = [] and null linearity slopes,
the summary says ΔH(η) was not measured, the plot shows the prediction alone — and δH₁ is the same
number a run that does measure ΔH(η) reports."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from entropy_experiments import cli
from entropy_experiments.report.results_schema import validate_results_schema
from entropy_experiments.report.summary import render_summary
from tests.run_helpers import logging_restored, make_run_setup

# Costly module fixtures: one worker runs this whole file (scripts/test.sh distributes by xdist_group).
pytestmark = [pytest.mark.xdist_group("test_importance_disabled"), pytest.mark.e2e]

NOTE = "ΔH(η) not measured (importance.enabled: false)"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with logging_restored(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    """The same config run with importance off (the run under test) and on (the reference for δH₁)."""
    folder = tmp_path_factory.mktemp("importance_off")
    config, _ = make_run_setup(folder, tiny_model_dir, output={"plot": True})
    made = {}
    for name, enabled in (("off", "false"), ("on", "true")):
        out = folder / name
        code, stdout, stderr = _cli(["run", "--config", str(config), "--out", str(out),
                                     "--set", f"importance.enabled={enabled}"])
        assert code == 0, stderr[-3000:]
        made[name] = {"dir": out, "stdout": stdout, "results": json.loads((out / "results.json").read_text())}
    return made


def test_run_completes_with_delta_h1_only(runs):
    off = runs["off"]
    res = off["results"]
    validate_results_schema(res)
    assert res["true"] == []
    assert res["linearity"] == {"slope_through_origin": None, "loglog_slope": None, "symmetric_slopes": []}
    assert json.loads((off["dir"] / "run_meta.json").read_text())["status"] == "complete"
    rows = [json.loads(line) for line in (off["dir"] / "per_sequence.jsonl").read_text().splitlines()]
    assert len(rows) == res["counts"]["B_E"] and not any("logw" in row for row in rows)
    assert "delta_h" not in res["timing"]


def test_delta_h1_equals_that_of_a_run_that_measures_delta_h(runs):
    off, on = runs["off"]["results"], runs["on"]["results"]
    # the reference measured ±η for both η of the config
    assert len(on["true"]) == 4 and on["linearity"]["slope_through_origin"] is not None
    for key in ("deltaH1", "x_hat_dot_v", "learning_rate", "se", "H_orig", "counts"):
        assert off[key] == on[key], key


def test_summary_says_not_measured_and_has_no_delta_h_table(runs):
    text = runs["off"]["stdout"]
    assert NOTE in text and "δH₁ ± SE" in text
    assert "Measured ΔH(η)" not in text and "Linearity of ΔH" not in text
    assert NOTE not in runs["on"]["stdout"] and "Measured ΔH(η)" in runs["on"]["stdout"]
    assert (runs["off"]["dir"] / "delta_h_vs_eta.png").read_bytes().startswith(PNG_MAGIC)


def test_report_rerenders_summary_and_plot(runs, tmp_path):
    import shutil

    run_dir = Path(shutil.copytree(runs["off"]["dir"], tmp_path / "copy"))
    (run_dir / "delta_h_vs_eta.png").unlink()
    code, stdout, stderr = _cli(["report", str(run_dir)])
    assert code == 0, stderr
    assert stdout == runs["off"]["stdout"] == render_summary(runs["off"]["results"])
    assert (run_dir / "delta_h_vs_eta.png").read_bytes().startswith(PNG_MAGIC)
