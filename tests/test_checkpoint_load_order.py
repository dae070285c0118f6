"""Checkpoint loading reads top to bottom, and the packages depend one way.

`load_for_probe` is traced (tests/module_stays.py: the project modules the call runs through, in order) while it
loads a tiny checkpoint of this project's layout and the verl FSDP2 fixture: its steps — locate, layout, base model
+ adapter, tokenizer, optimizer state, lr — are each called from load.py once, in that order. The import checks
read the source (ast), TYPE_CHECKING imports included: data/ never imports policy/, and no import circle runs
through checkpoint/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from entropy_experiments.checkpoint.load import load_for_probe
from entropy_experiments.config import config_from_dict
from tests.module_stays import PACKAGE, StayTracer

VERL = Path(__file__).parent / "fixtures" / "framework_checkpoints" / "verl" / "global_step_1"
LOAD = "checkpoint.load"
# the module of each step, in the order the module docstring of checkpoint/load.py gives them
STEPS = ["checkpoint.layout", "checkpoint.base_model", "checkpoint.adapter", "checkpoint.tokenizer_source",
         "checkpoint.optimizer_state", "checkpoint.learning_rate"]


@pytest.fixture(scope="module")
def own_checkpoint(tmp_path_factory) -> Path:
    from entropy_experiments.checkpoint.adapter import create_lora_model
    from entropy_experiments.checkpoint.writer import save_checkpoint
    from entropy_experiments.testing.tiny_model import build_tiny_model_dir

    work = tmp_path_factory.mktemp("own")
    model = create_lora_model(str(build_tiny_model_dir(work / "base")), r=4, alpha=8, device_map="cpu")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    sum((p ** 2).sum() for p in params).backward()
    optimizer.step()
    return save_checkpoint(model, optimizer, work / "ckpt")


@pytest.fixture(scope="module")
def verl_base(tmp_path_factory) -> Path:
    from entropy_experiments.testing.tiny_model import build_tiny_model, build_tiny_tokenizer

    path = tmp_path_factory.mktemp("verl_base")
    tokenizer = build_tiny_tokenizer(vocab_size=272)
    build_tiny_model(len(tokenizer), tokenizer.eos_token_id, hidden_size=16, num_layers=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _traced_load(section: dict):
    ck = config_from_dict({"checkpoint": {**section, "device_map": "cpu"}}).checkpoint
    with StayTracer() as tracer:
        loaded = load_for_probe(ck, None)
    return tracer.result, loaded


def _called_from_load(stays) -> list[str]:
    """The modules load.py calls, in order: each stay entered by a call right after a stay in load.py."""
    pairs = zip(stays.stays, stays.stays[1:], strict=False)
    return [m for (prev, _), (m, how) in pairs if prev == LOAD and how == "call"]


def _assert_steps_once_in_order(called: list[str]) -> None:
    once = ("checkpoint.adapter", "checkpoint.tokenizer_source", "checkpoint.optimizer_state",
            "checkpoint.framework")
    for module in once:
        assert called.count(module) <= 1, (module, called)
    firsts = [m for i, m in enumerate(called) if m in STEPS and m not in called[:i]]
    assert firsts == STEPS, called


def test_own_checkpoint_loads_step_by_step(own_checkpoint):
    stays, loaded = _traced_load({"checkpoint_path": str(own_checkpoint)})
    assert stays.entries(LOAD) == 1 and stays.entries("checkpoint.tokenizer_source") == 1
    assert stays.entries("checkpoint.framework") == 0
    _assert_steps_once_in_order(_called_from_load(stays))
    assert loaded.info["tokenizer"]["source"] == "base_model" and loaded.info["layout"] == "own"  # none saved
    assert loaded.learning_rate.value == pytest.approx(1e-3)


def test_verl_checkpoint_is_consolidated_once_between_base_choice_and_adapter(verl_base):
    stays, loaded = _traced_load({"checkpoint_path": str(VERL), "base_model": str(verl_base)})
    called = _called_from_load(stays)
    assert stays.entries("checkpoint.framework") == 1 and stays.entries("checkpoint.tokenizer_source") == 1
    _assert_steps_once_in_order(called)
    assert called.index("checkpoint.base_model") < called.index("checkpoint.framework") \
        < called.index("checkpoint.adapter")
    assert loaded.info["tokenizer"]["source"] == "checkpoint"  # the actor's huggingface/, as verl saved it
    assert "lr_scheduler" in loaded.learning_rate.source


def _imports(path: Path) -> set[str]:
    """Absolute names of every entropy_experiments module `path` imports (TYPE_CHECKING blocks included)."""
    package = ["entropy_experiments", *path.relative_to(PACKAGE).parent.parts]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]) if node.level \
                else node.module or ""
            out |= {base.rstrip(".")} | {f"{base.rstrip('.')}.{a.name}" for a in node.names}
    return {name for name in out if name.startswith("entropy_experiments.")}


def test_data_never_imports_policy():
    offenders = {str(p.relative_to(PACKAGE)): sorted(n for n in _imports(p) if n.startswith("entropy_experiments.policy"))
                 for p in (PACKAGE / "data").rglob("*.py")}
    assert {p: names for p, names in offenders.items() if names} == {}


def test_no_import_circle_in_checkpoint():
    modules = {p.stem: p for p in (PACKAGE / "checkpoint").glob("*.py") if p.stem != "__init__"}
    graph = {m: {n.split(".")[2] for n in _imports(p) if n.startswith("entropy_experiments.checkpoint.")
                 and n.split(".")[2] in modules and n.split(".")[2] != m}
             for m, p in modules.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start])

    assert sorted(m for m in graph if reaches(m, m, {m})) == []
