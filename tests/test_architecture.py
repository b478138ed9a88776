"""The shape of the package, checked from its source: module and function sizes, the import
graph, the facade's surface, and owners' privacy (see docs/architecture.md)."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

from paged_kv import PagedKVCache

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "paged_kv"
MODULES = sorted(PACKAGE.rglob("*.py"))
# complexity, not documentation: both limits count code lines (no blank, comment or
# docstring line), so a why-comment or a numpydoc section never pushes a module over
MAX_MODULE_CODE_LINES = 300
MAX_FUNCTION_CODE_LINES = 40


def _name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _is_triton_kernel(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def _docstring_lines(node: ast.AST) -> set[int]:
    """Line numbers of the docstring of `node` (a module, class or function), if any."""
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str):
        return set(range(first.lineno, first.end_lineno + 1))
    return set()


def _code_lines(node: ast.AST, source: list[str], skip: set[int] | None = None) -> int:
    """Lines of `node` that are neither blank, comments nor a docstring (its own, or any in
    `skip`)."""
    skip = _docstring_lines(node) if skip is None else skip
    lines = range(getattr(node, "lineno", 1), getattr(node, "end_lineno", len(source)) + 1)
    return sum(1 for n in lines if n not in skip and source[n - 1].strip()
               and not source[n - 1].strip().startswith("#"))


def module_code_lines(path: pathlib.Path) -> int:
    """A module's code lines: every docstring (module, classes, functions) left out."""
    tree = _tree(path)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstrings |= _docstring_lines(node)
    return _code_lines(tree, path.read_text().splitlines(), docstrings)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _name(p))
def test_module_size(path):
    lines = module_code_lines(path)
    assert lines <= MAX_MODULE_CODE_LINES, \
        f"{_name(path)} has {lines} code lines (limit {MAX_MODULE_CODE_LINES}): split it"


def test_code_lines_leave_out_docstrings_comments_and_blanks(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Doc\n\nmore."""\n\nimport os  # why\n\n\nclass A:\n    """Doc."""\n\n'
                      '    def f(self):\n        """Doc\n        on two lines."""\n'
                      '        # a comment\n        return os.sep\n')
    assert module_code_lines(module) == 4  # import, class, def, return


def test_function_size():
    too_long = []
    for path in MODULES:
        source = path.read_text().splitlines()
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) \
                    and not _is_triton_kernel(node):
                size = _code_lines(node, source)
                if size > MAX_FUNCTION_CODE_LINES:
                    too_long.append(f"{_name(path)}:{node.lineno} {node.name} ({size})")
    assert not too_long, f"functions over {MAX_FUNCTION_CODE_LINES} code lines: {too_long}"


def _imports(path: pathlib.Path) -> set[str]:
    """paged_kv modules `path` imports, counting imports under TYPE_CHECKING and inside
    functions; a package's ``__init__`` re-exports are followed to the module named."""
    here = _name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                found.add(f"{module}.{alias.name}")
                found.add(module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    known = {_name(p) for p in MODULES}
    return {m for m in found if m in known and m != _name(path)}


def test_no_import_cycle():
    graph = {_name(p): _imports(p) for p in MODULES}
    # an edge into a package's __init__ is a re-export, not a dependency of its own
    packages = {_name(p) for p in MODULES if p.name == "__init__.py"}
    graph = {m: {d for d in deps if d not in packages} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for dep in graph[module]:
            if state.get(dep) == 1:
                cycle = [*trail[trail.index(dep):], dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, [*trail, dep])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_facade_surface():
    public = [n for n, _ in inspect.getmembers(PagedKVCache) if not n.startswith("_")]
    # 25: `groups` (the layer groups, one for a uniform model) replaced probing; 26:
    # `commit_admission` commits the plan a scheduler made instead of planning it again;
    # 29: a recurrent layer's states (`states`, `read_states`, `write_states`) beside K/V;
    # 30: `state_group`, whose checkpoints the tiers and the hand-off move
    assert len(public) <= 30, f"PagedKVCache has {len(public)} public names: {public}"


def test_no_module_probes_the_cache_for_groups():
    """`PagedKVCache.groups` is always there (one group for a uniform layout): a module that
    probes for it (``getattr(cache, "groups", ...)``, ``hasattr``) reads a layout the
    facade already states."""
    probes = [f"{_name(path)}:{node.lineno}" for path in MODULES
              for node in ast.walk(_tree(path))
              if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr",
                                                                                 "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value == "groups"]
    assert not probes, f"probing for the cache's groups: {probes}"


# other libraries' names that start with an underscore: transformers' attributes the
# integration reads, argparse's subparsers type in annotations, and the standard library's
# documented os._exit and namedtuple._replace
FOREIGN_PRIVATE = {"_attn_implementation", "_cached_continuous_batching_manager",
                   "_SubParsersAction", "_exit", "_replace"}


def test_no_private_reach_in():
    """No module reads a ``_private`` attribute that no class of its own defines: owners
    talk through public names (a module's helpers may read its own classes' state)."""
    bad = []
    for path in MODULES:
        tree = _tree(path)
        own = _private_names(tree) | FOREIGN_PRIVATE
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") and node.attr not in own:
                bad.append(f"{_name(path)}:{node.lineno} {ast.unparse(node)}")
    assert not bad, f"reads of another module's private attributes: {bad}"


def _private_names(tree: ast.Module) -> set[str]:
    """Private methods and attributes the classes of a module define."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign | ast.Assign):  # dataclass fields, class attrs
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if n.startswith("_")}


# -- the facade's rule: the owners it exposes are read outside the core, never mutated --------
# The core is the package `paged_kv.core`: the facade, the owners, the step and the layer
# groups, which change the owners by design.
CORE = "paged_kv.core"
# the owners' public methods that only read; every other public method is a mutator, so a
# new one is caught without this list changing
OWNER_QUERIES = {
    "allocator": {"count_cached", "can_allocate", "block_hash", "lookup", "match", "snapshot",
                  "check_invariants", "obtainable"},
    "tables": {"rows_of", "resolve_rows", "chains", "chain", "root", "ahead", "rows", "check",
               "blocks", "num_tokens_of", "owners", "snapshot", "plan_decode"},
}


def _owner_mutators() -> dict[str, set[str]]:
    """``{"allocator": ..., "tables": ...}``: the public methods of `BlockAllocator` and
    `PageTables` that are not queries (properties are reads: they cannot be called)."""
    from paged_kv import BlockAllocator, PageTables

    mutators = {}
    for owner, cls in (("allocator", BlockAllocator), ("tables", PageTables)):
        methods = {name for name, member in vars(cls).items()
                   if inspect.isfunction(member) and not name.startswith("_")}
        mutators[owner] = methods - OWNER_QUERIES[owner]
    return mutators


def _is_core(module: str) -> bool:
    return module == CORE or module.startswith(f"{CORE}.")


def owner_mutations(tree: ast.Module, mutators: dict[str, set[str]]) -> list[str]:
    """Calls of an owner's mutator on ``<expr>.allocator`` / ``<expr>.tables``, or on a
    name bound to one (``allocator = cache.allocator``), in `tree`."""
    aliases: dict[str, str] = {}  # local name -> owner
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
            if len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple) \
                    and isinstance(node.value, ast.Tuple):
                pairs = list(zip(node.targets[0].elts, node.value.elts, strict=False))
            for target, value in pairs:
                if isinstance(target, ast.Name) and isinstance(value, ast.Attribute) \
                        and value.attr in mutators:
                    aliases[target.id] = value.attr
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        target = node.func.value
        owner = (target.attr if isinstance(target, ast.Attribute)
                 else aliases.get(target.id) if isinstance(target, ast.Name) else None)
        if owner in mutators and node.func.attr in mutators[owner]:
            found.append(f"{node.lineno}: {ast.unparse(node.func)}")
    return found


def test_owners_are_mutated_only_through_the_facade():
    """`cache.allocator` and `cache.tables` say "read it; mutate only through the cache":
    outside the core, no module calls a mutator of either."""
    mutators = _owner_mutators()
    assert {"free", "allocate", "take_events", "register"} <= mutators["allocator"]
    assert {"commit_decode", "extend_row", "add"} <= mutators["tables"]
    bad = [f"{_name(path)}:{where}" for path in MODULES if not _is_core(_name(path))
           for where in owner_mutations(_tree(path), mutators)]
    assert not bad, f"owner mutations outside the core (add a facade operation): {bad}"


def test_owner_mutation_check_finds_direct_and_aliased_calls():
    source = ("def f(cache, x):\n"
              "    cache.allocator.num_free_blocks, cache.tables.blocks(x)\n"
              "    self.cache.allocator.take_events()\n"
              "    allocator, n = cache.allocator, 1\n"
              "    allocator.free(x)\n"
              "    tables = self.cache.tables\n"
              "    tables.commit_decode(x, None, None)\n"
              "    return cache.allocator.can_allocate(n)\n")
    found = owner_mutations(ast.parse(source), _owner_mutators())
    assert found == ["3: self.cache.allocator.take_events", "5: allocator.free",
                     "7: tables.commit_decode"]


# -- floors: each package imports only from its own floor or the ones below ----------------
# (the longest prefix names a module's floor; docs/architecture.md draws them)
FLOORS = {
    # 0, the base: shapes, errors, keys, kernels, policies and the parts' interface
    "paged_kv.errors": 0, "paged_kv.config": 0, "paged_kv.layer_kinds": 0, "paged_kv.keys": 0,
    "paged_kv._checks": 0,
    "paged_kv.kernels": 0, "paged_kv.tenants": 0, "paged_kv.parts": 0,
    # 1-4, the cache core: owners, then the step over them, then layer groups, then the facade
    "paged_kv.core": 1, "paged_kv.core.step": 2, "paged_kv.core.groups": 3,
    "paged_kv.core.cache": 4, "paged_kv.core.admission": 4,
    # 5, what sits on the cache: tiers, KV events, the hand-off, the transformers integration
    "paged_kv.tiers": 5, "paged_kv.events": 5, "paged_kv.handoff": 5, "paged_kv.integrations": 5,
    # 6, the engine (scheduler, runner, model, its process and clients); 7, the HTTP server
    "paged_kv.engine": 6, "paged_kv.server": 7,
    # 8, the router over servers; 9, the tools and the package's own re-exports
    "paged_kv.router": 8, "paged_kv.bench": 9, "paged_kv.demo": 9, "paged_kv.cli": 9,
    "paged_kv": 9,
}


def floor_of(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in FLOORS:
            return FLOORS[".".join(parts[:end])]
    raise AssertionError(f"{module} has no floor: add it to FLOORS")


def test_no_import_runs_back_up():
    """A module imports from its own floor or lower ones: the core never reaches the engine,
    the engine never the HTTP server, an owner never the step that drives it."""
    # a package's own floor counts (``from ..engine import Engine`` in the core climbs); the
    # root package's ``from .. import kernels`` names a module, not its re-exports
    up = [f"{_name(path)} -> {dep}" for path in MODULES for dep in _imports(path)
          if dep != "paged_kv" and floor_of(dep) > floor_of(_name(path))]
    assert not up, f"imports from a higher floor: {up}"


def test_every_floor_is_named():
    assert all(floor_of(_name(path)) >= 0 for path in MODULES)
    assert floor_of("paged_kv.core.step.plan") == 2 and floor_of("paged_kv.core.allocator") == 1


def test_the_allocator_imports_nothing_from_tenants():
    """The allocator calls its eviction policy's interface (`paged_kv.core.eviction`) and
    never asks which policy it holds: it imports nothing from `paged_kv.tenants` (the tenant
    ledger is one policy, built by `paged_kv.tenants.eviction_for`) and tests nothing of
    tenants or ledgers; the default policy beside it imports only the ghost list, the miss
    memory every policy keeps."""
    def from_tenants(module: str) -> list[str]:
        return sorted(d for d in _imports(PACKAGE / "core" / f"{module}.py")
                      if d == "paged_kv.tenants" or d.startswith("paged_kv.tenants."))

    assert not from_tenants("allocator"), \
        f"the allocator imports from tenants: {from_tenants('allocator')}"
    assert set(from_tenants("eviction")) <= {"paged_kv.tenants.ghost"}, \
        f"the default eviction policy imports tenant logic: {from_tenants('eviction')}"
    tests = [ast.unparse(node.test) for node in ast.walk(_tree(PACKAGE / "core" / "allocator.py"))
             if isinstance(node, ast.If | ast.IfExp | ast.While)]
    branches = [test for test in tests if "tenant" in test.lower() or "ledger" in test.lower()]
    assert not branches, f"the allocator branches on tenants: {branches}"
