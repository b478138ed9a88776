"""Print paged_kv's import graph between packages, read from the source with `ast`.

    python benchmarks/import_graph.py [ROOT] [--depth 2] [--within paged_kv.core]
        [--leave-out paged_kv.errors paged_kv.config] [--format mermaid|text]

Every import counts: relative ones (resolved against the importing module), those inside
functions and those under ``TYPE_CHECKING``. A name imported from a package's
``__init__`` is followed to the module that defines it, so a re-export draws no edge of
its own. Modules are cut to their first `--depth` name parts (``paged_kv.core.step.plan``
at depth 2 is ``paged_kv.core``); an edge's count is the number of distinct
(module, module) imports under it. Edges that lie on a cycle between packages (the
target reaches the source back) are marked: red in Mermaid, ``cycle`` in text.
"""

from __future__ import annotations

import argparse
import ast
import collections
import pathlib

Graph = dict[tuple[str, str], int]


def module_paths(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Each module of ``root/paged_kv`` by its dotted name (a package by its own name)."""
    found = {}
    for path in sorted((root / "paged_kv").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: pathlib.Path) -> list[tuple[str, str | None]]:
    """``(module, imported name or None)`` for every import in the module `name`."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            found += [(module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
    return found


def module_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """The paged_kv modules each module of `root` imports.

    Parameters
    ----------
    root : pathlib.Path
        The directory that holds ``paged_kv/``.

    Returns
    -------
    dict[str, set[str]]
        Module name -> the names of the paged_kv modules it imports (itself left out), a
        name imported from a package's ``__init__`` followed to the module defining it.
    """
    paths = module_paths(root)
    found = {name: imports(name, path) for name, path in paths.items()}
    exports = {name: {alias: (module, alias) for module, alias in found[name] if alias}
               for name, path in paths.items() if path.name == "__init__.py"}

    def resolve(module: str, alias: str | None, hops: int = 0) -> str | None:
        if alias and f"{module}.{alias}" in paths:
            return f"{module}.{alias}"
        if alias and alias in exports.get(module, {}) and hops < 10:
            return resolve(*exports[module][alias], hops + 1)
        return module if module in paths else None

    return {name: {m for m in (resolve(*pair) for pair in pairs) if m and m != name}
            for name, pairs in found.items()}


def package_graph(modules: dict[str, set[str]], depth: int, within: str = "paged_kv",
                  leave_out: tuple[str, ...] = ()) -> Graph:
    """The edges between packages: `modules` with each name cut to `depth` parts.

    Parameters
    ----------
    modules : dict[str, set[str]]
        The module graph, as `module_graph` returns it.
    depth : int
        Name parts a package keeps (2: ``paged_kv.core``; 3: ``paged_kv.core.step``).
    within : str
        Only modules under this package are drawn, at both ends of an edge.
    leave_out : tuple of str
        Packages whose modules are left out, at either end of an edge.

    Returns
    -------
    dict[tuple[str, str], int]
        ``(source, target)`` -> how many distinct module imports the edge stands for,
        sorted; an import inside one package draws no edge.
    """
    def unit(module: str) -> str | None:
        inside = module == within or module.startswith(f"{within}.")
        dropped = any(module == p or module.startswith(f"{p}.") for p in leave_out)
        return ".".join(module.split(".")[:depth]) if inside and not dropped else None

    edges: Graph = collections.Counter()
    for source, targets in modules.items():
        for target in targets:
            a, b = unit(source), unit(target)
            if a and b and a != b:
                edges[a, b] += 1
    return dict(sorted(edges.items()))


def on_cycle(edges: Graph) -> set[tuple[str, str]]:
    """The edges whose target reaches their source back."""
    after = collections.defaultdict(set)
    for a, b in edges:
        after[a].add(b)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in after[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    return {(a, b) for a, b in edges if a in reach(b)}


def mermaid(edges: Graph) -> str:
    """A Mermaid ``flowchart`` (GitHub renders it), edges on a cycle in red."""
    names = sorted({name for edge in edges for name in edge})
    ids = {name: name.replace(".", "_") for name in names}
    lines = ["flowchart TD"]
    lines += [f'  {ids[name]}["{name.removeprefix("paged_kv.")}"]' for name in names]
    lines += [f"  {ids[a]} -->|{n}| {ids[b]}" for (a, b), n in edges.items()]
    cycle = on_cycle(edges)
    red = [str(i) for i, edge in enumerate(edges) if edge in cycle]
    if red:
        lines.append(f"  linkStyle {','.join(red)} stroke:#d33,stroke-width:2px")
    return "\n".join(lines)


def text(edges: Graph) -> str:
    """One edge a line: ``source -> target  count`` and ``cycle`` where it is on one."""
    cycle = on_cycle(edges)
    width = max((len(a) for a, _ in edges), default=0)
    return "\n".join(f"{a:<{width}} -> {b}  {n}{'  cycle' if (a, b) in cycle else ''}"
                     for (a, b), n in edges.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=".", type=pathlib.Path,
                        help="the directory that holds paged_kv/ (default: .)")
    parser.add_argument("--depth", type=int, default=2,
                        help="name parts a package keeps: 2 is paged_kv.X (default: 2)")
    parser.add_argument("--within", default="paged_kv",
                        help="draw only modules under this package (default: paged_kv)")
    parser.add_argument("--leave-out", nargs="*", default=[], metavar="PACKAGE",
                        help="packages whose edges are left out (e.g. paged_kv.errors)")
    parser.add_argument("--format", choices=("mermaid", "text"), default="mermaid")
    args = parser.parse_args()
    edges = package_graph(module_graph(args.root), args.depth, args.within,
                          tuple(args.leave_out))
    print(mermaid(edges) if args.format == "mermaid" else text(edges))


if __name__ == "__main__":
    main()
