"""examples/entropy_autopilot.py: a 3-step smoke of its arms in the enumerable world, whose yardstick is exact
(the enumerated entropy against torch's Categorical on the untouched base model, one prompt, one-token
responses summed by hand), its tables (the ratios recomputed from the runs) and its one-line refusals."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "entropy_autopilot.py"
pytestmark = [pytest.mark.xdist_group("trl_callback"), pytest.mark.e2e]


def _example():
    spec = importlib.util.spec_from_file_location("entropy_autopilot_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_arms_run_and_summarise(tmp_path, capsys, monkeypatch):
    pytest.importorskip("trl")
    import json

    ex = _example()
    runs = tmp_path / "runs.json"
    assert ex.main(["--world", "toy", "--steps", "3", "--seeds", "0", "--arms", "none,trl_tuned,autopilot",
                    "--json", str(runs)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in lines[:4]] == ["arm", "none", "trl_tuned", "autopilot"]
    # the ratios, recomputed here from the runs' exact paths
    rms, gain = {}, {}
    for run in json.loads(runs.read_text())["runs"]:
        H, R = run["H"], run["R"]
        rms[run["arm"]] = math.sqrt(sum((h - H[0]) ** 2 for h in H[1:]) / (len(H) - 1))
        gain[run["arm"]] = R[-1] - R[0]
    row = next(line for line in lines if line.startswith("| 2 | autopilot |"))
    assert [c.strip() for c in row.split("|")[3:6]] == [f"{rms['autopilot'] / rms['none']:.2f}",
                                                        f"{rms['autopilot'] / rms['trl_tuned']:.2f}",
                                                        f"{gain['autopilot'] / gain['none']:.2f}"]
    assert ex.main(["--world", "toy", "--steps", "1", "--seeds", "0", "--arms", "pid"]) == 2
    assert "unknown arm 'pid'" in capsys.readouterr().err
    # the oracle needs the exact gradients of the enumerable world: refused on the embedded model, before any run
    monkeypatch.setattr(ex, "run_all", lambda *args: pytest.fail("a run started"))
    assert ex.main(["--world", "embedded", "--steps", "1", "--seeds", "0", "--arms", "none,oracle"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown arm 'oracle' in the embedded world" in err
    # so is a world seed for the one embedded model, and a seed that is not one
    assert ex.main(["--world", "embedded", "--world-seed", "3", "--seeds", "0", "--arms", "none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--world-seed" in err
    with pytest.raises(SystemExit) as exit_:
        ex.main(["--world", "toy", "--world-seed", "0,x", "--arms", "none"])
    assert exit_.value.code == 2 and "not a seed or a comma-separated list of seeds: '0,x'" in capsys.readouterr().err


def test_the_oracle_arm_holds_the_exact_entropy(tmp_path, capsys):
    pytest.importorskip("trl")
    import json

    out = tmp_path / "runs.json"
    assert _example().main(["--world", "toy", "--steps", "2", "--seeds", "0", "--arms", "none,oracle",
                            "--json", str(out)]) == 0
    free, held = json.loads(out.read_text())["runs"]
    assert held["arm"] == "oracle" and free["H"][0] == held["H"][0]
    assert all(abs(h - held["H"][0]) < 1e-4 for h in held["H"][1:]) and abs(free["H"][-1] - free["H"][0]) > 0.05


def test_the_yardstick_is_the_exact_entropy(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from entropy_experiments.testing import enumerable_world as world

    model_dir = world.world_model(tmp_path / "toy")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    H, R = world.exact_entropy_and_reward(model, tokenizer)
    # by hand, the other way round: per prompt, the distribution over whole responses and their entropies
    eos, a = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("a")
    num = den = reward = 0.0
    with torch.no_grad():
        for prompt in world.PROMPTS:
            for response in world.responses(len(tokenizer), eos):
                ids = tokenizer(prompt).input_ids
                q, h = 1.0, 0.0
                for token in response:
                    dist = torch.distributions.Categorical(logits=model(input_ids=torch.tensor([ids])).logits[0, -1])
                    q *= float(dist.probs[token])
                    h += float(dist.entropy())
                    ids = ids + [token]
                num, den, reward = num + q * h, den + q * len(response), reward + q * (a in response)
    assert H == pytest.approx(num / den, rel=1e-9) and R == pytest.approx(reward / len(world.PROMPTS), rel=1e-9)
    assert 1.0 < H < math.log(4)


def test_another_world_is_another_model(tmp_path):
    """--world-seed builds the toy model from each seed asked for: each run's exact H₀ is its world's."""
    pytest.importorskip("trl")
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from entropy_experiments.testing import enumerable_world as world

    def exact_H0(seed: int) -> float:
        model_dir = world.world_model(tmp_path / f"world{seed}", seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
        return world.exact_entropy_and_reward(model, AutoTokenizer.from_pretrained(model_dir))[0]

    out = tmp_path / "runs.json"
    assert _example().main(["--world", "toy", "--world-seed", f"0,{world.WORLD_SEED}", "--steps", "1", "--seeds", "0",
                            "--arms", "none", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [run["world"] for run in runs] == [0, world.WORLD_SEED]
    for run in runs:
        assert run["H"][0] == pytest.approx(exact_H0(run["world"]), rel=1e-6)
    assert abs(exact_H0(0) - exact_H0(world.WORLD_SEED)) > 0.1
