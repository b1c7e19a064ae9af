"""The layers import one way (DESIGN.md, docs/development.md "Layout"): a module imports only from its own layer or
the layers below it, there is no import cycle, and no module outside models/ names a model family. Parsed from the source
(every import statement, including those inside functions), so it holds for code paths no test runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import models

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    ("angel_jax", "angel_jax.errors", "angel_jax.units", "angel_jax.benchinfo", "angel_jax.config",
     "angel_jax.phases"),
    ("angel_jax.memory", "angel_jax.checkpoint", "angel_jax.tee", "angel_jax.data"),
    ("models",),
    ("angel_jax.optim",),
    ("angel_jax.schedule",),
    ("angel_jax.train",),
    ("angel_jax.tol",),
    ("angel_jax.cli",),
]
"""Lowest first. A module belongs to the longest prefix listed (angel_jax.memory.store -> angel_jax.memory)."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    files = sorted((ROOT / "angel_jax").rglob("*.py")) + sorted((ROOT / "models").rglob("*.py"))
    return {module_name(p): p for p in files}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The first-party modules `path` imports: `from a.b import c` counts as a.b.c when that is a module."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        out |= {n for n in names if n.split(".")[0] in ("angel_jax", "models")}
    return out


def layer_of(module: str) -> int:
    best = max((prefix for layer in LAYERS for prefix in layer
                if module == prefix or module.startswith(prefix + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    known = set(modules)
    # `import a.b.c` and `from a.b import c` both also run a and a.b; only the named module is an edge here.
    return {m: imports_of(p, known) - {m} for m, p in modules.items()}


def test_every_import_points_down_or_sideways():
    wrong = [f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
             for m, deps in graph().items() for d in sorted(deps) if layer_of(d) > layer_of(m)]
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, as a path that ends where it starts; None when there is none."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_there_is_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("family", sorted(models.FAMILIES))
def test_no_module_outside_models_names_a_model_family(family):
    family_module = models.FAMILIES[family]
    named = [m for m, deps in graph().items() if not m.startswith("models")
             for d in deps if d == family_module or d.startswith(family_module + ".")]
    assert not named, f"{family_module} is imported outside models/ by: {named} (use models.get(cfg.model))"
    # Also `from models import gpt`, which the graph records as models.gpt when that module exists.
    for m, path in all_modules().items():
        if not m.startswith("models"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "models":
                    assert family not in [a.name for a in node.names], f"{m} imports models.{family}"


BUDGET_KEYS = {"device_budget", "host_budget", "disk_budget"}
BUDGETS_MODULE = "angel_jax.schedule.budgets"
OWN_ROOM_CHECKS = {
    "angel_jax.memory.disk_tier": "refuses a page write the file system has no room for (a disk filled mid-run)",
    "angel_jax.memory.bench_io": "sizes its benchmark file to the disk's free space",
    "angel_jax.checkpoint.memtier": "refuses a memory-tier snapshot that RAM has no room for",
    "angel_jax.checkpoint.peer_receiver": "refuses a neighbour's snapshot copy that its RAM-backed store has no room for",
    "angel_jax.checkpoint.persist": "streams a checkpoint larger than half the RAM instead of reading it whole",
    "angel_jax.train.report": "prints what the machine has",
}
"""Modules that ask the machine what it has free for a check of their own, not a budget (each with why)."""


def test_budgets_are_decided_in_one_module():
    """Only the budgets module reads memory.*_budget and asks the machine what it has free (DESIGN.md: budgets
    decided once); `config` declares and validates the keys. Other modules call the budgets module."""
    wrong = []
    for m, path in all_modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in BUDGET_KEYS and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "memory" and m != BUDGETS_MODULE and not m.startswith("angel_jax.config")):
                wrong.append(f"{m}:{node.lineno} reads memory.{node.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
                    and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
                    in ("virtual_memory", "disk_usage") and m != BUDGETS_MODULE and m not in OWN_ROOM_CHECKS):
                wrong.append(f"{m}:{node.lineno} asks the machine what it has free")
            if isinstance(node, ast.FunctionDef) and node.name == "device_free_bytes" and m != BUDGETS_MODULE:
                wrong.append(f"{m}:{node.lineno} defines device_free_bytes")
    assert not wrong, f"budgets decided outside {BUDGETS_MODULE}:\n" + "\n".join(wrong)


SETUP_ORDER = ["angel_jax.schedule.blueprint", "angel_jax.schedule.budgets", "angel_jax.schedule.runtime"]
"""The paged engine's set-up, in the order it runs: the model's layouts and stage functions from shapes, the
budgets decided from their sizes, the runtime under that decision (train/paged.py)."""


def test_the_paged_engines_setup_runs_one_way():
    """Each set-up step imports none of the steps after it, and the budgets none of the others (they take the
    model's sizes as an argument): the config goes blueprint -> budgets -> runtime and never back, so a budget is
    decided before anything uses it and nothing decides one again."""
    modules = all_modules()
    known = set(modules)
    wrong = []
    for i, step in enumerate(SETUP_ORDER):
        later = set(SETUP_ORDER[i + 1:]) | ({"angel_jax.schedule.blueprint"} if step.endswith("budgets") else set())
        for imported in imports_of(modules[step], known) & later:
            wrong.append(f"{step} imports {imported}")
    assert not wrong, "\n".join(wrong)
