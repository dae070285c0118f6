"""The sweep's calibration plot puts a scale-free proxy (a logit-space step of unknown size) on the 1:1 axes only
at its fitted scale c, labelled as such, and leaves it out where c is undefined."""

from __future__ import annotations

import pytest

from entropy_experiments.sweep.plots import at_fitted_scale, plot_calibration


def _calibration(c):
    return {"adamw_step": {"realised": {"n": 2}},
            "cui_npg": {"realised": {"n": 2, "scale_free": True, "loo_scale": {"scale": c}}}}


def test_a_proxy_is_drawn_at_its_fitted_scale_and_a_scaled_predictor_as_it_is():
    pairs = {"adamw_step": [(0.01, 0.02, 0.005)], "cui_npg": [(2.0, 0.02, 0.005), (-4.0, -0.03, 0.01)]}
    out = at_fitted_scale(pairs, _calibration(0.005), "realised")
    assert out["adamw_step"] == pairs["adamw_step"]
    assert "cui_npg" not in out
    assert out["cui_npg × 0.005 (fitted)"] == [(pytest.approx(0.01), 0.02, 0.005), (pytest.approx(-0.02), -0.03, 0.01)]


@pytest.mark.parametrize("c", [None, float("nan")])
def test_a_proxy_without_a_fitted_scale_is_left_out(c):
    out = at_fitted_scale({"adamw_step": [], "cui_npg": [(2.0, 0.02, 0.005)]}, _calibration(c), "realised")
    assert list(out) == ["adamw_step"]


def test_the_calibration_plot_labels_the_proxy_with_its_scale(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    labels = []
    real_errorbar = matplotlib.axes.Axes.errorbar
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar",
                        lambda self, *a, **k: labels.append(k.get("label")) or real_errorbar(self, *a, **k))
    doc = {"units": "nats/token", "calibration": _calibration(0.005), "rows": [],
           "realised": [{"dH_realised": 0.02, "se": 0.005,
                         "predictors": {"adamw_step": {"dH_predicted": 0.01}, "cui_npg": {"dH_predicted": 2.0}}}]}
    assert plot_calibration(doc, tmp_path / "calibration.png").exists()
    assert "cui_npg × 0.005 (fitted)" in labels and "cui_npg" not in labels


def _metrics(scale_free: bool) -> dict:
    ci = {"r": 0.5, "ci95": [0.1, 0.9]}
    m = {"n": 3, "sign_agreement": 1.0, "n_resolved": 1, "sign_agreement_resolved": 1.0, "pearson": ci,
         "spearman": ci, "coverage": {"value": None, "n": 0}, "rms_z": None, "median_ratio": 1.0}
    return {**m, "scale_free": True, "loo_scale": {"scale": 0.005, "coverage": 0.67}} if scale_free else m


@pytest.mark.parametrize("with_proxy", [True, False])
def test_the_printed_summary_says_the_proxies_units_only_when_they_are_there(capsys, with_proxy):
    from entropy_experiments.sweep.summary import print_sweep_summary

    calibration = {"adamw_step": {"realised": _metrics(False)}}
    if with_proxy:
        calibration["cui_npg"] = {"realised": _metrics(True)}
    print_sweep_summary({"n_checkpoints": 0, "units": "nats/token", "rows": [], "realised": [],
                         "calibration": calibration, "decomposition": {}})
    out = capsys.readouterr().out
    assert ("logit-space steps of unknown size, not nats/token" in out) == with_proxy


def test_the_per_predictor_figure_has_one_panel_per_predictor_the_proxy_at_its_scale(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    titles, points = [], {}
    real_set_title, real_errorbar = matplotlib.axes.Axes.set_title, matplotlib.axes.Axes.errorbar
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda self, t, *a, **k: titles.append(t) or real_set_title(self, t, *a, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar",
                        lambda self, x, y, *a, **k: points.setdefault(k.get("label"), list(x))
                        and real_errorbar(self, x, y, *a, **k))
    calibration = {"adamw_step": {"realised": _metrics(False)}, "cui_npg": {"realised": _metrics(True)}}
    realised = [{"dH_realised": y, "se": 0.005, "predictors": {"adamw_step": {"dH_predicted": y / 2},
                                                                "cui_npg": {"dH_predicted": 4 * y}}}
                for y in (0.02, -0.01)]
    from entropy_experiments.sweep.plots import plot_predictors

    doc = {"units": "nats/token", "calibration": calibration, "rows": [], "realised": realised}
    assert plot_predictors(doc, tmp_path / "predictors.png").exists()
    assert titles == ["adamw_step\nr +0.50, Spearman +0.50", "cui_npg × 0.005 (fitted)\nr +0.50, Spearman +0.50"]
    assert points["adamw_step"] == [0.01, -0.005]
    assert points["cui_npg × 0.005 (fitted)"] == [pytest.approx(0.0004), pytest.approx(-0.0002)]
    assert plot_predictors({**doc, "realised": []}, tmp_path / "none.png") is None
