"""`entropy-probe sweep` at its defaults reports what the README's sweep section promises: first order along the
step the run took. A real run on the enumerable toy model (3 checkpoints, real AdamW steps) is swept with the
probe's predictor defaults (predictors.enabled false, predictors.displacement true); every interval then carries
the displacement predictor, its first-order residual and the U-noise test, the probe's own δH₁ is still scored,
and the competing predictors and the proxies stay off. The displacement's values are those of each checkpoint's
results.json, and δH_Δθ lies within 4 SE_E of the exact derivative of the exact entropy along Δθ (a central
difference of the enumeration at θ ± ε·Δθ)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.sweep import run_sweep
from entropy_experiments.testing.tiny_model import build_toy_enumerable_dir
from tests.sweep_helpers import exact_entropy, load_checkpoint_model, train_run

pytestmark = pytest.mark.xdist_group("test_sweep_default")


@pytest.fixture(scope="module")
def default_sweep(tmp_path_factory) -> tuple[Path, Path, dict, dict]:
    """(toy model dir, checkpoints dir, config dict, sweep.json) of a sweep at the predictors' defaults."""
    folder = tmp_path_factory.mktemp("sweep_default")
    toy = build_toy_enumerable_dir(folder / "toy")
    run, config = train_run(folder, toy, steps=3, batch_config={"B_E": 4000})
    del config["predictors"]  # the defaults: no competing predictors, the displacement on
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        doc = run_sweep(config_from_dict(config), run, out=str(folder / "sweep"))
    finally:
        torch.set_num_threads(n)
    return toy, run, config, doc


def _exact_slope(model_from, model_to, tokenizer, eps: float = 1e-3) -> float:
    """d/ds H(θ_from + s·Δθ) at s = 0 by a central difference of the enumerated entropy (LoRA weights moved)."""
    to = dict(model_to.named_parameters())
    values = []
    for s in (eps, -eps):
        moved = copy.deepcopy(model_from)
        with torch.no_grad():
            for name, p in moved.named_parameters():
                if "lora_" in name:
                    p.add_(s * (to[name] - p))
        values.append(exact_entropy(moved, tokenizer))
    return (values[0] - values[1]) / (2 * eps)


@pytest.mark.e2e
def test_a_default_sweep_reports_the_displacement(default_sweep):
    toy, run, config, doc = default_sweep
    assert "predictors" not in config and len(doc["realised"]) == 2
    for real, row in zip(doc["realised"], doc["rows"]):
        assert set(row["predictors"]) == {"displacement", "adamw_step"}  # no competing predictors, no proxies
        res = json.loads((Path(doc["checkpoints_dir"]).parent / "sweep" / row["run_dir"] / "results.json")
                         .read_text())
        disp = real["displacement"]
        assert disp["value"] == res["predictors"]["displacement"]["delta_h1"]
        assert real["predictors"]["displacement"]["z"] == real["first_order"]["z"] is not None
        assert real["u_noise"]["z"] is not None and real["predictors"]["adamw_step"]["z"] is not None
        (before, tok), (after, _) = (load_checkpoint_model(toy, run / real[k])
                                     for k in ("from_checkpoint", "to_checkpoint"))
        exact = _exact_slope(before, after, tok)
        print(f"\n{real['from_checkpoint']} → {real['to_checkpoint']}: δH_Δθ {disp['value']:+.4g} ± {disp['se']:.2g}, "
              f"exact derivative along Δθ {exact:+.4g}")
        assert abs(disp["value"] - exact) < 4 * disp["se"] and disp["se"] < 0.5 * abs(exact)
    assert list(doc["calibration"])[:2] == ["displacement", "adamw_step"]
    assert doc["decomposition"]["first_order"]["n"] == 2
