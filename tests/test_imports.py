"""How the packages depend on each other, read from every import statement (function-local ones
included, so that none can hide a dependency): each package imports only the layers below it, and no
module imports itself back through others."""

import ast
from pathlib import Path

from tests.helpers import ROOT

# Each package may import those listed for it, and nothing else of fathom's.
ALLOWED = {
    "common": set(),
    "model": {"common"},
    "corpus": {"common", "model"},
    "pipeline": {"common", "model", "corpus"},
    "translation": {"common", "model", "corpus"},
    "convert": {"common", "model", "corpus", "pipeline"},  # export runs the trained layers as the pipeline did
    "study": {"common", "model", "corpus", "pipeline", "translation"},
    "planner": {"common", "model", "corpus", "pipeline"},
    "tools": {"common", "model", "corpus", "pipeline", "translation", "convert", "study", "planner"},
    "scripts": {"common", "model", "corpus", "pipeline", "translation", "convert", "study", "planner", "tools"},
}
PACKAGES = (*ALLOWED, "tests")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> set[str]:
    """Every module and name `path` imports, at any depth of its code, as written."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def imports(path: Path) -> set[str]:
    """Every fathom module `path` imports, named without the `fathom.` namespace."""
    names = {name.removeprefix("fathom.") for name in imported_names(path)}
    return {name for name in names if name.split(".")[0] in PACKAGES}


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for package in ALLOWED for p in (ROOT / package).rglob("*.py")}
    return {name: {m for m in imports(path) if m in files and m != name} for name, path in files.items()}


def test_each_package_imports_only_the_layers_below_it():
    wrong = sorted(
        f"{name} imports {dep}"
        for name, deps in graph().items()
        for dep in deps
        if dep.split(".")[0] != name.split(".")[0] and dep.split(".")[0] not in ALLOWED[name.split(".")[0]]
    )
    assert not wrong


def test_every_import_of_fathom_goes_through_its_namespace():
    files = [p for folder in (*ALLOWED, "tests") for p in (ROOT / folder).rglob("*.py")]
    bare = {
        f"{p.relative_to(ROOT)}: {name}" for p in files for name in imported_names(p) if name.split(".")[0] in ALLOWED
    }
    assert not sorted(bare), (
        "import them as fathom.PACKAGE: a model.py or another distribution's tools/ shadows bare names"
    )


def test_no_shipped_module_imports_the_tests():
    files = [p for package in ALLOWED for p in (ROOT / package).rglob("*.py")]
    assert not [str(p) for p in files if any(m.split(".")[0] == "tests" for m in imports(p))]


def test_only_tools_find_the_repository():
    """common.repo is where the clone is; an installed wheel has none, so what users run must not need it."""
    needing = [name for name, deps in graph().items() if "common.repo" in deps and name.split(".")[0] != "tools"]
    assert not sorted(needing), "find configs by name (config_file) and launch modules (python -m fathom...)"


def test_no_module_imports_itself_back_through_others():
    deps, cycles, state = graph(), [], {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(deps[name]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[name] = "done"

    for name in sorted(deps):
        if name not in state:
            visit(name, [name])
    assert not cycles
