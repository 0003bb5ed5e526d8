"""fathom as an installed package: one `fathom` namespace that files in the working directory cannot
shadow, the fairseq-style commands setup.cfg declares, and the configs it ships."""

import configparser
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fathom.common.cli import versions
from fathom.common.errors import ConfigError
from fathom.pipeline.config.run_config import config_file, load_config
from tests.helpers import ROOT

# What a working directory may hold: nanoGPT's model.py, a project's common.py and tools/ package.
SHADOWS = {"model.py": "", "common.py": "", "tools/__init__.py": "", "pipeline/__init__.py": ""}
BROKEN = "raise ImportError('the working directory was imported instead of fathom')\n"


def console_scripts() -> dict[str, str]:
    """setup.cfg's commands: name -> module:function."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(tuple(part.strip() for part in line.split("=")) for line in lines)


def shadowing_directory(root: Path) -> Path:
    for name in SHADOWS:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(BROKEN)
    return root


def test_each_script_is_a_command():
    """Every script users run has its command (the benchmarks and the fairseq set-up excepted)."""
    targets = {target.split(":")[0] for target in console_scripts().values()}
    for script in ("prepare_data", "train", "launch", "generate", "translate", "convert_to_fairseq",
                   "convert_from_fairseq", "average_checkpoints", "estimate_memory", "depth_study", "list_schemes",
                   "zero_to_fp32"):  # fmt: skip
        text = (ROOT / "scripts" / f"{script}.py").read_text()
        assert any(f"from {module} import main" in text for module in targets), f"scripts/{script}.py has no command"


@pytest.mark.slow
def test_every_command_runs_beside_files_named_like_fathoms_folders(tmp_path):
    """From a directory outside the repository holding a model.py, a common.py and tools/ and pipeline/
    packages (each raising if imported), every installed command answers --version, and the modules
    import as `python -c` imports them (the working directory first on sys.path, as in a notebook)."""
    cwd = shadowing_directory(tmp_path)
    where = os.pathsep.join([sysconfig.get_path("scripts"), os.environ["PATH"]])  # pip's place for this Python
    for name in console_scripts():
        command = shutil.which(name, path=where)
        assert command, f"{name} is not installed; pip install -e . installs the commands"
        result = subprocess.run([command, "--version"], cwd=cwd, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{name}: {result.stderr[-2000:]}"
        assert result.stdout.strip().splitlines()[-1] == versions(), name  # after DeepSpeed's accelerator line
    code = "; ".join(f"import {target.split(':')[0]}" for target in console_scripts().values())
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_shipped_config_is_found_by_name_where_no_such_file_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_file("default") == config_file("default.json") == ROOT / "ds_configs" / "default.json"
    assert load_config("default", world_size=2) == load_config(ROOT / "ds_configs" / "default.json", world_size=2)
    (tmp_path / "default.json").write_text("{}")
    assert config_file("default.json") == Path("default.json")  # a file of that name comes first


def test_an_unknown_config_name_lists_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"defualt: no such config; .* by name: .*\bdefault\b.*multi30k_deen") as err:
        load_config("defualt")
    assert "study_multi30k," not in str(err.value)  # a study's spec is no training config
