"""examples/path_refinement.py: the straight path between two checkpoints, written as checkpoints to sweep."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "path_refinement.py"


def _script():
    spec = importlib.util.spec_from_file_location("path_refinement", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checkpoint(where: Path, step: int, weights: dict[str, torch.Tensor]) -> None:
    where.mkdir(parents=True)
    save_file(weights, where / "adapter_model.safetensors")
    (where / "trainer_state.json").write_text(json.dumps({"global_step": step, "train_batch_size": 4}))
    (where / "optimizer.pt").write_bytes(b"state")
    (where / "training_args.bin").write_bytes(b"never read")


def test_path_points_are_on_the_line_and_end_at_the_next_checkpoint(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = {"lora_A": torch.randn(3, 5, generator=g), "lora_B": torch.randn(5, 3, generator=g)}
    b = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in a.items()}
    _checkpoint(tmp_path / "run" / "checkpoint-7", 7, a)
    _checkpoint(tmp_path / "run" / "checkpoint-8", 8, b)
    path = _script().write_path(tmp_path / "run", 7, 4, tmp_path / "path")
    names = sorted(p.name for p in path.iterdir())
    assert names == [f"checkpoint-{j}" for j in range(1, 6)]
    for j in range(5):
        here = path / f"checkpoint-{j + 1}"
        weights = load_file(here / "adapter_model.safetensors")
        for k, start in a.items():
            torch.testing.assert_close(weights[k], start + j / 4 * (b[k] - start), rtol=0, atol=1e-6)
        assert json.loads((here / "trainer_state.json").read_text())["global_step"] == j + 1
        assert (here / "optimizer.pt").is_file() and not (here / "training_args.bin").exists()
    last = load_file(path / "checkpoint-5" / "adapter_model.safetensors")
    assert all(torch.equal(last[k], b[k]) for k in b)  # the end point bit for bit


def test_missing_next_checkpoint_is_one_line(tmp_path):
    _checkpoint(tmp_path / "run" / "checkpoint-3", 3, {"w": torch.zeros(2)})
    with pytest.raises(SystemExit, match="checkpoint-4"):
        _script().write_path(tmp_path / "run", 3, 2, tmp_path / "path")
