"""No lost work: a real `entropy-probe run` subprocess is killed (SIGTERM, SIGINT, SIGKILL) at several
points, then `--resume` finishes it with results identical to an uninterrupted run of the same seed.

The run goes through the test shim tests/hooked_cli.py, which holds it at a named point (env
ENTROPY_PROBE_TEST_HOLD=point[:n]); the test waits for its marker file and sends the signal. E and U
are generated 2 rows per chunk (2 chunks each), so a kill during sampling leaves saved chunks. With the bf16
sampler (row-keyed draws, each chunk saved with its sampler log q) a kill during sampling resumes to the same
E and U, sampler log-probs included.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from entropy_experiments import cli
from tests.hooked_cli import HOLD_ENV, HOLD_FILE_ENV, hooked_command
from tests.run_helpers import make_run_setup, numbers, results, subprocess_env

pytestmark = pytest.mark.e2e  # runs whole probes (scripts/test.sh -m "not e2e" skips them)

# (signal, hold point, what must be on disk when it is killed)
CASES = [
    (signal.SIGTERM, "chunk_saved:1", "first E chunk saved"),
    (signal.SIGKILL, "chunk_saved:3", "E batch generated, first U chunk saved"),
    (signal.SIGINT, "batches_saved", "E_batch.pt and U_batch.pt saved"),
    (signal.SIGKILL, "results_written", "results.json written, plot and status not yet"),
]


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory) -> Path:
    path, _ = make_run_setup(tmp_path_factory.mktemp("kill"), tiny_model_dir,
                             generation={"gen_batch_size": 2}, output={"plot": True})
    return path


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory) -> dict:
    """An uninterrupted run of the same config and seed (in process)."""
    out = tmp_path_factory.mktemp("kill_ref") / "run"
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the subprocesses (OMP_NUM_THREADS=1)
    try:
        assert cli.main(["run", "--config", str(setup), "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(n)
    return results(out)


def _kill_at(config: Path, out: Path, point: str, sig: signal.Signals, tmp: Path) -> subprocess.CompletedProcess:
    marker = tmp / "held"
    env = subprocess_env(**{HOLD_ENV: point, HOLD_FILE_ENV: str(marker)})
    proc = subprocess.Popen(hooked_command("run", "--config", str(config), "--out", str(out)), cwd=tmp, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            stdout, stderr = proc.communicate()
            pytest.fail(f"run never reached {point} (rc {proc.returncode}):\n{stderr[-3000:]}")
        time.sleep(0.05)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _assert_nothing_half_written(out: Path) -> None:
    """Every file in place is whole: JSON parses, batches load; temp files are never the real names."""
    for name in ("results.json", "run_meta.json"):
        if (out / name).exists():
            json.loads((out / name).read_text())
    for name in ("E_batch.pt", "U_batch.pt"):
        if (out / name).exists():
            assert isinstance(torch.load(out / name, weights_only=True), dict)
    for path in (out / "partial").glob("*.pt") if (out / "partial").is_dir() else []:
        torch.load(path, weights_only=True)


@pytest.mark.parametrize("sig, point, state", CASES, ids=[f"{c[0].name}-{c[1]}" for c in CASES])
def test_kill_then_resume_gives_identical_numbers(sig, point, state, setup, reference, tmp_path, capsys):
    out = tmp_path / "run"
    killed = _kill_at(setup, out, point, sig, tmp_path)
    meta = json.loads((out / "run_meta.json").read_text())
    if sig == signal.SIGKILL:
        assert killed.returncode == -signal.SIGKILL
        assert meta["status"] == "running"  # a hard kill cannot mark anything; --resume still works
    else:
        assert killed.returncode == 128 + sig, killed.stderr[-2000:]
        assert "Traceback" not in killed.stderr
        assert killed.stderr.strip().splitlines()[-1] == \
            f"interrupted by {sig.name}; finish a run with --resume RUN_DIR"
        assert meta["status"] == "failed"
        assert f"finish it with: entropy-probe run --resume {out}" in (out / "probe.log").read_text()
    _assert_nothing_half_written(out)
    if point.startswith("chunk_saved"):
        assert not (out / "E_batch.pt").exists() or not (out / "U_batch.pt").exists()
        assert list((out / "partial").glob("gen_*.pt")), "completed chunks must be on disk"

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main(["run", "--resume", str(out)]) == 0
    finally:
        torch.set_num_threads(n)
    capsys.readouterr()
    resumed = results(out)
    assert numbers(resumed) == numbers(reference)
    assert json.loads((out / "run_meta.json").read_text())["status"] == "complete"
    assert not list((out / "partial").glob("gen_*.pt")) if (out / "partial").is_dir() else True
    log = (out / "probe.log").read_text()
    if point.startswith("chunk_saved"):
        assert "reusing" in log and "saved chunk(s)" in log
    else:
        assert "resuming" in log and "saved E and U batches" in log


# The fast sampler: bf16 with 2 rows per call (row-keyed draws, each chunk saved with its sampler log q).
@pytest.fixture(scope="module")
def bf16_setup(tiny_model_dir, tmp_path_factory) -> Path:
    path, _ = make_run_setup(tmp_path_factory.mktemp("kill_bf16"), tiny_model_dir,
                             generation={"gen_batch_size": 2, "sampler_dtype": "bf16"}, output={"plot": False})
    return path


def test_kill_during_bf16_sampling_then_resume_gives_the_same_batches(bf16_setup, tmp_path, capsys):
    ref = tmp_path / "ref"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main(["run", "--config", str(bf16_setup), "--out", str(ref)]) == 0
        out = tmp_path / "run"
        killed = _kill_at(bf16_setup, out, "chunk_saved:1", signal.SIGTERM, tmp_path)
        assert killed.returncode == 128 + signal.SIGTERM, killed.stderr[-2000:]
        assert list((out / "partial").glob("gen_*.pt")) and not (out / "E_batch.pt").exists()
        assert cli.main(["run", "--resume", str(out)]) == 0
    finally:
        torch.set_num_threads(n)
    capsys.readouterr()
    assert "reusing 1 saved chunk(s)" in (out / "probe.log").read_text()
    for name in ("E_batch.pt", "U_batch.pt"):
        a, b = (torch.load(d / name, weights_only=True) for d in (ref, out))
        assert torch.equal(a["sequences"], b["sequences"]) and torch.equal(a["sampler_logqs"], b["sampler_logqs"])
    resumed, reference = results(out), results(ref)
    assert resumed["sampler"]["dtype"] == "bf16" and resumed["sampler"]["correction"] is not None
    assert numbers(resumed) == numbers(reference)
