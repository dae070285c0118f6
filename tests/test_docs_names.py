"""Every name the docs and docstrings give exists: files, `module.function`s, config keys, the layout's modules.

Read: docs/*.md and README.md whole; in the Python files of entropy_experiments/, bench/, scripts/ and examples/,
the docstrings, comments and other string constants (messages, help texts). What counts as a reference:
- a file name ending in .py or .sh, or a path under one of the repository's top-level directories: it must be a
  file or directory of the repository (a path also counts relative to entropy_experiments/ and its packages,
  as the docs write `probe/recipe.py`; a bare `recipe.py` anywhere);
- a dotted name (`data.batch.Batch`, `probe/recipe.run`, `Batch.validate`, `batch_config.pool_size`) whose first
  part is the project's: a module or package of entropy_experiments (by any tail of its dotted name), a public
  name one of its modules defines, or a config section. It must resolve: modules imported, the rest looked up
  as attributes (fields of pydantic models and dataclasses included), config keys against ProbeConfig and its
  legacy keys. A name whose first part is neither the project's nor importable is unknown, and an error too
  when its last part is a name the project defines (a renamed module) or it reads as a module path written as
  files are (`a/b.c`). Names whose first part is a library (`torch.func.functional_call`, `trl.GRPOConfig`)
  or a name bound in the same Python file (a parameter, a local, an import alias) are not the project's.
The layout section of docs/development.md must name every module of the package.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "entropy_experiments"
CODE_DIRS = (PKG, "bench", "scripts", "examples")
SKIPPED_DIRS = {".git", ".venv", "__pycache__", "node_modules"}
FILE_SUFFIXES = ("py", "sh")
# The last part of a dotted name that makes it a file name, not a module path.
FILE_EXTENSIONS = frozenset({"py", "sh", "md", "yaml", "yml", "json", "jsonl", "pt", "png", "txt", "html", "bin", "csv",
                             "toml", "lock", "gguf", "log", "parquet", "safetensors", "pth", "ipynb", "cfg", "ini"})
# A dotted name: identifiers joined by dots, optionally led by a path (probe/recipe.run), not part of a longer word.
# A name led by ~ $ < { or followed by < { * is a pattern (`gsm_symbolic_<split>.jsonl`), a prefix followed by a dot
# and a quote (`base_model.model.`) is no name: neither is checked.
NOT_BEFORE, NOT_AFTER = r"(?<![\w./\-~$<{}])", r"(?![\w\-<{*]|\.\w|\.[`'\"])"
DOTTED = re.compile(NOT_BEFORE + r"((?:[A-Za-z_]\w*/)*[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)" + NOT_AFTER + r"(?![/(])")
PATH = re.compile(NOT_BEFORE + r"((?:\.?[\w\-]+/)+[\w\-]*(?:\.[\w\-]+)?/?)" + NOT_AFTER)
FILE = re.compile(NOT_BEFORE + r"((?:[\w\-]+/)*[\w\-]+\.(?:" + "|".join(FILE_SUFFIXES) + r"))" + NOT_AFTER)


def ignored_top_level() -> frozenset[str]:
    """Top-level names the checkout's .gitignore ignores (runs/ after a demo, out/): what a run leaves behind is
    not part of the repository, so paths the docs write under it are examples, not files to find."""
    gitignore = ROOT / ".gitignore"
    lines = gitignore.read_text(encoding="utf-8").splitlines() if gitignore.is_file() else []
    return frozenset(line.strip().strip("/") for line in lines
                     if line.strip() and not line.startswith("#") and not any(c in line for c in "*?["))


def repo_files() -> list[str]:
    """Every file and directory of the checkout, relative to the root, with '/' (directories end in '/')."""
    out, ignored = [], ignored_top_level()
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if SKIPPED_DIRS & set(rel.parts) or any(p.endswith(".egg-info") for p in rel.parts) or rel.parts[0] in ignored:
            continue
        out.append(rel.as_posix() + ("/" if path.is_dir() else ""))
    return out


@cache
def repo_paths() -> frozenset[str]:
    return frozenset(repo_files())


@cache
def module_names() -> dict[str, str]:
    """Every module of the package by dotted name -> its file (packages by their __init__.py)."""
    out = {}
    for path in sorted((ROOT / PKG).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


@cache
def module_tails() -> dict[str, list[str]]:
    """Every tail of a module's dotted name ('recipe', 'probe.recipe', ...) -> the modules it names."""
    tails: dict[str, list[str]] = {}
    for name in module_names():
        parts = name.split(".")
        for i in range(len(parts)):
            tails.setdefault(".".join(parts[i:]), []).append(name)
    return tails


@cache
def defined_names() -> dict[str, list[str]]:
    """Top-level names (classes, functions, assignments) each module defines -> those modules."""
    out: dict[str, list[str]] = {}
    for module, path in module_names().items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = []
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names = [node.name]
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            for name in names:
                out.setdefault(name, []).append(module)
    return out


@cache
def config_keys() -> frozenset[str]:
    """Every dotted config key ('batch_config.pool_size', 'precision.func_override.autocast', sections too),
    legacy keys included."""
    from pydantic import BaseModel

    from entropy_experiments.config import LEGACY_KEYS, ProbeConfig

    keys: set[str] = set(LEGACY_KEYS) | {k.split(".")[0] for k in LEGACY_KEYS}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            keys.add(prefix + name)
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                walk(field.annotation, prefix + name + ".")

    walk(ProbeConfig, "")
    return frozenset(keys)


@cache
def output_keys() -> frozenset[str]:
    """The keys the modules that write results.json and sweep.json (report/, sweep/) give their blocks: dict
    literal keys, `d["key"]` subscripts and `dict(key=...)` keywords."""
    keys = set()
    for top in ("report", "sweep"):
        for path in (ROOT / PKG / top).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Dict):
                    keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                    keys.add(str(node.slice.value))
                elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict":
                    keys |= {k.arg for k in node.keywords if k.arg}
    return frozenset(keys)


@cache
def logger_names() -> frozenset[str]:
    """The names the package's code passes to logging.getLogger (dotted, but no module)."""
    names = set()
    for path in module_names().values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "getLogger":
                names |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return frozenset(names)


def has_attribute(obj: object, name: str) -> tuple[bool, object]:
    """(found, value) of `name` on a module, class or object: attributes, pydantic fields, dataclass fields."""
    if hasattr(obj, name):
        return True, getattr(obj, name)
    if name in (getattr(obj, "model_fields", None) or {}):
        return True, None
    if isinstance(obj, type) and dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
        return True, None
    if isinstance(obj, type) and name in getattr(obj, "__annotations__", {}):
        return True, None
    return False, None


def resolves_in(module: str, rest: list[str]) -> bool:
    """Whether attributes `rest` exist on `module` (a submodule counts as an attribute)."""
    obj: object = importlib.import_module(module)
    where = module
    for part in rest:
        if obj is None:  # a field without a class-level value: nothing deeper to look up
            return True
        if isinstance(obj, type(importlib)) and f"{where}.{part}" in module_names():
            obj, where = importlib.import_module(f"{where}.{part}"), f"{where}.{part}"
            continue
        found, obj = has_attribute(obj, part)
        if not found:
            return False
        where = f"{where}.{part}"
    return True


@cache
def is_external(first: str) -> bool:
    """Whether `first` is a module importable outside the project (torch, trl, yaml, ...)."""
    if first == PKG:
        return False
    try:
        return importlib.util.find_spec(first) is not None
    except (ImportError, ValueError):
        return False


def reads_as_a_value(parts: list[str], i: int, pathlike: bool) -> bool:
    """Whether a name led by a module's name that does not resolve reads as something else of the same name: a
    results.json / sweep.json block (`attribution.E_tokens`), a library (`datasets.Dataset`), or a variable's
    attribute (`rows.values`: one lower-case part before a public name the project defines nowhere)."""
    if pathlike:
        return False
    if parts[0] in output_keys() or is_external(parts[0]):
        return True
    return (i == 1 and parts[0].islower() and not parts[1].startswith("_") and parts[1] not in defined_names()
            and parts[1] not in module_tails())


def check_dotted(name: str, bound: frozenset[str] = frozenset()) -> str | None:
    """None when `name` resolves or is not the project's; else why not."""
    pathlike = "/" in name
    parts = name.replace("/", ".").split(".")
    if parts[0] in bound and not pathlike:
        return None
    if name in config_keys() or name in logger_names():
        return None
    if parts[0] in output_keys() and parts[0] in config_keys() and not pathlike:
        return None  # `checkpoint.tokenizer`, `predictors.adamw_step`: results.json blocks named as config sections
    if parts[0] in config_keys() and not pathlike and parts[0] not in module_tails():
        # a results.json / sweep.json block of the same name (predictors, sampler, ...) is not a config key
        return None if parts[0] in output_keys() else "no such config key"
    for i in range(len(parts), 0, -1):  # the longest head that names a module
        head = ".".join(parts[:i])
        for module in module_tails().get(head, []):
            if resolves_in(module, parts[i:]):
                return None
        if head in module_tails():
            return None if reads_as_a_value(parts, i, pathlike) else f"{head} has no {'.'.join(parts[i:])}"
    if parts[0] in defined_names():
        if any(resolves_in(module, parts) for module in defined_names()[parts[0]]) or parts[0] in output_keys():
            return None
        return f"{parts[0]} has no {'.'.join(parts[1:])}"
    if is_external(parts[0]):
        return None
    if pathlike or (parts[-1] in defined_names() and parts[0] not in output_keys()):
        return "names no module of the project"
    return None


def check_file(name: str) -> str | None:
    """None when the file exists in the repository (see the module docstring); else why not."""
    paths = repo_paths()
    name = name.removeprefix("./")
    if "/" not in name.rstrip("/"):
        return None if any(p.rstrip("/").rsplit("/", 1)[-1] == name.rstrip("/") for p in paths) else "no such file"
    for base in ("", PKG + "/"):
        for candidate in (name, name.rstrip("/") + "/", name + ".py"):  # `data/plan`: the module data/plan.py
            if base + candidate in paths:
                return None
    if any(p.startswith(PKG + "/") and p.endswith("/" + name) for p in paths):
        return None
    return "no such file"


@cache
def top_dirs() -> frozenset[str]:
    """The repository's top-level directories (scripts, bench, docs, ...)."""
    return frozenset(p.split("/")[0] for p in repo_paths() if p.endswith("/") and p.count("/") == 1)


@cache
def package_dirs() -> frozenset[str]:
    """The package's top-level subpackages as the docs write paths under them ('probe', 'data', ...)."""
    return frozenset(p.split("/")[1] for p in repo_paths() if p.startswith(PKG + "/") and p.count("/") == 2
                     and p.endswith("/"))


def problems_in_text(text: str, bound: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """(name, why) for every reference in `text` that does not exist."""
    found = []
    anchors = top_dirs() | package_dirs()
    for match in FILE.finditer(text):
        name = match.group(1)
        stem = name.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        # a path under the repository's directories, or a bare file named as one of the package's modules;
        # other files (TRL's grpo_trainer.py, a user's my_rewards.py) are not the project's
        if (name.split("/")[0] in anchors if "/" in name else stem in module_tails()):
            why = check_file(name)
            if why:
                found.append((name, why))
    for match in PATH.finditer(text):
        name = match.group(1)
        last = name.rstrip("/").rsplit("/", 1)[-1]
        if "." in last and last.rsplit(".", 1)[-1] not in FILE_EXTENSIONS:
            continue  # `probe/recipe.run`: a module path with an attribute, checked as a dotted name
        if not name.endswith(FILE_SUFFIXES) and name.split("/")[0] in anchors:
            why = check_file(name)
            if why:
                found.append((name, why))
    for match in DOTTED.finditer(text):
        name = match.group(1)
        if name.rsplit(".", 1)[-1] in FILE_EXTENSIONS:  # a file name (checked above where it is the repository's)
            continue
        why = check_dotted(name, bound)
        if why:
            found.append((name, why))
    return found


def doc_texts() -> dict[str, str]:
    docs = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    return {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in docs}


def bound_names(tree: ast.AST) -> frozenset[str]:
    """Names a Python file binds itself: imports (aliases), parameters, assignments, loop and with targets."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return frozenset(names)


def code_texts() -> dict[str, tuple[str, frozenset[str]]]:
    """Per Python file: its comments and string constants (docstrings, messages, help), and the names it binds."""
    out = {}
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            pieces = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                      if tok.type == tokenize.COMMENT]
            tree = ast.parse(source)
            planted = {id(node) for call in ast.walk(tree)  # scripts/traps.py's Trap(...): bugs, wrong on purpose
                       if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Trap"
                       for node in ast.walk(call)}
            pieces += [node.value for node in ast.walk(tree)  # not a prefix such as "base_model.model."
                       if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in planted
                       and not (node.value.endswith(".") and " " not in node.value)]
            out[path.relative_to(ROOT).as_posix()] = ("\n".join(pieces), bound_names(tree))
    return out


def test_names_in_the_docs_exist():
    problems = [f"{doc}: {name!r}: {why}" for doc, text in doc_texts().items()
                for name, why in problems_in_text(text)]
    assert not problems, "\n".join(problems)


def test_names_in_docstrings_comments_and_messages_exist():
    problems = [f"{path}: {name!r}: {why}" for path, (text, bound) in code_texts().items()
                for name, why in problems_in_text(text, bound)]
    assert not problems, "\n".join(problems)


def layout_section() -> str:
    """The code block of docs/development.md's "## Layout" section."""
    text = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1]


def layout_entries(tree: str) -> list[str]:
    """The paths the layout tree lists: a line whose first word ends in '/' or '.py' at two spaces per level is an
    entry under the last directory one level up; other lines continue a description."""
    stack: list[str] = []
    entries = []
    for line in tree.splitlines():
        words = line.split()
        if not words or not words[0].endswith(("/", ".py")):
            continue
        depth, rest = divmod(len(line) - len(line.lstrip(" ")), 2)
        if rest or depth > len(stack):
            continue  # a description's continuation that happens to start with a path
        stack[depth:] = [words[0]]
        entries.append("".join(stack))
    return entries


def test_the_layout_lists_every_module():
    """Every module of the package (and of the seed package sequence_processing/) has its line in the layout tree,
    and every path the tree lists exists."""
    listed = layout_entries(layout_section())
    assert listed, "no layout tree found in docs/development.md"
    modules = {p.relative_to(ROOT).as_posix() for top in (PKG, "sequence_processing")
               for p in (ROOT / top).rglob("*.py") if p.name != "__init__.py"}
    missing = sorted(modules - set(listed))
    assert not missing, "docs/development.md's layout omits " + ", ".join(missing)
    absent = [entry for entry in listed if entry not in repo_paths() and entry + "/" not in repo_paths()]
    assert not absent, "docs/development.md's layout lists paths that do not exist: " + ", ".join(absent)


if __name__ == "__main__":
    for what, texts in (("docs", {k: (v, frozenset()) for k, v in doc_texts().items()}), ("code", code_texts())):
        for where, (text, bound) in texts.items():
            for name, why in problems_in_text(text, bound):
                print(f"{where}: {name!r}: {why}")
    pytest.main([__file__, "-q", "-k", "layout"])
