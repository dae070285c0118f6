"""The seed-API entry points (the legacy import paths `entropy_experiments.offline_entropy_probe` and
`entropy_experiments.probe_components`): `OfflineEntropyProbe.from_config_file`,
`OfflineEntropyProbe._sample_EU_via_sequence_processor` and `ProbeComponents.compute_delta_h1_from_batches`,
each against an independent reference."""

from __future__ import annotations

import pytest
import torch
import yaml

from entropy_experiments.errors import ConfigError
from entropy_experiments.estimators.update_direction import named_dot
from entropy_experiments.offline_entropy_probe import OfflineEntropyProbe
from entropy_experiments.probe_components import ProbeComponents
from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts


def seed_probe(model_dir, data, config: dict) -> OfflineEntropyProbe:
    """The seed façade around make_probe's model (tiny model + random LoRA), tokenizer and trained AdamW."""
    setup = make_probe(model_dir, data, config)
    probe = OfflineEntropyProbe(setup.config)
    probe.model, probe.tokenizer, probe.optimizer = setup.model, setup.tokenizer, setup.optimizer
    return probe


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
    probe = seed_probe(tiny_model_dir, data, {"importance": {"enabled": False}, "predictors": {"enabled": False},
                                              "second_order": {"enabled": False}})
    captured = {}
    results = probe.run_mixed_probe(on_batches=lambda E, U: captured.update(E=E, U=U))
    return probe, results, captured["E"], captured["U"]


@pytest.mark.e2e
def test_compute_delta_h1_from_batches_matches_the_run_and_its_own_pieces(probed):
    probe, results, E, U = probed
    comps = ProbeComponents(probe.model, probe.config, sequence_processor=probe._sequence_processor)
    lr = probe.optimizer.param_groups[0]["lr"]

    plain = comps.compute_delta_h1_from_batches(E, U, probe.optimizer)        # E scored first, one backward
    assert plain.learning_rate == lr  # δH₁ itself: against the run's other path (one pass, hooks) below
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


@pytest.mark.parametrize("mode", ["replacement", "distinct"])
def test_seed_sampling_entry_point_on_a_fresh_probe(tiny_model_dir, tmp_path, mode):
    """`_sample_EU_via_sequence_processor` (seed 000's API) works before any run, in both E modes."""
    prompts_file = write_prompts(tmp_path / "prompts.jsonl", SHORT_PROMPTS)
    probe = seed_probe(tiny_model_dir, prompts_file, {"batch_config": {"E_sampling_mode": mode, "G": 2}})
    E, U = probe._sample_EU_via_sequence_processor(B_E=3, B_U=2, G_U=2)
    E_per_prompt = 1 if mode == "replacement" else 2
    assert (E["num_prompts"], E["num_responses_per_prompt"]) == (3, E_per_prompt)
    assert (U["num_prompts"], U["num_responses_per_prompt"]) == (2, 2)
    assert len(set(probe.index_plan.U_prompt_indices)) == 2
    if mode == "distinct":
        assert len(set(probe.index_plan.E_prompt_indices)) == 3


def test_model_loader_legacy_names_are_the_checkpoint_functions():
    """`entropy_experiments.model_loader` (legacy path) hands out the very objects of the core modules."""
    import entropy_experiments.model_loader as ml
    from entropy_experiments.checkpoint import adapter, optimizer_state, writer
    from entropy_experiments.models import embedded

    assert ml.load_peft_for_probe is adapter.load_peft_for_probe
    assert ml.load_adam_optimizer_from_path is optimizer_state.load_adam_optimizer_from_path
    assert ml.save_checkpoint is writer.save_checkpoint
    assert ml.ensure_embedded_model is embedded.ensure_embedded_model
    assert all(hasattr(ml, name) for name in ml.__all__)
