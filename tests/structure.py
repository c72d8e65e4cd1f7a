#!/usr/bin/env python3
"""The package's structure: module count and sizes, internal import arrows, cycles (between modules and between
folders), largest functions. ``tests/test_structure.py`` holds the package to it; run it to see the figures:

    .venv/bin/python tests/structure.py [--json] [PACKAGE_DIR ...]      # default: pipeline

Used to measure a restructuring before and after (lines are physical lines, blank and comment lines
included; a function's size is its span from ``def`` to its last line; an import arrow is a module-level
or function-level ``import``/``from … import`` of another module of the same packages). ``import_cycles`` counts
the arrows that run; ``import_cycles_typing`` counts those inside ``if TYPE_CHECKING:`` blocks too (a circle a
type annotation hides is still a circle between the two modules' ideas: issue #45).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of import nodes inside ``if TYPE_CHECKING:`` blocks (not run-time arrows)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return out


def _imports(tree: ast.AST, name: str, is_pkg: bool, modules: set[str], *, type_checking: bool = False) -> set[str]:
    """Modules ``name`` imports at run time (with ``type_checking``: also inside ``if TYPE_CHECKING:``);
    ``from pkg import sub`` is an arrow to ``pkg.sub`` only."""
    out: set[str] = set()
    skip = set() if type_checking else _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names}
            if subs <= modules:
                out.update(subs)
            else:
                out.add(base)
                out.update(subs & modules)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


#: the module that holds the serving-path table (its comparisons are the dispatch itself, not branches)
DISPATCH_TABLE = "pipeline/recipe/serving_path.py"
_ENGINE_KINDS = {"tensorrt", "pytorch", "cpu"}
_FRONTENDS = {"triton", "trtllm-serve"}
_FRONTEND_NAMES = {"TRITON", "TRTLLM_SERVE", "FRONTEND"}


def _operand_kind(node: ast.AST) -> str | None:
    """``engine`` / ``frontend`` / ``cpu`` when ``node`` is a constant (or a tuple of constants) of that axis."""
    if isinstance(node, ast.IfExp):  # ("tensorrt", "pytorch") if fitted else ("tensorrt",)
        kinds = {_operand_kind(node.body), _operand_kind(node.orelse)}
        return kinds.pop() if len(kinds) == 1 else None
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts:
        kinds = {_operand_kind(e) for e in node.elts}
        return kinds.pop() if len(kinds) == 1 else None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if node.value in _FRONTENDS:
            return "frontend"
        return "engine" if node.value in _ENGINE_KINDS else None
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    if name in _FRONTEND_NAMES:
        return "frontend"
    return "cpu" if name == "CPU_TARGET" else None


def dispatch_branches(roots: list[Path]) -> dict[str, list[str]]:
    """``{"engine_kind" | "frontend" | "cpu_target": ["file:line: source", …]}``: the comparisons that decide a
    serving path outside :data:`DISPATCH_TABLE` (read with ``ast``).

    * engine kind: a comparison with ``"tensorrt"``/``"pytorch"``/``"cpu"`` (or a tuple of them) whose other side
      names an engine or a kind (``recipe.build.engine``, ``engine_kind``, ``kind``), not Triton's install kind;
    * frontend: a comparison with ``"triton"``/``"trtllm-serve"`` or a ``TRITON``/``TRTLLM_SERVE``/``FRONTEND``
      constant whose other side names a frontend;
    * cpu target: ``… == CPU_TARGET``, ``target.gpu == "cpu"`` and ``recipe.gpu is None`` / ``is not None``.
    """
    import re

    out: dict[str, list[str]] = {"engine_kind": [], "frontend": [], "cpu_target": []}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root.parent).as_posix()
            if "__pycache__" in path.parts or rel == DISPATCH_TABLE:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Compare):
                    continue
                operands = [node.left, *node.comparators]
                where = f"{rel}:{node.lineno}: {ast.unparse(node)}"
                kinds = {k for k in map(_operand_kind, operands) if k}
                others = " ".join(ast.unparse(o) for o in operands if _operand_kind(o) is None)
                if "engine" in kinds and re.search(r"engine|\bkind\b", others) and "install" not in others:
                    out["engine_kind"].append(where)
                elif "frontend" in kinds and "frontend" in others:
                    out["frontend"].append(where)
                elif ("cpu" in kinds or ("engine" in kinds and re.search(r"\.gpu\b", others))
                      or (isinstance(node.ops[0], (ast.Is, ast.IsNot)) and isinstance(node.comparators[0], ast.Constant)
                          and node.comparators[0].value is None and re.search(r"\.gpu$", ast.unparse(node.left)))):
                    out["cpu_target"].append(where)
    return out


def folder_of(module: str) -> str:
    """The folder a module lives in: ``pipeline.engine.tensorrt`` → ``pipeline.engine``; a top-level module
    (``pipeline.cli``) and the package itself are their own folder."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _graph(trees: dict[str, tuple[ast.AST, bool]], modules: set[str], *, type_checking: bool) -> dict[str, set[str]]:
    """module → the package modules it imports (the longest known module name each import names)."""
    graph: dict[str, set[str]] = {}
    for name, (tree, is_pkg) in trees.items():
        targets = set()
        for imp in _imports(tree, name, is_pkg, modules, type_checking=type_checking):
            parts = imp.split(".")
            for k in range(len(parts), 0, -1):
                cand = ".".join(parts[:k])
                if cand in modules and cand != name:
                    targets.add(cand)
                    break
        graph[name] = targets
    return graph


def report(roots: list[Path]) -> dict:
    modules: dict[str, dict] = {}
    trees: dict[str, tuple[ast.AST, bool]] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            name = _module_name(path, root)
            text = path.read_text()
            tree = ast.parse(text)
            trees[name] = (tree, path.name == "__init__.py")
            funcs = [
                (f"{name}.{n.name}", n.end_lineno - n.lineno + 1)
                for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            ]
            modules[name] = {"path": str(path), "lines": len(text.splitlines()), "functions": funcs}
    graph = _graph(trees, set(modules), type_checking=False)
    typing_graph = _graph(trees, set(modules), type_checking=True)
    folders: dict[str, set[str]] = {}
    for src, dsts in graph.items():
        for dst in dsts:
            a, b = folder_of(src), folder_of(dst)
            if a != b:
                folders.setdefault(a, set()).add(b)
    sizes = sorted((m["lines"] for m in modules.values()), reverse=True)
    funcs = sorted((f for m in modules.values() for f in m["functions"]), key=lambda f: -f[1])
    return {
        "modules": len(modules),
        "lines_total": sum(sizes),
        "lines_max": sizes[0] if sizes else 0,
        "lines_median": sizes[len(sizes) // 2] if sizes else 0,
        "modules_over_400_lines": sorted((n, m["lines"]) for n, m in modules.items() if m["lines"] > 400),
        "largest_function": funcs[0] if funcs else ("", 0),
        "import_arrows": sum(len(v) for v in graph.values()),
        "import_cycles": _cycles(graph),
        "import_cycles_typing": _cycles(typing_graph),
        "folder_arrows": {k: sorted(v) for k, v in sorted(folders.items())},
        "folder_cycles": _cycles(folders),
        "module_lines": {n: m["lines"] for n, m in modules.items()},
        "largest_functions": funcs[:8],
        "dispatch_branches": {k: len(v) for k, v in dispatch_branches(roots).items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="*", default=["pipeline"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = report([Path(p).resolve() for p in args.roots])
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(f"modules {r['modules']}, lines {r['lines_total']} (max {r['lines_max']}, median {r['lines_median']})")
    print(f"internal import arrows {r['import_arrows']}, cycles {len(r['import_cycles'])} "
          f"({len(r['import_cycles_typing'])} counting TYPE_CHECKING imports), folder cycles {len(r['folder_cycles'])}")
    for c in r["import_cycles"]:
        print("  cycle: " + " <-> ".join(c))
    for c in r["import_cycles_typing"]:
        if c not in r["import_cycles"]:
            print("  cycle (TYPE_CHECKING): " + " <-> ".join(c))
    for c in r["folder_cycles"]:
        print("  folder cycle: " + " <-> ".join(c))
    for n, lines in r["modules_over_400_lines"]:
        print(f"  over 400 lines: {n} ({lines})")
    print("serving-path branches outside the table: "
          + ", ".join(f"{k} {n}" for k, n in r["dispatch_branches"].items()))
    print("largest functions:")
    for n, lines in r["largest_functions"]:
        print(f"  {lines:4d}  {n}")


if __name__ == "__main__":
    main()
