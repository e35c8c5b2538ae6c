"""The library's packages form layers: no cycle between them, and the shared value types sit below everything.

Between packages, only imports that run when a module is imported count (those at module level, outside
``if TYPE_CHECKING``); an import inside a function is a deliberate late dependency (torch only when a job runs, say).
Between modules, late imports count too: a module that imports another only inside a function still needs it, so no
circle of modules may close that way either."""

from __future__ import annotations

import ast
import re
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "shared" / "edgeswarm"


def package_of(path: Path) -> str:
    """The layer of a module: its sub-package under edgeswarm, or the module's own name at the top."""
    rel = path.relative_to(LIBRARY)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_layers(path: Path, *, late: bool = False) -> set[str]:
    """The layers ``path`` imports at module level (``late``: anywhere, in functions and for type checking too)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree) if late else tree.body:
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module == "edgeswarm" and node.level == 0:
            names = [f"edgeswarm.{alias.name}" for alias in node.names]  # from edgeswarm import topics
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "edgeswarm" and len(parts) > 1:
                out.add(parts[1])
    return out


def layer_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in LIBRARY.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == LIBRARY:
            continue
        layer = package_of(path)
        graph.setdefault(layer, set()).update(imported_layers(path) - {layer})
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_package_imports_itself_back_through_another() -> None:
    found = cycle(layer_graph())
    assert found is None, "import cycle between packages: " + " -> ".join(found or [])


def module_name(path: Path) -> str:
    rel = path.relative_to(LIBRARY.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def module_graph() -> dict[str, set[str]]:
    """Every module of the library and the library modules it imports anywhere (in functions too), except under
    ``if TYPE_CHECKING``. ``from a.b import c`` is an import of module ``a.b.c`` when there is one, else of ``a.b``."""
    paths = {module_name(p): p for p in LIBRARY.rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(inner) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for stmt in node.body for inner in ast.walk(stmt)}
        out: set[str | None] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and \
                    (node.module == "edgeswarm" or (node.module or "").startswith("edgeswarm.")):
                out.update(known(f"{node.module}.{alias.name}") for alias in node.names)
            elif isinstance(node, ast.Import):
                out.update(known(alias.name) for alias in node.names if alias.name.startswith("edgeswarm."))
        graph[name] = {m for m in out if m is not None and m != name}
    return graph


def test_no_module_imports_itself_back_through_others_not_even_late() -> None:
    graph = module_graph()
    assert "edgeswarm.messages.jobs" in graph and "edgeswarm.local.forkserver" in graph["edgeswarm.local.launcher"]
    found = cycle(graph)
    assert found is None, "import cycle between modules (late imports included): " + " -> ".join(found or [])


def test_a_message_schema_does_not_depend_on_the_installed_kinds() -> None:
    """The wire layer carries a job's plan and progress as data; the workload registry parses them."""
    for path in (LIBRARY / "messages").rglob("*.py"):
        assert "workloads" not in imported_layers(path, late=True), path.name


def test_the_value_types_sit_below_everything() -> None:
    graph = layer_graph()
    assert graph["values"] <= {"errors", "wire"}, graph["values"]
    assert graph["messages"] <= {"errors", "wire", "values", "planning"}, graph["messages"]
    # extras only names a missing optional package (the plan renderer's matplotlib); it imports errors alone.
    assert graph["extras"] <= {"errors"}, graph["extras"]
    assert graph["planning"] <= {"errors", "extras", "values", "wire"}, graph["planning"]


def test_the_cycle_finder_finds_one() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_workload_package_imports_another() -> None:
    """What workloads share sits below them (runtime, state, data, models, planning): a workload's package never
    imports another's, not even late."""
    from edgeswarm.workloads import BUILTIN

    packages = {target.split(":")[0].split(".")[1] for target in BUILTIN.values()}
    assert len(packages) == len(BUILTIN), "each built-in kind has a package of its own"
    for package in packages:
        for path in (LIBRARY / package).rglob("*.py"):
            others = imported_layers(path, late=True) & (packages - {package})
            assert not others, f"{path.relative_to(LIBRARY)} imports the workload package(s) {sorted(others)}"


def doc_layers() -> list[set[str]]:
    """The packages of each row of docs/architecture.md's layer table, top row first."""
    page = (LIBRARY.parents[1] / "docs" / "architecture.md").read_text()
    table = page.split("| layer | packages | what they hold |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    layers = []
    for row in rows:
        column = row.split(" | ")[1]
        for _ in range(3):  # what a parenthesis says of a package (its kinds, its sub-packages) names no package
            column = re.sub(r"\([^()]*\)", "", column)
        layers.append(set(re.findall(r"`([a-z_]+)`", column)))
    return layers


def test_every_package_of_the_library_is_in_the_architecture_pages_layer_table() -> None:
    named = set().union(*doc_layers())
    on_disk = {p.name for p in LIBRARY.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | \
        {p.stem for p in LIBRARY.glob("*.py") if not p.stem.startswith("__")}
    assert on_disk - named == set(), f"docs/architecture.md's layer table leaves out {sorted(on_disk - named)}"
    assert named - on_disk <= {"services"}, f"the table names packages that do not exist: {sorted(named - on_disk)}"


def test_no_module_imports_from_a_layer_above_its_own_not_even_late() -> None:
    """Each package imports only from its own row of the layer table or the rows below it."""
    row = {package: i for i, layer in enumerate(doc_layers()) for package in layer}
    assert row["cli"] < row["workloads"] < row["bus"] < row["values"]
    upward = []
    for importer, targets in module_graph().items():
        if importer.count(".") == 0 or importer == "edgeswarm.__main__":
            continue  # the package's own entry points
        mine = importer.split(".")[1]
        upward += [f"{importer} -> {t}" for t in sorted(targets) if "." in t and row[t.split(".")[1]] < row[mine]]
    assert not upward, "imports from a higher layer: " + "; ".join(upward)


def _workload_packages() -> set[str]:
    from edgeswarm.workloads import BUILTIN

    return {target.split(":")[0].split(".")[1] for target in BUILTIN.values()}


def test_only_a_workload_package_imports_itself_the_command_line_and_services_included() -> None:
    """The command line, the benchmarks, the services and every common layer reach a kind through the registry
    (its hooks: commands, benches, plan_cli, infer_cli, train_cli), never by importing its package, not even late."""
    packages = _workload_packages()
    services = LIBRARY.parents[1] / "services"
    for path in [*LIBRARY.rglob("*.py"), *services.rglob("*.py")]:
        rel = path.relative_to(LIBRARY) if path.is_relative_to(LIBRARY) else None
        own = rel.parts[0] if rel is not None and len(rel.parts) > 1 else None
        reached = imported_layers(path, late=True) & (packages - {own})
        assert not reached, f"{path} imports the workload package(s) {sorted(reached)}"


def test_no_isinstance_on_a_kinds_spec_outside_its_package() -> None:
    from edgeswarm.workloads import BUILTIN, workload

    specs = {workload(kind).spec_type.__name__: target.split(":")[0].split(".")[1] for kind, target in BUILTIN.items()}
    found = []
    for path in LIBRARY.rglob("*.py"):
        rel = path.relative_to(LIBRARY)
        own = rel.parts[0] if len(rel.parts) > 1 else None
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                    and len(node.args) == 2:
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                found += [f"{rel}: isinstance on {name}" for name in named if name in specs and specs[name] != own]
    assert not found, found


def test_every_built_in_workload_package_has_the_role_files_each_saying_its_role() -> None:
    """The same role, the same file name, in every workload package (docs/adding-a-workload.md); each module's
    docstring opens with what it is."""
    roles = {"spec", "planner", "coordinator", "worker", "compute", "workload", "bench"}
    for package in _workload_packages():
        files = {p.stem: p for p in (LIBRARY / package).glob("*.py")}
        assert roles <= set(files), f"{package} lacks {sorted(roles - set(files))}"
        for name, path in files.items():
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and doc.strip(), f"{package}/{name}.py has no docstring saying its role"
