"""results.json (strict JSON, schema, reading it back), the console summary and the ΔH(η) plot
(entropy_experiments.report: results_schema, summary, plot)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from entropy_experiments.errors import OutputError
from entropy_experiments.probe.e_pass import E_PASSES
from entropy_experiments.report.html_report import render_html_report
from entropy_experiments.report.plot import plot_delta_h
from entropy_experiments.report.results_schema import (
    SCHEMA_VERSION,
    V1_TIMING_KEYS,
    dumps_strict,
    load_results,
    upgrade_results,
    validate_results_schema,
)
from entropy_experiments.report.run_dir import RunDirectory
from entropy_experiments.report.summary import render_summary
from tests.report_helpers import fake_results, no_temp_files

# ---- results.json ---------------------------------------------------------------------------

def test_results_json_is_strict_and_round_trips(tmp_path):
    res = fake_results()
    res["true"][3]["psis_khat"] = float("nan")
    res["linearity"]["loglog_slope"] = np.float64("inf")
    res["update"]["norm"] = torch.tensor(153.25)
    run = RunDirectory(tmp_path)
    path = run.write_results(res)

    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    loaded = json.loads(path.read_text(), parse_constant=no_constants)
    assert loaded["true"][3]["psis_khat"] is None and loaded["linearity"]["loglog_slope"] is None
    assert loaded["update"]["norm"] == 153.25
    assert loaded["deltaH1"] == res["deltaH1"] and loaded["true"][0]["eta"] == -1e-5
    assert load_results(tmp_path) == loaded == load_results(path)
    assert path.read_text().startswith('{\n  "schema_version": 2')  # indent 2


def test_validate_results_schema_names_first_missing_key():
    validate_results_schema(fake_results())
    res = fake_results()
    del res["true"][1]["logw"]["median"]
    with pytest.raises(ValueError, match=r"'true\[1\]\.logw\.median'"):
        validate_results_schema(res)
    res = fake_results()
    del res["counts"]["zero_advantage_prompts"]
    with pytest.raises(ValueError, match="'counts.zero_advantage_prompts'"):
        validate_results_schema(res)
    with pytest.raises(ValueError, match="normalize"):
        validate_results_schema(fake_results(normalize="per_char"))
    with pytest.raises(ValueError, match="'config_hash'"):
        RunDirectory("unused").write_results({k: v for k, v in fake_results().items() if k != "config_hash"})


def test_results_json_carries_the_schema_version():
    """Every results.json written holds the schema version of the code that wrote it (validated on write)."""
    assert SCHEMA_VERSION == 2
    validate_results_schema(fake_results())
    with pytest.raises(ValueError, match="missing key 'schema_version'"):
        validate_results_schema({k: v for k, v in fake_results().items() if k != "schema_version"})
    with pytest.raises(ValueError, match="'schema_version' must be 2, got 1"):
        validate_results_schema(fake_results(schema_version=1))


def version_1_results() -> tuple[dict, dict]:
    """(a results.json as version 1 wrote it, the same run under the current names): X̂·v as `bars_dot` only,
    the timing under the numbered phase names, the d2 bias estimate as `bias_bound`, a predictor's ratio as
    `ratio_to_measured` (predicted / measured) only, the E pass as `consistency.pieces_method` (backward_hooks,
    with r_i by the central difference: the pass named central_difference)."""
    phases = {"sample": 1.0, "update_direction": 2.0, "e_pass_backward": 3.0, "delta_h": 4.0, "total": 10.0}
    second_order = {"eta": 1e-3, "bias_estimate": 2e-4, "per_eta": [{"eta": 1e-3, "d2": 3.0, "bias_estimate": 2e-4}]}
    predictor = {"delta_h1": -1.2e-4, "se": 2e-5, "se_E": 1e-5, "se_U": 1.7e-5, "from_pieces": None}
    consistency = {"deltaH1_from_pieces": -1.23e-4, "relative_difference": 1e-6, "r_method": "central_difference",
                   "r_eta": 1e-4}
    current = fake_results(timing=phases, second_order=second_order, e_pass="central_difference",
                           consistency=consistency,
                           predictors={"adamw_step": {**predictor, "measured_over_predicted": 1.25}})
    old = {k: v for k, v in current.items() if k not in ("schema_version", "x_hat_dot_v", "e_pass")}
    old["consistency"] = {**consistency, "pieces_method": "backward_hooks"}
    old["bars_dot"] = current["x_hat_dot_v"]
    old["timing"] = {next(o for o, n in V1_TIMING_KEYS.items() if n == k) if k != "total" else k: v
                     for k, v in phases.items()}
    old["second_order"] = {"eta": 1e-3, "bias_bound": 2e-4, "per_eta": [{"eta": 1e-3, "d2": 3.0, "bias_bound": 2e-4}]}
    old["predictors"] = {"adamw_step": {**predictor, "ratio_to_measured": 0.8}}
    return old, current


def test_a_version_1_results_json_reads_under_the_current_names(tmp_path):
    """A results.json without schema_version (version 1) reads through `upgrade_results` into the current names,
    and the summary and report.html render it as they render the same run written now."""
    old, current = version_1_results()
    assert "phase0_sampling" in old["timing"] and "bias_bound" in old["second_order"]
    (tmp_path / "results.json").write_text(json.dumps(old))
    read = load_results(tmp_path)
    assert read == current
    assert "bars_dot" not in read and "ratio_to_measured" not in read["predictors"]["adamw_step"]
    assert render_summary(read) == render_summary(current)
    assert render_html_report(read) == render_html_report(current)
    assert upgrade_results(current) is current  # the current version passes as it is
    with pytest.raises(OutputError, match="schema_version 3: this entropy-probe reads versions 1 to 2"):
        upgrade_results(fake_results(schema_version=3))


@pytest.mark.parametrize("consistency, e_pass", [
    ({"pieces_method": "backward_hooks", "r_method": "backward"}, "backward_hooks"),
    ({"pieces_method": "backward_hooks", "r_method": "central_difference"}, "central_difference"),
    ({"pieces_method": "jvp", "r_method": "jvp"}, "jvp"),
    ({}, "two_pass"),  # error bars off: no pieces, the E pass without them
])
def test_a_version_1_e_pass_is_read_off_its_consistency(consistency, e_pass):
    old = {k: v for k, v in fake_results(consistency=consistency).items() if k not in ("schema_version", "e_pass")}
    read = upgrade_results(old)
    assert read["e_pass"] == e_pass and "pieces_method" not in read["consistency"]
    assert e_pass in E_PASSES


def test_load_results_missing_file_names_the_path(tmp_path):
    with pytest.raises(OutputError) as info:
        load_results(tmp_path)
    assert str(tmp_path / "results.json") in str(info.value)
    (tmp_path / "results.json").write_text("{ broken")
    with pytest.raises(OutputError, match="not valid JSON"):
        load_results(tmp_path)


# ---- summary and plot -------------------------------------------------------------------------

def test_summary_contains_the_numbers():
    from rich.cells import cell_len

    text = render_summary(fake_results())
    # Literal strings written by hand from fake_results (not via the module's formatter).
    for expected in ("0.6123 nats/token", "41.8760 nats/seq",
                     "-0.0001235 ± 2.5e-05", "SE_E 1.5e-05", "SE_U 2e-05",   # δH₁ = 1e-5 × -12.3456
                     "1e-05",                                                 # learning rate
                     "-12.35",                                                # X̂·v
                     "-0.0008765 ± 0.00012",                                  # ΔH at η = 1e-4 (ratio 0.71)
                     "0.93 ✗", "0.710", "0.980",                              # k̂ flag, ratios to δH₁(η)
                     "-9.123", "measured/predicted 0.739", "1.043", "-12.05",  # linearity
                     "runs/step_40", "k̂ > 0.7 at η=0.0001"):
        assert expected in text, expected
    assert text.count("✗") == 1  # only η = 1e-4 has k̂ above its threshold
    assert max(cell_len(line) for line in text.splitlines()) <= 110
    assert "\x1b[" not in text  # no colour codes


def test_summary_notes_when_khat_rests_on_few_tail_draws():
    from entropy_experiments.estimators.snis import psis_tail_size

    assert [psis_tail_size(n) for n in (24, 25, 32, 225, 226, 10_000)] == [4, 5, 6, 45, 45, 300]
    text = render_summary(fake_results())  # N = ess / ess_frac = 64 → M = 12 tail draws
    assert "M = 12 largest of N = 64 weights" in text and "prior worth 10 draws" in text
    big = fake_results()
    for entry in big["true"]:
        entry["ess"] = entry["ess_frac"] * 1000  # N = 1000 → M = 94: the fit is the data's
    assert "largest of N" not in render_summary(big)


def test_summary_tolerates_nulls():
    res = json.loads(dumps_strict(fake_results(deltaH1=float("nan"), x_hat_dot_v=0.0)))
    text = render_summary(res)
    assert "n/a" in text


def test_plot_is_a_png(tmp_path):
    res = fake_results()
    res["true"][1]["deltaH_true"] = float("nan")  # a missing point must not break the plot
    path = plot_delta_h(res, tmp_path / "delta_h_vs_eta.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024
    assert no_temp_files(tmp_path)
    # Linear x (narrow η span), per-sequence units, no points at all.
    narrow = fake_results(normalize="per_sequence", true=fake_results()["true"][2:3])
    assert plot_delta_h(narrow, tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    assert plot_delta_h(fake_results(true=[]), tmp_path / "c.png").stat().st_size > 1024


def _not_measured() -> dict:
    """fake_results as a run with importance.enabled: false writes it (after the strict-JSON round trip)."""
    res = fake_results(true=[], linearity={"slope_through_origin": float("nan"), "loglog_slope": float("nan"),
                                           "symmetric_slopes": []})
    return json.loads(dumps_strict(res))


def test_summary_without_delta_h_rows_says_not_measured():
    res = _not_measured()
    validate_results_schema(res)
    text = render_summary(res)
    assert "ΔH(η) not measured (importance.enabled: false)" in text
    assert "-0.0001235 ± 2.5e-05" in text and "k̂ > 0.7 at η=0.0001" in text  # δH₁ and the warnings stay
    assert "Measured ΔH(η)" not in text and "Linearity" not in text and "slope" not in text
    full = render_summary(fake_results())
    assert "not measured" not in full and "Measured ΔH(η)" in full and "Linearity of ΔH in η" in full


def test_plot_without_delta_h_rows_draws_the_prediction_only(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    drawn = []

    def recording(method):
        real = getattr(Axes, method)
        return lambda self, *args, **kwargs: drawn.append(method) or real(self, *args, **kwargs)

    for method in ("plot", "fill_between", "errorbar", "text"):
        monkeypatch.setattr(Axes, method, recording(method))
    path = plot_delta_h(_not_measured(), tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn == ["plot", "fill_between"]  # the δH₁ line and its band; no points, no "no finite ΔH" text
    drawn.clear()
    plot_delta_h(fake_results(), tmp_path / "q.png")
    assert drawn == ["plot", "fill_between", "errorbar", "errorbar"]
