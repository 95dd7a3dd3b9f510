"""The package's modules import each other without a circle.

Every import counts: top-level ones, the ones inside functions, and module names given
as strings (the CLI imports its subcommands by name). An edge a -> b means a imports b;
a circle means two concepts that should be one module, or a shared piece that belongs
in a third.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Where each installed package's sources live (pyproject.toml's package-dir).
PACKAGE_DIRS = {"dflash_mlx": REPO / "dflash_mlx", "dflash_mlx.tui": REPO / "tui", "dflash_mlx.metal": REPO / "metal"}


def package_modules():
    modules = {}
    for prefix, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([prefix, *parts])] = path
    return modules


def _owning_module(name, modules):
    """`dflash_mlx.models.draft.dflash.DraftConfig` -> `dflash_mlx.models.draft.dflash`; None outside the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imported_names(module, path, modules):
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    parent = parent.rpartition(".")[0]
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                full = f"{base}.{alias.name}"
                yield full if full in modules else base
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
            if node.value in modules:  # importlib.import_module("dflash_mlx.x"), tables of module names
                yield node.value


def import_graph():
    modules = package_modules()
    graph = {}
    for module, path in modules.items():
        targets = {_owning_module(name, modules) for name in imported_names(module, path, modules)}
        graph[module] = sorted(t for t in targets if t and t != module)
    return graph


def find_cycle(graph):
    """One import circle as a list of modules (first == last), or None."""
    state = {}  # module -> "open" while on the DFS stack, "done" after
    stack = []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for dep in graph.get(module, ()):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_the_walker_sees_every_kind_of_import():
    graph = import_graph()
    assert "dflash_mlx.models.draft.dflash" in graph["dflash_mlx.models.draft.dflash2"]  # top level
    assert "dflash_mlx.models.loading" in graph["dflash_mlx"]  # inside a function (load)
    assert "dflash_mlx.serve.cli" in graph["dflash_mlx.cli.main"]  # a module name in a string
    assert "dflash_mlx.tui.cli" in graph["dflash_mlx.cli.main"]  # installed from tui/


def test_find_cycle_reports_a_circle():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": ["c"], "c": []}) is None


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# The ladder, top to bottom: a module may import from its own floor or any floor below,
# never from one above. Each entry is a module or a package prefix (the longest prefix wins).
FLOORS = [
    # front ends, and what stands beside them: the public facade, benchmarks, training, test doubles
    ("dflash_mlx", "dflash_mlx.cli", "dflash_mlx.serve", "dflash_mlx.tui", "dflash_mlx.bench",
     "dflash_mlx.train", "dflash_mlx.testing"),
    ("dflash_mlx.generate",),
    ("dflash_mlx.engine",),
    ("dflash_mlx.policy",),
    ("dflash_mlx.speculation",),
    ("dflash_mlx.models",),
    ("dflash_mlx.kernels", "dflash_mlx.metal"),
    ("dflash_mlx.identity", "dflash_mlx.options", "dflash_mlx.blas", "dflash_mlx.progress",
     "dflash_mlx.tool_calls", "dflash_mlx.requirements", "dflash_mlx.user_cache"),
]


def floor_of(module):
    """The floor index of a module (0 = top), from the longest matching prefix; None if unplaced."""
    best, best_len = None, -1
    for index, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def imports_up(graph):
    """Every edge a -> b where b sits on a higher floor than a."""
    return [(a, b) for a, deps in sorted(graph.items()) for b in deps if floor_of(b) < floor_of(a)]


def test_every_module_has_a_floor():
    unplaced = [m for m in import_graph() if floor_of(m) is None]
    assert not unplaced, f"modules on no floor of FLOORS: {unplaced}"


def test_imports_up_are_found():
    graph = {"dflash_mlx.models.loading": ["dflash_mlx.engine.cycle"], "dflash_mlx.engine.cycle": ["dflash_mlx.models.loading"]}
    assert imports_up(graph) == [("dflash_mlx.models.loading", "dflash_mlx.engine.cycle")]
    assert floor_of("dflash_mlx.generate") == 1 and floor_of("dflash_mlx") == 0


def test_no_import_runs_back_up_the_ladder():
    up = imports_up(import_graph())
    assert not up, "imports running back up the ladder:\n" + "\n".join(f"  {a} -> {b}" for a, b in up)
