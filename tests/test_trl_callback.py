"""EntropyProbeCallback inside a real trl.GRPOTrainer run (tiny model, CPU).

- The callback leaves training untouched: parameters and optimizer state after N steps are bit-identical to a
  run without it.
- Its numbers at a probed step equal an offline probe of the same checkpoint pair (checkpoint-k, checkpoint-k+1,
  loaded from disk by the probe's own loader) on the callback's own E and U samples.
- Bad options and unsupported trainers are one ConfigError before training starts.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("trl")

from entropy_experiments.checkpoint.displacement import displacement_to
from entropy_experiments.data.batch import Batch
from entropy_experiments.errors import ConfigError
from entropy_experiments.estimators.delta_h import measure_delta_h
from entropy_experiments.estimators.update_direction import named_dot
from entropy_experiments.integrations.trl_callback import LOG_FILE, EntropyProbeCallback
from entropy_experiments.probe.parallel import SINGLE
from entropy_experiments.probe.recipe import estimate_phase, load_phase
from entropy_experiments.probe.results import WarningLog
from entropy_experiments.testing.trl_run import tiny_grpo_trainer

pytestmark = pytest.mark.xdist_group("trl_callback")
STEPS = 3
OPTIONS = {"B_E": 6, "B_U": 2, "seed": 7}


def _train(out, model_dir, with_callback: bool):
    trainer = tiny_grpo_trainer(out, steps=STEPS, model_dir=model_dir, learning_rate=2e-2, max_completion_length=6)
    callback = None
    if with_callback:
        callback = EntropyProbeCallback(trainer, every=1, save_batches=True, **OPTIONS)
        trainer.add_callback(callback)
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return trainer, callback, params


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    base = tmp_path_factory.mktemp("trl_callback")
    plain = _train(base / "plain", tiny_model_dir, with_callback=False)
    probed = _train(base / "probed", tiny_model_dir, with_callback=True)
    return plain, probed, base


@pytest.mark.e2e
def test_training_with_the_callback_is_bit_identical(runs):
    (plain_trainer, _, plain_params), (probed_trainer, callback, probed_params), _ = runs
    assert len([r for r in callback.rows if "error" not in r]) == STEPS
    assert plain_params.keys() == probed_params.keys()
    for name in plain_params:
        assert torch.equal(plain_params[name], probed_params[name]), name
    a, b = plain_trainer.optimizer.state_dict(), probed_trainer.optimizer.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for key in a["state"]:
        for field, value in a["state"][key].items():
            assert torch.equal(value, b["state"][key][field]), (key, field)


@pytest.mark.e2e
def test_rows_are_logged_and_written(runs):
    (_, _, _), (trainer, _, _), base = runs
    lines = [json.loads(x) for x in (base / "probed" / LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    logged = [h for h in trainer.state.log_history if "entropy_probe/delta_h1" in h]
    assert [h["entropy_probe/delta_h1"] for h in logged] == pytest.approx([r["delta_h1"] for r in lines])
    for row in lines:
        assert row["lr"] > 0 and row["se"] > 0 and row["delta_theta_norm"] > 0
        assert row["first_order_residual_se"] > 0 and row["displacement_se"] > 0


@pytest.mark.e2e
def test_callback_equals_an_offline_probe_of_the_checkpoint_pair(runs):
    (_, _, _), (_, callback, _), base = runs
    step = 2  # probed before step 2: parameters of checkpoint-1, the step to checkpoint-2
    row = next(r for r in callback.rows if r["step"] == step)
    E = Batch.from_dict(torch.load(base / "probed" / "entropy_probe" / f"step_{step}" / "E_batch.pt", weights_only=True))
    U = Batch.from_dict(torch.load(base / "probed" / "entropy_probe" / f"step_{step}" / "U_batch.pt", weights_only=True))
    config = callback.config.model_copy(update={"seed": callback.step_seed(step)})
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(
        update={"checkpoint_path": str(base / "probed" / f"checkpoint-{step - 1}")})})
    policy = load_phase(config, SINGLE, WarningLog())
    estimates = estimate_phase(config, policy, E, U, WarningLog())
    res, bars = estimates.delta_h1, estimates.error_bars
    assert res.delta_h1 == pytest.approx(row["delta_h1"], rel=1e-6, abs=1e-12)
    assert bars.se["total"] == pytest.approx(row["se"], rel=1e-5)
    t = policy.trainable
    delta = displacement_to(t.model, str(base / "probed" / f"checkpoint-{step}"), list(t.names), list(t.params))
    assert named_dot(res.X_hat, delta) == pytest.approx(row["displacement"], rel=1e-6, abs=1e-12)
    truth = measure_delta_h(policy.engine, E, delta, [1.0], normalize=config.estimator.normalize, base=res.scores,
                            tf_batch_size=res.scores_tf_batch)
    assert truth.rows[0]["deltaH_true"] == pytest.approx(row["realised"], rel=1e-6, abs=1e-12)
    # the residual against the realised change and the displacement recomputed here from the checkpoints on disk
    # (the callback takes its first-order term from the jvp pieces along Δθ, this reference from X̂·Δθ, backward)
    offline_displacement = named_dot(res.X_hat, delta)
    assert row["first_order_residual"] == pytest.approx(truth.rows[0]["deltaH_true"] - offline_displacement,
                                                        abs=1e-4 * abs(offline_displacement))


@pytest.mark.parametrize("options, message", [
    ({"every": 0}, "every must be an integer >= 1"),
    ({"B_E": 2}, "B_E must be >= 4"),
    ({"B_U": 1}, "B_U must be >= 2"),
])
def test_bad_options_are_one_line_before_training(options, message, tmp_path, tiny_model_dir):
    trainer = tiny_grpo_trainer(tmp_path, steps=1, model_dir=tiny_model_dir)
    with pytest.raises(ConfigError, match=message):
        EntropyProbeCallback(trainer, **{"every": 1, **options})


def test_unsupported_trainers_are_refused(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="supports trl.GRPOTrainer only, got object"):
        EntropyProbeCallback(object(), every=1)
    trainer = tiny_grpo_trainer(tmp_path, steps=1, model_dir=tiny_model_dir, top_k=5)
    with pytest.raises(ConfigError, match="GRPOConfig.top_k=5 is not supported"):
        EntropyProbeCallback(trainer, every=1)
    trainer = tiny_grpo_trainer(tmp_path, steps=1, model_dir=tiny_model_dir, importance_sampling_level="sequence")
    with pytest.raises(ConfigError, match="GRPOConfig.importance_sampling_level='sequence' is not supported"):
        EntropyProbeCallback(trainer, every=1)


@pytest.mark.parametrize("switch", [True, False])
def test_the_callback_takes_the_trainers_kl_bias_correction(switch, tmp_path, tiny_model_dir):
    """The live GRPOConfig's use_bias_correction_kl (and β) become the probe's objective."""
    trainer = tiny_grpo_trainer(tmp_path, steps=1, model_dir=tiny_model_dir, beta=0.04, use_bias_correction_kl=switch)
    options = EntropyProbeCallback(trainer, every=1).config.objective_options()
    assert options.kl_coef == 0.04 and options.use_bias_correction_kl is switch and options.weights_kl is switch
