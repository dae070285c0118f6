"""The callbacks in a real TRL GRPOTrainer under 2 CPU processes (torchrun, gloo; DDP) on the tiny model.

- Rows: every number of the 2-rank run (each rank drew and scored its share of E) equals the one-process
  computation on the same union E (drawn again in one process with each rank's seed stream; same live
  parameters, gradients and optimizer), and is the same on both ranks; only rank 0 writes.
- The steps: bit-identical with and without EntropyProbeCallback (either mode), on both ranks.
- The autopilot: the same multipliers on both ranks; a decision one ulp off on one rank stops both ranks with
  one error naming the value.
- The launch modes that shard the policy or its optimizer (DeepSpeed ZeRO, FSDP) are refused in one line.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from entropy_experiments.errors import ConfigError
from entropy_experiments.integrations import ranks
from entropy_experiments.integrations.autopilot import EntropyAutopilot
from entropy_experiments.integrations.trl_callback import LOG_FILE, EntropyProbeCallback
from entropy_experiments.probe.parallel import SINGLE
from entropy_experiments.testing.trl_run import tiny_grpo_trainer
from tests.test_distributed import REPO, _env

# 2-process runs: one worker runs this file (scripts/test.sh distributes by xdist_group)
pytestmark = pytest.mark.xdist_group("trl_ddp")
SCENARIOS = ("plain", "probed", "probe_U", "autopilot", "diverge")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("trl_ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "entropy_experiments.testing.trl_ddp_run", "--out", str(out), "--model-dir", str(tiny_model_dir),
           "--scenarios", *SCENARIOS]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=400, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _saved(out: Path, scenario: str) -> list[dict]:
    return [torch.load(out / scenario / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and k not in ("seconds", "num_iterations")}  # timing; the callback's own record of the trainer


@pytest.mark.e2e
def test_rows_equal_one_process_on_the_same_union_E(ddp):
    ranks_saved = _saved(ddp, "probed")
    for saved in ranks_saved:
        assert saved["world_size"] == 2 and len(saved["rows"]) == 2 and len(saved["reference"]) == 2
        for draw in saved["draws"]:  # the union of the ranks' shares is one process's draw with their seeds
            for key in ("sequences", "attention_masks"):
                assert torch.equal(draw["probe"][key], draw["reference"][key])
            assert draw["probe"]["num_prompts"] == 6
        for row, one in zip(saved["rows"], saved["reference"], strict=True):
            two_ranks, one_process = _numbers(row), _numbers(one)
            assert two_ranks.keys() == one_process.keys() and "realised" in two_ranks and two_ranks["n_E"] == 6
            for key, value in one_process.items():
                assert two_ranks[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert [_numbers(r) for r in ranks_saved[0]["rows"]] == [_numbers(r) for r in ranks_saved[1]["rows"]]
    written = [json.loads(x) for x in (ddp / "probed" / LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in written] == [1, 2]  # one row per step: rank 0 alone wrote


@pytest.mark.e2e
@pytest.mark.parametrize("scenario", ["probed", "probe_U"])
def test_steps_are_bit_identical_with_and_without_the_callback(ddp, scenario):
    plain, probed = _saved(ddp, "plain"), _saved(ddp, scenario)
    reference = plain[0]["params"]
    for saved in plain + probed:
        assert saved["params"].keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(saved["params"][name], value), name
    if scenario == "probe_U":
        rows = [[_numbers(r) for r in saved["rows"]] for saved in probed]
        assert rows[0] == rows[1] and len(rows[0]) == 2 and all(math.isfinite(r["se_U"]) for r in rows[0])


@pytest.mark.e2e
def test_the_autopilot_takes_one_decision_on_both_ranks(ddp):
    saved = _saved(ddp, "autopilot")
    decisions = [[(r["lr_multiplier"], r["entropy_term"]) for r in s["rows"]] for s in saved]
    assert decisions[0] == decisions[1] and len(decisions[0]) == 2
    assert any(d != (1.0, 0.0) for d in decisions[0])  # the law acted: the check saw a real decision
    for name, value in saved[0]["params"].items():
        assert torch.equal(saved[1]["params"][name], value), name


@pytest.mark.e2e
def test_a_decision_off_by_one_ulp_on_one_rank_stops_both(ddp):
    for saved in _saved(ddp, "diverge"):
        assert "params" not in saved  # training stopped at the first decision
        assert saved["error"].startswith("EntropyAutopilot: step 1: the ranks' decisions differ (lr_multiplier: "
                                         "rank 0 ")
        assert "would make the replicas diverge" in saved["error"] and "\n" not in saved["error"]


def test_the_checksum_sees_one_ulp_and_tensor_bits():
    one = {"lr_multiplier": 0.5, "gradients": torch.tensor([1.0, 2.0])}
    assert ranks.digest(one) == ranks.digest(dict(reversed(list(one.items()))))
    assert ranks.digest(one) != ranks.digest({**one, "lr_multiplier": math.nextafter(0.5, 1.0)})
    one_ulp = torch.nextafter(one["gradients"], torch.full((2,), 3.0))  # float32 ulps
    assert ranks.digest(one) != ranks.digest({**one, "gradients": one_ulp})
    assert ranks.digest(one) != ranks.digest({**one, "gradients": torch.tensor([1.0, 2.0], dtype=torch.float64)})
    ranks.agree(SINGLE, one, "one process")  # nothing to compare with: no collective, no error


@pytest.mark.parametrize("attribute, message", [
    ("is_deepspeed_enabled", r"^EntropyProbeCallback: DeepSpeed \(ZeRO\) is not supported — .*one process per device"),
    ("is_fsdp_enabled", r"^EntropyProbeCallback: FSDP \(TrainingArguments.fsdp\) is not supported — .*DDP"),
])
def test_sharded_launch_modes_are_refused_in_one_line(attribute, message, tmp_path, tiny_model_dir):
    trainer = tiny_grpo_trainer(tmp_path, steps=1, model_dir=tiny_model_dir)
    setattr(trainer, attribute, True)  # what transformers' Trainer sets from accelerate's plugin
    for make in (lambda: EntropyProbeCallback(trainer, every=1),
                 lambda: EntropyProbeCallback(trainer, every=1, predict="trainer_step"),
                 lambda: EntropyAutopilot(trainer)):
        with pytest.raises(ConfigError, match=message) as caught:
            make()
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize("B_E", [5, 6, 16])
def test_every_rank_scores_a_share_of_E(B_E, tmp_path, tiny_model_dir):
    """Ranks split E's scoring by whole teacher-forcing chunks: the callback's chunks leave each rank a share."""
    from entropy_experiments.probe.parallel import DistContext

    config = EntropyProbeCallback(tiny_grpo_trainer(tmp_path, steps=1, model_dir=tiny_model_dir), every=1,
                                  predict="trainer_step", B_E=B_E).config
    for world in (2, 3):
        shares = []
        for rank in range(world):
            dist = DistContext(rank=rank, world_size=world)
            split = ranks.per_rank_config(config, dist)
            shares.append(dist.scoring_prompts(B_E, 1, split.generation.tf_batch_size))
        assert all(shares) and sorted(i for s in shares for i in s) == list(range(B_E))
    assert ranks.per_rank_config(config, SINGLE) is config
