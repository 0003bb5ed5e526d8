"""How the packages depend on each other, read from every import statement (function-local ones
included, so that none can hide a dependency): each package imports only the layers below it, and no
module imports itself back through others; and how long a module grows: under 400 lines, one concern."""

import argparse
import ast
import configparser
import importlib
import inspect
import pkgutil
import typing
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
    # the installed commands' package (fathom-train): a launch's front, above the run it starts
    "fathom": {"common", "model", "corpus", "pipeline"},
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
        f"{p.relative_to(ROOT)}: {name}"
        for p in files
        for name in imported_names(p)
        if name.split(".")[0] in ALLOWED and name.split(".")[0] != "fathom"  # fathom.X is the namespace itself
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


# Lines a module stays under: past them it holds several concerns, and splits by them.
MODULE_LINES = 400
LONGER_MODULES = {"model/norms.py": 600}  # the scheme catalogue, read and compared in one sitting


def test_every_module_is_under_400_lines():
    too_long = sorted(
        f"{name}: {lines} lines"
        for package in ALLOWED
        for path in (ROOT / package).rglob("*.py")
        if (lines := len(path.read_text().splitlines()))
        >= LONGER_MODULES.get(name := path.relative_to(ROOT).as_posix(), MODULE_LINES)
    )
    assert not too_long, "split each by concern into modules whose names say what they hold"


def run_modules() -> set[str]:
    """pipeline's top-level modules: what composes its subpackages on every rank (train, validation, ...)."""
    return {f"pipeline.{p.stem}" for p in (ROOT / "pipeline").glob("*.py") if p.stem != "__init__"}


# pipeline's subpackages, lowest first: each imports only those before it. Above them all, its top-level
# modules (run_modules) compose them on every rank.
RUN_LAYERS = ("config", "world", "engine", "parts", "reports", "checkpoint", "safety", "launch")


def run_layer(module: str) -> int:
    """Where a pipeline module stands in RUN_LAYERS; a top-level module (or the package) above them all."""
    sub = module.split(".")[1] if module.count(".") >= 1 else ""
    return RUN_LAYERS.index(sub) if sub in RUN_LAYERS else len(RUN_LAYERS)


def test_each_part_of_the_run_imports_only_the_parts_below_it():
    """The order a reader takes pipeline/ in: a subpackage that imported one above it (or a top-level module)
    would make two layers one."""
    subpackages = {p.parent.name for p in (ROOT / "pipeline").glob("*/__init__.py")}
    assert subpackages == set(RUN_LAYERS), "place each subpackage of pipeline/ in RUN_LAYERS"
    wrong = sorted(
        f"{name} imports {dep}"
        for name, deps in graph().items()
        if name.startswith("pipeline.")
        for dep in deps
        if dep.startswith("pipeline.") and run_layer(dep) > run_layer(name)
    )
    assert not wrong


def test_the_run_keeps_at_most_12_modules_at_its_top_level():
    assert len(run_modules()) <= 12, f"group them into pipeline's subpackages: {sorted(run_modules())}"


def string_constants(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string literal in `path` but docstrings, f-strings' pieces included."""
    tree = ast.parse(path.read_text())
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, documented) and ast.get_docstring(n)}
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_the_run_directorys_names_are_spelled_only_in_run_layout():
    """common/run_layout.py owns every name in a run directory: a module spelling one itself (averaging's
    avg_ tags and fathom_average.json, the reshape's .universal) would drift from the readers that find it.
    Messages may mention a name; a literal that is one, or a tag's prefix, is refused."""
    from fathom.common import run_layout

    names = {name for name in run_layout.RUN_RECORDS if "*" not in name}
    names |= {run_layout.AVERAGE_SUMMARY, run_layout.IMPORT_SUMMARY, run_layout.UNIVERSAL, run_layout.META_FILE}
    names |= {run_layout.step_tag(""), run_layout.best_tag(""), "avg_", "avg_last"}
    # copied into a run directory and run by a Python without fathom, so it cannot import run_layout
    standalone = ROOT / "pipeline" / "checkpoint" / "recovery_script.py"
    spelled = sorted(
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for package in ALLOWED
        for path in (ROOT / package).rglob("*.py")
        if path not in (ROOT / "common" / "run_layout.py", standalone)
        for line, text in string_constants(path)
        if text in names
    )
    assert not spelled, "name it by its constant in common/run_layout.py"


def test_the_names_of_a_run_s_translations_and_a_data_directory_are_spelled_once():
    """A prepared data directory's names (dict.LANG.txt in five modules, spm.model in two, the .bin and .idx.npy
    writer and reader apart) and a run's valid-stepN.txt were spelled wherever they were used: each is now
    corpus/data_layout.py's or common/run_layout.py's, and a literal (or an f-string's piece) of one elsewhere
    is refused."""
    pieces = {"dict.", "spm.model", "spm.", ".model", ".bin", ".idx.npy", "valid-step"}
    owners = {ROOT / "corpus" / "data_layout.py", ROOT / "common" / "run_layout.py"}
    spelled = sorted(
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for package in ALLOWED
        for path in (ROOT / package).rglob("*.py")
        if path not in owners
        for line, text in string_constants(path)
        if text in pieces
    )
    assert not spelled, "name it through corpus/data_layout.py or common/run_layout.py"


def deepspeed_reads(path: Path) -> list[int]:
    """Lines where `path` reads a config's DeepSpeed dict by key: `X.deepspeed[...]` or `X.deepspeed.get(...)`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        target = node.value if isinstance(node, ast.Subscript) else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            target = node.func.value
        if isinstance(target, ast.Attribute) and target.attr == "deepspeed":
            found.append(node.lineno)
    return found


def test_only_the_config_reads_deepspeed_settings_by_key():
    """Each module read DeepSpeed's dict by string key with its own default (gradient_clipping 0.0 in two, inf in
    a third; DeepSpeed applies 1.0). Outside pipeline/config/ they read RunConfig.settings' attributes."""
    config = ROOT / "pipeline" / "config"
    reads = sorted(
        f"{path.relative_to(ROOT)}:{line}"
        for package in ALLOWED
        for path in (ROOT / package).rglob("*.py")
        if config not in path.parents
        for line in deepspeed_reads(path)
    )
    assert not reads, "read cfg.settings (pipeline/config/deepspeed_settings.py), or add the setting there"


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


# Functions that read a command line, which the commands share, so they live in a library module.
COMMAND_LAYER = {
    "fathom.translation.decoding_flags.search_config": "translate's and generate's search flags into a SearchConfig",
    "fathom.translation.decoding_flags.command_line_translator": "their model flags into Translator.from_checkpoint",
    "fathom.pipeline.launch.checks.check_run": "train's flags (--config, --override), checked by train and by launch",
    "fathom.pipeline.launch.command.launched_processes": "the deepspeed runner's own flags, for launch",
    "fathom.pipeline.launch.command.launched_hosts": "the deepspeed runner's own flags, for launch",
    "fathom.pipeline.checkpoint.consolidated.check_supported": "zero_to_fp32's flags fathom refuses",
}
COMMANDS = "fathom.tools."  # benchmarks and comparisons, commands whole: only scripts/ import them (ALLOWED)


def installed_modules() -> list[str]:
    """Every module of the packages setup.cfg installs."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    packages = config["options"]["packages"].split()
    return [
        module.name
        for package in packages
        for module in pkgutil.iter_modules(importlib.import_module(package).__path__, f"{package}.")
        if not module.ispkg
    ]


def public_functions(module) -> dict[str, typing.Callable]:
    """The module's own public functions and its public classes' methods, by qualified name."""
    found = {}
    for name, value in vars(module).items():
        if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(value):
            found[f"{module.__name__}.{name}"] = value
        elif inspect.isclass(value):
            for method_name, method in vars(value).items():
                method = getattr(method, "__func__", method)  # classmethods and staticmethods
                if inspect.isfunction(method) and (method_name == "__init__" or not method_name.startswith("_")):
                    found[f"{module.__name__}.{name}.{method_name}"] = method
    return found


def takes_a_command_line(function: typing.Callable) -> bool:
    """Whether a parameter is annotated argparse.Namespace, alone or in a union (Namespace | None, Namespace |
    dict: the latter passed before), string annotations resolved in the function's module; one naming what
    only a type checker imports stays a string."""
    for parameter in inspect.signature(function).parameters.values():
        hint = parameter.annotation
        if isinstance(hint, str):
            try:
                hint = eval(hint, function.__globals__)
            except NameError:
                pass
        if argparse.Namespace in (hint, *typing.get_args(hint)) or (isinstance(hint, str) and "Namespace" in hint):
            return True
    return False


def test_no_library_function_takes_a_command_line():
    """Commands parse their flags and call typed functions, so Python callers (notebooks, the study, the
    benchmarks) need no argv or Namespace; only `main` and the command layer above read one, and each
    entry there still does (a renamed one would otherwise leave a hole)."""
    taking = {
        name
        for module in installed_modules()
        if not module.startswith(COMMANDS)
        for name, function in public_functions(importlib.import_module(module)).items()
        if takes_a_command_line(function)
    }
    offenders = sorted(name for name in taking - COMMAND_LAYER.keys() if name.rsplit(".", 1)[-1] != "main")
    assert not offenders, "take typed arguments; parse the flags in main: " + ", ".join(offenders)
    assert not sorted(COMMAND_LAYER.keys() - taking), "no longer reads a command line: drop it from COMMAND_LAYER"
