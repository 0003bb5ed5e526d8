"""fathom as an installed package: one `fathom` namespace that files in the working directory cannot
shadow, the fairseq-style commands setup.cfg declares, and the configs it ships."""

import configparser
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fathom.common.cli import versions
from fathom.common.errors import ConfigError
from fathom.pipeline.config.config_file import config_file
from fathom.pipeline.config.run_config import load_config
from tests.helpers import ROOT, free_port

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
                   "convert_from_fairseq", "average_checkpoints", "estimate_memory", "plan_cluster", "depth_study",
                   "list_schemes", "zero_to_fp32"):  # fmt: skip
        text = (ROOT / "scripts" / f"{script}.py").read_text()
        assert any(f"from {module} import main" in text for module in targets), f"scripts/{script}.py has no command"


def wheel_environment(tmp_path: Path) -> Path:
    """A virtualenv holding fathom's wheel, built from this checkout as `python -m build` builds it (the
    sdist, then the wheel from it). torch and DeepSpeed come from this Python's site-packages through a
    plain path line: its .pth files do not run, so the editable install's import hook (which maps fathom.*
    to this checkout) cannot hide a module or data file the wheel lacks."""
    dist, venv = tmp_path / "dist", tmp_path / "venv"
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)], cwd=tmp_path)
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=tmp_path).strip()
    (Path(site) / "base_packages.pth").write_text(sysconfig.get_path("purelib") + "\n")
    (wheel,) = dist.glob("fathom-*.whl")
    run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)],
        cwd=tmp_path,
    )
    return venv


def run(command: list[str], cwd: Path, env: dict[str, str] | None = None, stdin: str | None = None) -> str:
    result = subprocess.run(command, cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{command[0]} {command[1]}: {result.stdout[-2000:]}{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.slow
def test_a_wheel_prepares_trains_translates_and_exports_from_an_empty_directory(tmp_path):
    """fathom's wheel in a fresh virtualenv, used from a directory outside the repository that holds a
    model.py, a common.py and tools/ and pipeline/ packages (each raising if imported): every command's
    module loads, the shipped Multi30k prepares by name, the shipped default config trains on it through
    `fathom-launch --module fathom.train`, and its checkpoint translates and exports to fairseq."""
    venv = wheel_environment(tmp_path)
    env = {**os.environ, "PATH": os.pathsep.join([str(venv / "bin"), os.environ["PATH"]])}
    cwd = shadowing_directory(tmp_path / "work")
    python = str(venv / "bin" / "python")
    loaded = run([python, "-c", LOAD_COMMANDS], cwd, env).splitlines()[-1].split()
    assert sorted(loaded) == sorted(console_scripts()), "commands the wheel lacks or does not declare"
    assert run(["fathom-launch", "--version"], cwd, env).strip().splitlines()[-1] == versions()
    run(["fathom-prepare", "--src", "de", "--tgt", "en", "--train", "multi30k/train", "--valid", "multi30k/val",
         "--test", "multi30k/test_2016_flickr", "--vocab-size", "1000", "--spm-sample", "4000",
         "--out", "data-bin/m30k"], cwd, env)  # fmt: skip
    run(["fathom-launch", "--num_gpus", "2", "--master_port", str(free_port()), "--module", "fathom.train",
         "--config", "default", "--override", "data.path=data-bin/m30k", "model.encoder_layers=1",
         "model.decoder_layers=1", "model.embed_dim=32", "model.ffn_dim=64", "train.max_steps=2",
         "train.save_interval=2", "train.save_dir=run"], cwd, env)  # fmt: skip
    assert (cwd / "run" / "latest").read_text() == "global_step2"
    source = "Ein Mann fährt Fahrrad.\nZwei Hunde spielen im Schnee.\n"
    translations = run(["fathom-translate", "--checkpoint", "run", "--data", "data-bin/m30k"], cwd, env, source)
    assert len(translations.splitlines()) == 2 and all(translations.splitlines())
    run(["fathom-export", "--checkpoint", "run", "--data", "data-bin/m30k", "--out", "exported"], cwd, env)
    assert {"checkpoint.pt", "dict.de.txt", "dict.en.txt", "spm.model"} <= {
        p.name for p in (cwd / "exported").iterdir()
    }


# Loads each command's function as its console script does; prints their names last (DeepSpeed's
# import prints its accelerator line first).
LOAD_COMMANDS = """
from importlib.metadata import distribution
commands = distribution("fathom").entry_points
print(*(command.name for command in commands if command.load()))
"""


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
