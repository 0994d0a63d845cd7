"""The package's shape: floors, each importing only from the floors below it, and no import cycle among workbench's
modules, counting the imports inside functions too (a new one fails here, with the import that breaks the rule).
Imports inside functions load heavy libraries late; one that climbs a floor or closes a circle would only hide
that a function lives in the wrong module."""

import ast

from conftest import ROOT

PACKAGE = ROOT / "workbench"


def module_names() -> dict[str, object]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path, modules: dict) -> set[str]:
    """The package's modules that `name` imports anywhere in its code (at module level and inside functions; not
    under `if TYPE_CHECKING:`, which never runs)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []  # type-only imports
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {target for target in found if target in modules and target != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph[node]):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def test_no_import_cycle_even_through_imports_inside_functions():
    modules = module_names()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 30 and any(graph.values())  # the walk sees the package
    assert "workbench.model.lm_loss" in graph["workbench.estimator.memory"]  # ... and the imports inside functions
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# From the ground up (docs/architecture.md draws them). A module imports from its own floor and the floors below.
FLOORS = ("base", "spec", "hardware", "rundir", "data", "model", "estimator", "distributed", "training", "outputs",
          "frontends")
# The package's own doors, above every floor: the lazy public API and `python -m workbench`.
DOORS = {"workbench", "workbench.__main__"}


def floor_of(name: str) -> int:
    return len(FLOORS) if name in DOORS else FLOORS.index(name.split(".")[1])


def climbs(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                  if floor_of(target) > floor_of(name))


def test_every_module_sits_on_a_floor():
    loose = [name for name in module_names() if name not in DOORS and name.split(".")[1] not in FLOORS]
    assert not loose, f"modules outside the floors (move each into one of {FLOORS}): {loose}"
    assert {name.split(".")[1] for name in module_names() if name not in DOORS} == set(FLOORS)  # no empty floor


def test_no_module_imports_from_a_floor_above_its_own():
    modules = module_names()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert "workbench.spec.recipe" in graph["workbench.data.tokens"]  # the walk sees imports across floors
    assert climbs(graph) == []


def test_the_floor_check_finds_a_climb():
    graph = {"workbench.spec.recipe": {"workbench.training.session"}, "workbench.training.session": {"workbench.spec.recipe"}}
    assert climbs(graph) == ["workbench.spec.recipe -> workbench.training.session"]


def objective_names_outside_the_registry() -> list[str]:
    """Places outside the objective registry (and the losses keyed by it) that compare with an objective's name or
    key a table by one: each is a question the registry should answer."""
    from workbench.spec.objectives import OBJECTIVE_NAMES

    allowed = {PACKAGE / "spec" / "objectives.py", PACKAGE / "training" / "objectives.py",
               PACKAGE / "training" / "losses.py"}
    found = []
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "ui").rglob("*.py")]:
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Compare):
                names = [n for part in node.comparators + [node.left] for n in ast.walk(part)]
            elif isinstance(node, ast.Dict):
                names = node.keys
            if any(isinstance(n, ast.Constant) and n.value in OBJECTIVE_NAMES for n in names if n is not None):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_objectives_are_asked_of_their_registry_not_compared_by_name():
    assert objective_names_outside_the_registry() == []


def test_device_questions_are_asked_of_hardware():
    """Which device, how many, how much memory: workbench/hardware/ answers, so a new kind of device is one place."""
    asking = [f"{path.relative_to(ROOT)}:{node.lineno}"
              for path in [*PACKAGE.rglob("*.py"), *(ROOT / "ui").rglob("*.py")] if "hardware" not in path.parts
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Attribute) and ast.unparse(node).startswith(("torch.cuda.", "torch.xpu."))]
    assert asking == []


HEAVY_LIBRARIES = {"torch", "transformers", "peft", "accelerate", "datasets", "matplotlib", "deepspeed", "trl",
                   "bitsandbytes", "safetensors", "gradio", "pandas", "ray"}


def top_level_imports(path) -> set[str]:
    """The top-level packages a module imports at module level (not inside functions or `if TYPE_CHECKING:`)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module)
    return found


def heavy_libraries_of(name: str, modules: dict, graph: dict, seen=None) -> set[str]:
    """The heavy libraries that importing a module of the package loads (through module-level imports)."""
    seen = set() if seen is None else seen
    if name in seen:
        return set()
    seen.add(name)
    found = {module.split(".")[0] for module in top_level_imports(modules[name])} & HEAVY_LIBRARIES
    for target in graph[name]:
        found |= heavy_libraries_of(target, modules, graph, seen)
    return found


def deferred_project_imports() -> list[str]:
    """Imports of the package's own modules inside functions that defer nothing: the imported module loads no heavy
    library that the importer does not load already. The front ends' commands load their floors when they
    run (the CLI answers Ctrl-C and --help before any heavy import) and may defer as they need."""
    modules = module_names()
    top = {name: {t for t in top_level_imports(path) if t in modules or t.rpartition(".")[0] in modules}
           for name, path in modules.items()}
    top = {name: {t if t in modules else t.rpartition(".")[0] for t in targets} for name, targets in top.items()}
    found = []
    for name, path in modules.items():
        if name.startswith("workbench.frontends.") or name in DOORS:
            continue
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("workbench"):
                    target = node.module if node.module in modules else node.module.rpartition(".")[0]
                    deferred = heavy_libraries_of(target, modules, top) - heavy_libraries_of(name, modules, top)
                    if not deferred:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}")
    return sorted(set(found))


def test_project_modules_are_imported_inside_functions_only_to_defer_a_heavy_library():
    assert deferred_project_imports() == []
