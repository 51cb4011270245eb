"""The package's import graph: no circle anywhere, and no import from a lower layer up to a higher one.

Imports are read from the source (ast), lazy ones inside functions included: a lazy import is still a dependency,
only one that hides a circle from the interpreter. Each module sits in the layer of its longest listed prefix;
a module may import its own layer and those below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "lm_eval_spot"

# Lowest first. Vocabulary (no project imports beyond its own layer) < args < the round's machinery (decoding and
# the adapters it drives) < proposers (drafters, baselines, budget) < families and cards (which load targets) <
# what the harness model class assembles (likelihood, methods) < entry points and command lines.
LAYERS: list[tuple[str, ...]] = [
    ("lm_eval_spot", "errors", "tokens", "transfer", "settings.modes", "adapters.attention_masks", "harness.until",
     "training.prompts", "settings.threads", "harness.distributed", "harness.request_cache", "reports.run_stats",
     "tools.compare", "arith", "likelihood.patterns"),
    ("settings.args", "harness.gen_kwargs"),
    ("adapters",),
    ("decoding", "harness.batch_size"),
    ("drafter", "baselines.rank_graph", "baselines.oracle", "budget"),
    ("families", "settings.cards"),
    ("likelihood", "settings.proposers", "harness.planning", "reports.summary", "harness.chat", "harness.generation"),
    ("harness.model", "harness.build", "tools.check", "harness.registration", "_boot", "training", "baselines.graph",
     "likelihood.timing", "likelihood.variance"),
]
# Every subpackage's own __init__ (a docstring) sits in the lowest layer; its modules are placed above.
SUBPACKAGE_INITS = ("harness", "settings", "reports", "tools")


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import sub` depends on pkg.sub when it is a module, else on pkg itself
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for n in names:
                if n == "lm_eval_spot" or n.startswith("lm_eval_spot."):
                    t = owner(n)
                    if t is not None and t != m:
                        graph[m].add(t)
    return graph


def layer_of(module: str) -> int:
    rel = module.removeprefix("lm_eval_spot").removeprefix(".")
    if rel in SUBPACKAGE_INITS:
        return 0
    best, depth = None, -1
    for i, names in enumerate(LAYERS):
        for n in names:
            if n == "lm_eval_spot" and rel == "":
                return i
            if rel == n or rel.startswith(n + "."):
                if len(n) > depth:
                    best, depth = i, len(n)
    if best is None:
        raise KeyError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")
    return best


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_sees_lazy_relative_and_from_imports(tmp_path):
    """The reader itself: a circle through a lazy import inside a function is still found."""
    g = import_graph()
    assert "lm_eval_spot.decoding.types" in g["lm_eval_spot.decoding.loop"]  # a top-level from-import
    assert "lm_eval_spot.families" in g["lm_eval_spot.training.train"]  # a lazy import inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_anywhere_in_the_package():
    assert cycles(import_graph()) == []


def test_every_module_is_in_a_layer_and_imports_only_its_own_or_lower_ones():
    graph = import_graph()
    upward = [f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
              for m, targets in sorted(graph.items()) for t in sorted(targets) if layer_of(t) > layer_of(m)]
    assert upward == []


@pytest.mark.parametrize("module", ["settings.args", "settings.cards", "decoding.observe"])
def test_the_old_circles_stay_broken(module):
    """the model arguments know nothing of cards or families; observers do not depend on the loop."""
    g = import_graph()
    reach, todo = set(), [f"lm_eval_spot.{module}"]
    while todo:
        for t in g[todo.pop()]:
            if t not in reach:
                reach.add(t)
                todo.append(t)
    assert f"lm_eval_spot.{module}" not in reach
    if module == "settings.args":
        assert not any(t.startswith(("lm_eval_spot.settings.cards", "lm_eval_spot.families")) for t in reach)
    if module == "decoding.observe":
        assert "lm_eval_spot.decoding.loop" not in reach
