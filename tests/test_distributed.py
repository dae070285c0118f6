"""The probe under torch.distributed: 2 CPU ranks with gloo against one process.

- helpers: rank slices, re-padding concatenation of batches, one-process no-ops;
- fresh sampling on 2 ranks (`torchrun --nproc_per_node=2 -m entropy_experiments.cli run`): exactly
  B_E E and B_U × G U sequences, prompts exactly as in the index plan, no duplicates or gaps;
- parity: from the same saved batches (--resume), 2 ranks give δH₁, SE_E, SE_U and every ΔH(η) of the
  one-process run to 1e-6 relative;
- a rank killed mid-run: the survivor exits non-zero with one error line naming the timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from entropy_experiments import cli
from entropy_experiments.data.batch import Batch
from entropy_experiments.probe import parallel as D
from tests.hooked_cli import FAULT_ENV, hooked_command
from tests.probe_helpers import SHORT_PROMPTS, write_prompts
from tests.run_helpers import base_config, logging_restored

# Costly module fixtures: one worker runs this whole file (scripts/test.sh distributes by xdist_group).
pytestmark = pytest.mark.xdist_group("test_distributed")

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ helpers

def test_rank_range_covers_everything_once():
    for n in range(12):
        for world in (1, 2, 3, 5):
            ranges = [D.rank_range(n, r, world) for r in range(world)]
            assert [i for rg in ranges for i in rg] == list(range(n))
            sizes = [len(rg) for rg in ranges]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_prompt_slice_keeps_whole_chunks():
    ctx = [D.DistContext(rank=r, world_size=2) for r in range(2)]
    assert ctx[0].prompt_slice(7, chunk=2) == [0, 1, 2, 3]
    assert ctx[1].prompt_slice(7, chunk=2) == [4, 5, 6]
    assert D.SINGLE.prompt_slice(7, chunk=3) == list(range(7))


def test_single_process_reductions_are_noops():
    x = {"a": torch.randn(3, 2), "b": torch.randn(4)}
    assert D.SINGLE.all_reduce_named(x, "t") is x
    assert D.SINGLE.broadcast_object([1, 2], "t") == [1, 2]
    assert D.SINGLE.gather_rows({1: "b", 0: "a"}, 2, "t") == ["a", "b"]
    with pytest.raises(RuntimeError, match="provided by no rank"):
        D.SINGLE.gather_rows({0: "a"}, 2, "t")
    assert D.rank_seed(7, 0) == 7 and D.rank_seed(7, 1) != 7


def test_bad_launch_environments_are_one_line_errors(monkeypatch):
    """A garbled WORLD_SIZE or nccl without CUDA is refused before any process group is made."""
    from types import SimpleNamespace

    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(D.DistributedError, match=r"^distributed: WORLD_SIZE must be a positive integer, got 'two'$"):
        D.init_from_env()
    monkeypatch.setenv("WORLD_SIZE", "0")
    with pytest.raises(D.DistributedError, match="got '0'"):
        D.launched_world_size()
    if not torch.cuda.is_available():
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(D.DistributedError, match=r"^distributed\.backend: nccl needs CUDA"):
            D.init_from_env(SimpleNamespace(backend="nccl", timeout_s=5))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert D.init_from_env(SimpleNamespace(backend="nccl", timeout_s=5)).world_size == 1


def _part(prompt_lens: list[int], gen: list[list[int]], first_id: int) -> Batch:
    B, G = len(gen), len(gen[0])
    Lp, T = max(prompt_lens), max(max(g) for g in gen)
    seqs = torch.full((B, G, Lp + T), 99, dtype=torch.long)
    masks = torch.zeros((B, G, Lp + T), dtype=torch.long)
    for b in range(B):
        for g in range(G):
            seqs[b, g, Lp - prompt_lens[b]:Lp] = torch.arange(prompt_lens[b]) + 10 * b
            seqs[b, g, Lp:Lp + gen[b][g]] = torch.arange(gen[b][g]) + 50 + g
            masks[b, g, Lp - prompt_lens[b]:Lp + gen[b][g]] = 1
    batch = {"sequences": seqs, "attention_masks": masks, "prompt_lens": [Lp] * B, "gen_lens": gen,
             "advantages": torch.zeros(B, G), "rewards": [[0.0] * G for _ in range(B)],
             "max_lengths": [max(g) for g in gen], "prompt_ids": list(range(first_id, first_id + B)),
             "num_prompts": B, "num_responses_per_prompt": G}
    return Batch.from_dict(batch)


def _tokens(batch: Batch, b: int, g: int) -> list[int]:
    return batch.sequences[b, g][batch.attention_masks[b, g].bool()].tolist()


def test_concat_batches_repads_and_keeps_every_token():
    p0 = _part([3, 2], [[2, 4], [1, 1]], 0)
    p1 = _part([5], [[6, 2]], 2)
    out = Batch.concat([p0, None, p1], pad_id=99)
    assert out.num_prompts == 3 and out.prompt_ids == [0, 1, 2]
    assert out.prompt_lens == [5, 5, 5] and out.sequences.shape == (3, 2, 11)
    for b_out, (part, b) in enumerate([(p0, 0), (p0, 1), (p1, 0)]):
        for g in range(2):
            assert _tokens(out, b_out, g) == _tokens(part, b, g)
            # the response still starts right after the common padded prompt length
            assert out.sequences[b_out, g, 5].item() == 50 + g


# ------------------------------------------------------------------------------------------ 2 ranks

def _env() -> dict:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", FAULT_ENV):
        env.pop(key, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    # --standalone: a c10d rendezvous on localhost:0 — the agent's TCPStore binds a port chosen by the OS
    # and the ranks share that store, so no free port is picked first and raced for by another process.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "entropy_experiments.cli", *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          check=False)


def _results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def dist_config(tiny_model_dir, tmp_path_factory) -> tuple[Path, dict]:
    """A probe config over a 1-step make-checkpoint of the tiny model; microbatches of 2 sequences so
    that each rank runs several of them."""
    folder = tmp_path_factory.mktemp("dist")
    data = write_prompts(folder / "prompts.jsonl", SHORT_PROMPTS)
    config = base_config(tiny_model_dir, data, seed=5, batch_config={"B_E": 7, "B_U": 4},
                         generation={"max_new_tokens": 6, "tf_batch_size": 2}, estimator={"microbatch_size": 2},
                         distributed={"backend": "auto", "timeout_s": 30})
    (folder / "mk.yaml").write_text(yaml.safe_dump(config))
    with logging_restored():
        assert cli.main(["make-checkpoint", "--out", str(folder / "ckpt"), "--steps", "1",
                         "--config", str(folder / "mk.yaml")]) == 0
    config["checkpoint"]["checkpoint_path"] = str(folder / "ckpt")
    path = folder / "probe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config


@pytest.fixture(scope="module")
def fresh_two_rank_run(dist_config, tmp_path_factory) -> Path:
    path, _ = dist_config
    out = tmp_path_factory.mktemp("dist_runs") / "fresh2"
    proc = _torchrun(["run", "--config", str(path), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.e2e
def test_fresh_sampling_on_two_ranks_follows_the_plan(fresh_two_rank_run, dist_config):
    from entropy_experiments.data.datasets import load_examples
    from entropy_experiments.data.plan import draw_index_plan

    _, config = dist_config
    bc = config["batch_config"]
    E = torch.load(fresh_two_rank_run / "E_batch.pt", weights_only=True)
    U = torch.load(fresh_two_rank_run / "U_batch.pt", weights_only=True)
    res = _results(fresh_two_rank_run)
    assert res["environment"]["distributed"] == {"world_size": 2, "backend": "gloo"}

    examples = load_examples("jsonl", "train", dataset_path=bc["dataset_path"])
    plan = draw_index_plan(len(examples), B_E=bc["B_E"], B_U=bc["B_U"], G=bc["G"], E_sampling_mode="replacement",
                           seed=config["seed"])
    ids = [int(ex.meta["global_prompt_id"]) for ex in examples]
    # exactly B_E E sequences (G = 1) and B_U × G U sequences, prompts in plan order
    assert E["sequences"].shape[:2] == (bc["B_E"], 1) and U["sequences"].shape[:2] == (bc["B_U"], bc["G"])
    assert E["prompt_ids"] == [ids[i] for i in plan.E_prompt_indices]
    assert U["prompt_ids"] == [ids[i] for i in plan.U_prompt_indices]
    assert len(set(U["prompt_ids"])) == bc["B_U"]
    assert E["prompts"] == [examples[i].question for i in plan.E_prompt_indices]
    assert res["counts"]["B_E"] == bc["B_E"] and res["counts"]["B_U"] == bc["B_U"]
    # every sequence is a real response (no empty slot between the two ranks' slices)
    assert min(min(g) for g in E["gen_lens"]) >= 1 and min(min(g) for g in U["gen_lens"]) >= 1
    # per-sequence rows follow the same global order
    rows = [json.loads(line) for line in (fresh_two_rank_run / "per_sequence.jsonl").read_text().splitlines()]
    assert [r["prompt_id"] for r in rows] == E["prompt_ids"]


def _numbers(res: dict) -> dict:
    out = {"deltaH1": res["deltaH1"], "SE_E": res["se"]["E"], "SE_U": res["se"]["U"], "SE_total": res["se"]["total"]}
    for t in res["true"]:
        out[f"deltaH({t['eta']:g})"] = t["deltaH_true"]
        out[f"se({t['eta']:g})"] = t["se"]
    return out


def _assert_parity(a: dict, b: dict, rel: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert b[key] == pytest.approx(value, rel=rel, abs=0), (key, value, b[key])


@pytest.mark.e2e
def test_two_ranks_match_one_process_from_the_same_batches(fresh_two_rank_run, tmp_path):
    one = Path(shutil.copytree(fresh_two_rank_run, tmp_path / "one"))
    two = Path(shutil.copytree(fresh_two_rank_run, tmp_path / "two"))
    for d in (one, two):
        (d / "results.json").unlink()
    # The one-process run, in this process (no torchrun environment here), with one thread like each rank:
    # then every microbatch is computed bit for bit alike and only the order of the float64 sums differs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with logging_restored():
            assert cli.main(["run", "--resume", str(one)]) == 0
    finally:
        torch.set_num_threads(threads)
    proc2 = _torchrun(["run", "--resume", str(two)])
    assert proc2.returncode == 0, proc2.stderr[-4000:]
    r1, r2 = _results(one), _results(two)
    assert r1["environment"]["distributed"]["world_size"] == 1
    assert r2["environment"]["distributed"]["world_size"] == 2
    _assert_parity(_numbers(r1), _numbers(r2))
    # and the fresh 2-rank run computed on exactly these batches
    _assert_parity(_numbers(r1), _numbers(_results(fresh_two_rank_run)))
    # only rank 0 wrote: one log, the batches untouched
    assert torch.equal(torch.load(one / "E_batch.pt", weights_only=True)["sequences"],
                       torch.load(two / "E_batch.pt", weights_only=True)["sequences"])


def _two_ranks_one_killed(path: Path, out: Path) -> tuple[list[int], str]:
    """Launch rank 0 and rank 1 by hand (rank 1 kills itself after sampling): (exit codes, rank 0 stderr)."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = _env()
        env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), FAULT_ENV: "sampled:1:kill"})
        procs.append(subprocess.Popen(
            hooked_command("run", "--config", str(path), "--out", str(out), "--set", "distributed.timeout_s=10"),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO))
    try:
        _, err0 = procs[0].communicate(timeout=180)
        procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], err0


def _address_in_use(stderr: str) -> bool:
    text = stderr.lower()
    return "address already in use" in text or "eaddrinuse" in text or "errno: 98" in text


@pytest.mark.e2e
def test_a_killed_rank_makes_the_other_exit_with_the_timeout_message(dist_config, tmp_path):
    path, _ = dist_config
    # The port is picked free and then bound by rank 0: another process may take it in between. Such a
    # lost race (and only that) is retried on a new port.
    for attempt in range(3):
        out = tmp_path / f"killed{attempt}"
        codes, err0 = _two_ranks_one_killed(path, out)
        if not _address_in_use(err0):
            break
    assert codes[1] != 0  # killed itself
    assert codes[0] != 0
    errors = [line for line in err0.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err0[-3000:]
    assert "distributed.timeout_s=10" in errors[0] and "rank" in errors[0]
    assert "Traceback" not in err0
    assert json.loads((out / "run_meta.json").read_text())["status"] == "failed"
