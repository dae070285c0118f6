"""The seed-API entry points that had no test of their own (issue 26): `OfflineEntropyProbe.from_config_file`
and `ProbeComponents.compute_delta_h1_from_batches`, each against an independent reference."""

from __future__ import annotations

import pytest
import torch
import yaml

from entropy_experiments.errors import ConfigError
from entropy_experiments.estimators.update_direction import named_dot
from entropy_experiments.offline_entropy_probe import OfflineEntropyProbe
from entropy_experiments.probe_components import ProbeComponents
from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts


def test_from_config_file_reads_the_yaml_and_applies_overrides(tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", SHORT_PROMPTS)
    raw = {"seed": 11, "batch_config": {"dataset_name": "jsonl", "dataset_path": str(data), "B_E": 6, "B_U": 3},
           "generation": {"max_new_tokens": 7}, "estimator": {"normalize": "per_sequence"}}
    path = tmp_path / "probe.yaml"
    path.write_text(yaml.safe_dump(raw))
    probe = OfflineEntropyProbe.from_config_file(path, ["batch_config.B_U=5", "importance.eta_list=[1e-4]"])
    cfg = probe.config
    assert (cfg.seed, cfg.batch_config.B_E, cfg.generation.max_new_tokens, cfg.estimator.normalize) == \
        (11, 6, 7, "per_sequence")                                   # from the file
    assert cfg.batch_config.B_U == 5 and cfg.importance.eta_list == [1e-4]   # from the overrides
    assert cfg.batch_config.dataset_path == str(data)
    assert probe.model is None and probe.warnings == []               # nothing loaded yet
    with pytest.raises(ConfigError, match="batch_config.B_EE"):
        OfflineEntropyProbe.from_config_file(path, ["batch_config.B_EE=3"])


@pytest.fixture(scope="module")
def probed(tiny_model_dir, tmp_path_factory):
    """A tiny probe run (error bars on: the one-pass backward with hook pieces) and the batches it drew."""
    data = write_prompts(tmp_path_factory.mktemp("seed_api") / "p.jsonl", SHORT_PROMPTS)
    probe = make_probe(tiny_model_dir, data, {"importance": {"enabled": False}, "predictors": {"enabled": False},
                                              "second_order": {"enabled": False}})
    captured = {}
    results = probe.run_mixed_probe(on_batches=lambda E, U: captured.update(E=E, U=U))
    return probe, results, captured["E"], captured["U"]


def test_compute_delta_h1_from_batches_matches_the_run_and_its_own_pieces(probed):
    probe, results, E, U = probed
    comps = ProbeComponents(probe.model, probe.config, sequence_processor=probe._sequence_processor)
    lr = probe.optimizer.param_groups[0]["lr"]

    plain = comps.compute_delta_h1_from_batches(E, U, probe.optimizer)        # E scored first, one backward
    assert plain.learning_rate == lr and plain.delta_h1 == lr * plain.x_hat_dot_v
    assert plain.x_hat_dot_v == pytest.approx(named_dot(plain.X_hat, plain.v), rel=1e-12)
    # the run took the one-pass path (two backwards, hooks): the same δH₁ on the same batches
    assert plain.delta_h1 != 0
    assert plain.delta_h1 == pytest.approx(results["deltaH1"], rel=1e-5)
    for name, v in probe.update_vector.items():  # the run summed g over 4 U groups, here 1: fp32 rounding apart
        torch.testing.assert_close(plain.v[name], v, rtol=1e-4, atol=1e-5 * float(v.abs().max()))
    # the seed's names (seed 001: {delta_h1, bars_dot, Xbar, Ybar, timings})
    assert plain.Xbar is plain.X_hat and plain.Ybar is plain.v and plain.timings
    assert plain.bars_dot == plain.x_hat_dot_v

    with_pieces = comps.compute_delta_h1_from_batches(E, U, probe.optimizer, u_groups=[[0, 1], [2, 3]],
                                                      per_sequence_pieces=True)
    a, r = comps.pieces(with_pieces)
    coefs = with_pieces.coefficients
    # X̂·v = (Σa − Ĥ Σr)/D, the pieces summed by hand
    from_pieces = (float(a.sum()) - coefs.H_hat * float(r.sum())) / coefs.D
    assert from_pieces == pytest.approx(with_pieces.x_hat_dot_v, rel=1e-4)
    assert with_pieces.delta_h1 == pytest.approx(plain.delta_h1, rel=1e-5)
    assert len(with_pieces.u_gradients.groups) == 2
    with pytest.raises(ValueError, match="per_sequence_pieces=True"):
        comps.pieces(plain)
