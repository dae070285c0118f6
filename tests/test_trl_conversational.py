"""A real TRL GRPOTrainer run on a conversational data set, probed on its checkpoint-1 with the same data set
and reward functions: the probe's prompts are TRL's, token for token, and its rewards are TRL's reward
computation of the same completions."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
import yaml

from entropy_experiments.testing.conversational import (
    REWARD_FUNCTIONS,
    REWARD_SPECS,
    REWARD_WEIGHTS,
    conversational_dataset,
)
from tests.run_helpers import logging_restored

pytestmark = pytest.mark.e2e  # runs whole probes (scripts/test.sh -m "not e2e" skips them)

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    from entropy_experiments.testing.trl_run import train_tiny_grpo

    folder = tmp_path_factory.mktemp("trl_conv")
    dataset = conversational_dataset(8)
    dataset.save_to_disk(str(folder / "data"))
    trainer, checkpoint = train_tiny_grpo(folder / "out", steps=1, model_dir=tiny_model_dir, train_dataset=dataset,
                                          reward_funcs=REWARD_FUNCTIONS, reward_weights=REWARD_WEIGHTS)
    return folder, trainer, checkpoint


def _probe(folder, checkpoint, tiny_model_dir) -> tuple[int, str]:
    from entropy_experiments import cli

    config = {"seed": 5, "learning_rate": 1.0e-3, "checkpoint": {"checkpoint_path": str(checkpoint), "base_model": str(tiny_model_dir),
                                        "device_map": "cpu"},
              "batch_config": {"dataset_name": "hf", "dataset_path": str(folder / "data"), "B_E": 4, "B_U": 2,
                               "G": 2},
              "generation": {"max_new_tokens": 8, "gen_batch_size": 8, "tf_batch_size": 8},
              "objective": {"trainer": "trl", "max_completion_length": 8, "trainer_batch_completions": 4},
              "reward": {"functions": REWARD_SPECS, "weights": REWARD_WEIGHTS},
              "importance": {"enabled": False}, "second_order": {"enabled": False},
              "predictors": {"enabled": False}, "output": {"plot": False}}
    path = folder / "probe.yaml"
    path.write_text(yaml.safe_dump(config))
    err = io.StringIO()
    with logging_restored(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main(["run", "--config", str(path), "--out", str(folder / "run")])
    return code, err.getvalue()


def test_probe_on_checkpoint_1_uses_trls_prompts_and_rewards(trained, tiny_model_dir):
    folder, trainer, checkpoint = trained
    checkpoint_1 = checkpoint.parent / "checkpoint-1"
    code, err = _probe(folder, checkpoint_1, tiny_model_dir)
    assert code == 0, err[-3000:]
    run = folder / "run"
    U = torch.load(run / "U_batch.pt", weights_only=True)
    results = json.loads((run / "results.json").read_text())
    assert results["checkpoint"]["tokenizer"]["source"] == "checkpoint"  # TRL saved it into checkpoint-1/
    dataset = conversational_dataset(8)
    rows = [dataset[i] for i in U["prompt_ids"]]
    trl_ids, _, _ = trainer._tokenize_prompts([row["prompt"] for row in rows])
    tok = trainer.processing_class
    for b, row in enumerate(rows):
        mask = U["attention_masks"][b, 0, :U["prompt_lens"][b]].bool()
        probe_ids = U["sequences"][b, 0, :U["prompt_lens"][b]][mask].tolist()
        assert probe_ids == list(trl_ids[b])
        assert tok.decode(probe_ids) == tok.decode(trl_ids[b]) == U["prompts"][b]
    # TRL's own reward computation (the trainer's _calculate_rewards and weighted nansum) of the probe's completions
    G = U["num_responses_per_prompt"]
    inputs = [rows[b] for b in range(len(rows)) for _ in range(G)]
    completions = [[{"role": "assistant", "content": t}] for row in U["responses_text"] for t in row]
    ids = [U["sequences"][b, g, U["prompt_lens"][b]:U["prompt_lens"][b] + U["gen_lens"][b][g]].tolist()
           for b in range(len(rows)) for g in range(G)]
    per_func = trainer._calculate_rewards(inputs, [x["prompt"] for x in inputs], completions, ids)
    summed = (per_func * trainer.reward_weights.unsqueeze(0)).nansum(dim=1)
    assert [r for row in U["rewards"] for r in row] == pytest.approx(summed.tolist(), rel=1e-6, abs=1e-7)
    assert list(U["rewards_per_function"]) == REWARD_SPECS and U["reward_weights"] == dict(zip(REWARD_SPECS,
                                                                                               REWARD_WEIGHTS))
    assert results["checkpoint"]["trainer_batch"]["U_completions"] == 4
