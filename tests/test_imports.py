"""The package's layers (docs/architecture.md), read from the sources: no import cycle anywhere in
mkernel, counting imports inside functions (a deferred import that hides a cycle is still one);
the declarations below the runtime import neither the runtime nor the ops; the runtime imports no
op. Imports under ``if TYPE_CHECKING:`` are annotations only and do not count."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The layers, bottom up; a module's layer is that of the longest prefix listed.
BASE = (
    "mkernel.errors",
    "mkernel.protocol",
    "mkernel._paths",
    "mkernel.tiles",
    "mkernel.cost",
    "mkernel.interp",
)
RUNTIME = (
    "mkernel.runtime",
    "mkernel.world",
    "mkernel.schedule",
    "mkernel.jit",
    "mkernel.codegen",
    "mkernel.rdma",
    "mkernel.rdma_ext",
    "mkernel.rdma_streams",
    "mkernel.rdma_nvshmem",
    "mkernel.nvshmem_ext",
    "mkernel.attention_ext",
)


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in (ROOT / "mkernel").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path, package: bool, known: set[str]) -> set[str]:
    """The mkernel modules ``module`` imports anywhere in its source (functions included)."""
    out: set[str] = set()

    def target(level: int, name: str | None) -> str:
        if not level:
            return name or ""
        base = module.split(".") if package else module.split(".")[:-1]
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([name] if name else []))

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names if a.name in known)
            elif isinstance(child, ast.ImportFrom):
                base = target(child.level, child.module)
                for a in child.names:  # `from pkg import mod` imports pkg.mod
                    sub = f"{base}.{a.name}"
                    out.add(sub if sub in known else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in out if m in known and m != module}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, pkg, set(mods)) for m, (p, pkg) in mods.items()}


def _layer(module: str) -> int:
    def under(prefixes: tuple[str, ...]) -> bool:
        return any(module == p or module.startswith(p + ".") for p in prefixes)

    return 0 if under(BASE) else 1 if under(RUNTIME) else 2


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return found


def test_no_import_cycle_counting_imports_inside_functions():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    # the check itself: a -> b at the top, b -> a inside a function, is a cycle
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n")
    known = {"pkg.a", "pkg.b"}
    graph = {m: _imports(m, tmp_path / f"{m[4:]}.py", False, known) for m in known}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


def test_lower_layers_import_no_higher_one():
    bad = [
        f"{m} -> {t}"
        for m, targets in sorted(_graph().items())
        for t in sorted(targets)
        if t != "mkernel" and _layer(t) > _layer(m)
    ]
    assert bad == [], "\n".join(bad)


def test_nothing_imports_the_package_root_but_the_entry_points():
    # `import mkernel` imports every op: a module below the API that imported it would import up
    users = sorted(m for m, targets in _graph().items() if "mkernel" in targets)
    assert all(_layer(m) == 2 for m in users), users


def test_importing_mkernel_imports_no_build_machinery():
    # `python -m mkernel.jit --check` and `python -m mkernel.codegen` run those modules as scripts:
    # had `import mkernel` imported them first, runpy would warn and run a second copy
    code = "import sys, mkernel; print(sorted(m for m in sys.modules if m in MODS))"
    code = code.replace("MODS", repr(("mkernel.jit", "mkernel.codegen", "mkernel.attention_ext")))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
