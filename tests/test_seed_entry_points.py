"""The seed-API entry points (the legacy import paths `entropy_experiments.offline_entropy_probe`,
`entropy_experiments.probe_components` and `entropy_experiments.model_loader`): the seeds' config keys through
`OfflineEntropyProbe.from_config_file`, `run_mixed_probe`, `_sample_EU_via_sequence_processor`,
`_pack_U_from_sequences`, `ProbeComponents.compute_delta_h1_from_batches` / `accumulate_sum_X` / `accumulate_sum_Y`
and the seeds' command line `python -m entropy_experiments.offline_entropy_probe`, each against an independent
reference. (The seed SequenceProcessor: test_seed_sequence_processor.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from entropy_experiments.errors import ConfigError
from entropy_experiments.estimators.update_direction import named_dot
from entropy_experiments.offline_entropy_probe import OfflineEntropyProbe
from entropy_experiments.probe_components import ProbeComponents
from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts
from tests.run_helpers import make_run_setup, subprocess_env


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


def test_the_seeds_config_keys_are_read(tmp_path):
    """The keys the seeds added: probe_rework / sampling toggles (now `sampler.batched`), checkpoint.use_qlora,
    dtype, device_map, the generation knobs and seed 004's precision profiles."""
    raw = {"checkpoint": {"model_config_path": "m", "use_qlora": False, "dtype": "bf16", "device_map": "cpu"},
           "probe_rework": {"use_sequence_processor_sampling": False},
           "generation": {"temperature": 0.7, "top_p": 0.95, "max_new_tokens": 9, "gen_batch_size": 4,
                          "tf_batch_size": 2, "rb_requires_grad": True, "do_sample": True},
           "precision": {"func_override": {"dtype": "bfloat16", "cast_params": True}, "entropy_fp64": True}}
    path = tmp_path / "seed.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = OfflineEntropyProbe.from_config_file(path).config
    assert cfg.sampler.batched is False and cfg.checkpoint.base_model == "m"
    assert (cfg.checkpoint.use_qlora, cfg.checkpoint.dtype, cfg.checkpoint.device_map) == (False, "bf16", "cpu")
    assert (cfg.generation.temperature, cfg.generation.top_p, cfg.generation.max_new_tokens,
            cfg.generation.gen_batch_size, cfg.generation.tf_batch_size) == (0.7, 0.95, 9, 4, 2)
    assert cfg.precision.func_override.dtype == "bfloat16" and cfg.precision.entropy_fp64 is True
    path.write_text(yaml.safe_dump({"sampling": {"use_sequence_processor": True}}))  # seed 002's spelling
    assert OfflineEntropyProbe.from_config_file(path).config.sampler.batched is True


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
    a, r = with_pieces.pieces
    coefs = with_pieces.coefficients
    # X̂·v = (Σa − Ĥ Σr)/D, the pieces summed by hand
    from_pieces = (float(a.sum()) - coefs.H_hat * float(r.sum())) / coefs.D
    assert from_pieces == pytest.approx(with_pieces.x_hat_dot_v, rel=1e-4)
    assert with_pieces.delta_h1 == pytest.approx(plain.delta_h1, rel=1e-5)
    assert len(with_pieces.u_gradients.groups) == 2

    # the seeds' accumulate_sum_Y / accumulate_sum_X are the g and X̂ the δH₁ above was made of
    for name, g in comps.accumulate_sum_Y(U).total.items():
        torch.testing.assert_close(g, plain.u_gradients.total[name], rtol=0, atol=0)
    X_hat = comps.accumulate_sum_X(E, plain.coefficients)
    assert named_dot(X_hat, plain.v) == pytest.approx(plain.x_hat_dot_v, rel=1e-6)


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
    # seed 000's packer: advantages A = r − mean over the prompt's G responses (by hand)
    rewards = [[1.0, 0.0], [0.5, 0.5]]
    seqs = probe._sequence_processor.generate_batched(["Hi", "What is 2 + 2?"], G=2, seed=0)
    packed = probe._pack_U_from_sequences(seqs, rewards)
    assert torch.as_tensor(packed["advantages"]).tolist() == [[0.5, -0.5], [0.0, 0.0]]
    assert torch.as_tensor(packed["rewards"]).tolist() == rewards
    assert torch.equal(packed["sequences"], seqs.sequences) and packed["gen_lens"] == seqs.gen_lens


def test_module_entry_point_dryrun(tiny_model_dir, tmp_path):
    """`python -m entropy_experiments.offline_entropy_probe --config FILE --dryrun` (seeds 000 / 001) on a
    1-step checkpoint: prints the summary, writes nothing."""
    config_file, _ = make_run_setup(tmp_path / "setup", tiny_model_dir)
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    proc = subprocess.run([sys.executable, "-m", "entropy_experiments.offline_entropy_probe",
                           "--config", str(config_file), "--dryrun"],
                          cwd=run_dir, env=subprocess_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "δH₁" in proc.stdout and "Measured ΔH(η)" in proc.stdout
    assert list(run_dir.iterdir()) == [], "a dry run writes nothing"


def test_model_loader_legacy_names_are_the_checkpoint_functions():
    """`entropy_experiments.model_loader` (seed 001) hands out the core loaders, which take the seed's keywords."""
    import inspect

    import entropy_experiments.model_loader as ml
    from entropy_experiments.checkpoint import adapter, optimizer_state

    assert ml.load_peft_for_probe is adapter.load_peft_for_probe
    assert ml.load_adam_optimizer_from_path is optimizer_state.load_adam_optimizer_from_path
    assert all(hasattr(ml, name) for name in ml.__all__)
    seed_keywords = {"base_id", "adapter_path", "use_qlora", "dtype", "device_map", "use_checkpointing"}
    assert seed_keywords <= set(inspect.signature(ml.load_peft_for_probe).parameters)
