"""What the tests share that is not a fixture: launching jobs the way users do, slices of the real
data, fake runs, and comparing two trainings."""

from __future__ import annotations

import fcntl
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fathom.common import ports
from fathom.common.repo import ROOT
from fathom.common.run_layout import LOCK_FILE
from fathom.corpus.text import shipped_data
from tests import warm_ranks


def free_port() -> int:
    """A free port from this pytest-xdist worker's own share of the range, so that jobs the two workers start
    at the same moment never meet on one port."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = (ports.ephemeral_start() - ports.LOWEST) // workers
    return ports.free_port(ports.LOWEST + worker * share, ports.LOWEST + (worker + 1) * share)


def launcher_command(script: str | Path, *args: str, processes: int = 2) -> list[str]:
    """The real `deepspeed` launcher running a script with `processes` CPU ranks."""
    launcher = shutil.which("deepspeed")
    assert launcher, "the deepspeed launcher is not on PATH"
    return [launcher, "--num_gpus", str(processes), "--master_port", str(free_port()), str(script), *args]


def launch_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def rank_environment(rank: int, processes: int, port: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """What `deepspeed --num_gpus N` gives rank `rank` of a one-node job on CPUs: its launch.py sets the
    world and the visible devices on top of the caller's environment
    (test_launch.py::test_launch_gives_ranks_the_environment_deepspeed_gives_them compares the two)."""
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(processes), "RANK": str(rank),
             "LOCAL_RANK": str(rank), "LOCAL_SIZE": str(processes), "CROSS_RANK": "0", "CROSS_SIZE": "1",
             "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(processes)))}  # fmt: skip
    return {**launch_env(), **(env or {}), **world}


def rank_command(script: str | Path, rank: int, *args: str) -> list[str]:
    """The command line DeepSpeed's launch.py starts a rank with."""
    return [sys.executable, "-u", str(script), f"--local_rank={rank}", *args]


class Job(subprocess.CompletedProcess):
    """A launched job that has ended: rank 0's command line, the job's status, its ranks' output, and
    the port they met on (DeepSpeed names its shared-memory segments by it)."""

    def __init__(self, args: list[str], returncode: int, stdout: str, stderr: str, port: int):
        super().__init__(args, returncode, stdout, stderr)
        self.port = port


def launch(
    script: str | Path,
    *args: str,
    processes: int = 2,
    timeout: int = 600,
    file_size_limit: int | None = None,
    env: dict[str, str] | None = None,
) -> Job:
    """Runs a script as `processes` CPU ranks of one job, each started as `deepspeed --num_gpus N` starts it,
    without the launcher's two processes in front, and warm (tests/warm_ranks.py). As DeepSpeed's
    launch.py does, a rank that fails ends the others (SIGTERM), and the job's status is that rank's.
    With `file_size_limit` (bytes) no rank can write a file past it, as on a full disk; `env` is added to
    every rank's environment. Tests of the launcher itself use `deepspeed_launch`."""
    port, deadline = free_port(), time.monotonic() + timeout
    with tempfile.TemporaryDirectory() as outputs:
        out, err = Path(outputs) / "stdout", Path(outputs) / "stderr"
        out.touch()
        err.touch()
        ranks = [start_rank(script, rank, processes, port, list(args), env, out, err, file_size_limit)
                 for rank in range(processes)]  # fmt: skip
        try:
            status = wait_for_ranks(ranks, deadline)
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                    rank.wait()
        if status is None:
            raise subprocess.TimeoutExpired(ranks[0].args, timeout)
        result = Job(ranks[0].args, status, out.read_text(), err.read_text(), port)
    show_if_failed(result)
    return result


def start_rank(
    script: str | Path, rank: int, processes: int, port: int, args: list[str], env: dict[str, str] | None,
    out: Path, err: Path, file_size_limit: int | None,
) -> subprocess.Popen | warm_ranks.WarmRank:  # fmt: skip
    command, environment = rank_command(script, rank, *args), rank_environment(rank, processes, port, env)
    if not warm_ranks.cold():
        return warm_ranks.start_rank(command, rank, ROOT, environment, out, err, file_size_limit)

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    with open(out, "a") as stdout, open(err, "a") as stderr:
        return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=stdout, stderr=stderr, text=True,
                                preexec_fn=limit_file_size if file_size_limit else None)  # fmt: skip


def wait_for_ranks(ranks: list[subprocess.Popen], deadline: float) -> int | None:
    """The job's exit status once every rank has ended, None past `deadline`. The first rank to fail ends
    the rest with SIGTERM, as DeepSpeed's launch.py does, and its status is the job's (as an exit status:
    a rank killed by signal 9 makes it 247)."""
    failed = None
    while time.monotonic() < deadline:
        codes = [rank.poll() for rank in ranks]
        failures = [code for code in codes if code not in (None, 0)]
        if failed is None and failures:
            failed = failures[0]
            for rank, code in zip(ranks, codes, strict=True):
                if code is None:
                    rank.terminate()
        if None not in codes:
            return failed % 256 if failed is not None else 0
        time.sleep(0.02)
    return None


def wait_for_release(save_dir: Path, timeout: float = 120) -> None:
    """Waits until no process holds the run lock of `save_dir`, as a user waits for a killed job to end
    before resuming it: the ranks of a job killed with SIGKILL let go of it only once they have exited, a
    moment after their launcher, and a resume that starts first (a warm rank starts in a second) is
    refused as a second job in the directory."""
    lock, deadline = save_dir / LOCK_FILE, time.monotonic() + timeout
    while lock.exists():
        with open(lock) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, f"{save_dir}'s run is still locked {timeout} s after its job ended"
        time.sleep(0.05)


def deepspeed_launch(
    script: str | Path, *args: str, processes: int = 2, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Runs a script under the real `deepspeed` launcher with `processes` CPU ranks."""
    result = subprocess.run(launcher_command(script, *args, processes=processes), cwd=ROOT, env=launch_env(),
                            capture_output=True, text=True, timeout=timeout)  # fmt: skip
    show_if_failed(result)
    return result


def show_if_failed(result: subprocess.CompletedProcess) -> None:
    """Copies the ends of a failed job's output to the test's stderr, which pytest shows with the failure."""
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-6000:] + result.stderr[-6000:])


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The directory `name` that `build` makes, made once for the whole test session: under `pytest -n 2`
    each worker runs a module's fixtures itself, so a trained run that two workers' tests read was
    trained twice. The worker that asks first builds it under a lock, in the directory both share; one
    whose build failed leaves nothing, and the next to ask builds it again."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-USER/pytest-N/, above each worker's popen-gwK/
    path, done = root / name, root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            done.touch()
    return path


MULTI30K = shipped_data() / "multi30k"


def write_slice(out: Path, name: str, lines: int, langs=("de", "en")) -> str:
    """The first `lines` pairs of a Multi30k split as plain files; returns the prefix."""
    import gzip

    for lang in langs:
        with gzip.open(MULTI30K / f"{name}.{lang}.gz", "rt", encoding="utf-8") as f:
            text = [next(f) for _ in range(lines)]
        (out / f"{name}.{lang}").write_text("".join(text), encoding="utf-8")
    return str(out / name)


def prepare_slice(raw: Path, out: Path, pairs: int, valid: int, test: int, vocab_size: int) -> Path:
    """A prepared data directory `out` from the first `pairs`, `valid` and `test` real Multi30k pairs."""
    from fathom.corpus.prepare import main as prepare_main

    splits = {"train": pairs, "val": valid, "test_2016_flickr": test}
    train, val, test_prefix = (write_slice(raw, name, lines) for name, lines in splits.items())
    prepare_main(["--src", "de", "--tgt", "en", "--train", train, "--valid", val, "--test", test_prefix,
                  "--vocab-size", str(vocab_size), "--out", str(out)])  # fmt: skip
    return out


def edit_prepared(data: Path, name: str, edit) -> None:
    """Rewrites a file of a prepared data directory with edit(its lines) and records it in meta.json, as if
    prepare_data had written it: data that is consistent, but not the data a run was trained on."""
    import json

    from fathom.corpus.dataset import file_record

    path = data / name
    path.write_text("".join(line + "\n" for line in edit(path.read_text().splitlines())))
    meta = json.loads((data / "meta.json").read_text())
    meta["files"][name] = file_record(path)
    (data / "meta.json").write_text(json.dumps(meta))


def logged_steps(save_dir: Path) -> list[dict]:
    """Every value metrics.jsonl logged, step by step, but the timing."""
    import json

    lines = (save_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in lines]


def final_layers(save_dir: Path) -> dict[str, dict]:
    """The layer files of the latest checkpoint, by file name."""
    from fathom.common.checkpoint_format import load_file

    tag = save_dir / (save_dir / "latest").read_text().strip()
    return {path.name: load_file(path) for path in sorted(tag.glob("layer_*-model_states.pt"))}


def assert_same_training(expected: Path, actual: Path) -> None:
    """The same losses (and grad norms, lr, alpha, validation) at every step, and bit-identical final weights."""
    import torch

    assert logged_steps(actual) == logged_steps(expected)
    want, got = final_layers(expected), final_layers(actual)
    assert want and got.keys() == want.keys()
    for name, tensors in want.items():
        assert got[name].keys() == tensors.keys(), name
        for key, tensor in tensors.items():
            assert torch.equal(got[name][key], tensor), f"{name} {key}"


def write_run(model, save_dir: Path, step: int = 1) -> Path:
    """A run directory holding `model` as a pipeline checkpoint (global_step{step}, `latest`), as training
    writes it but without DeepSpeed, in today's format (a manifest commits it, its model states hold the
    client state, config.json the model section as a run records it): for tests of what reads checkpoints."""
    import json

    import torch

    from fathom.common.checkpoint_format import (
        MODEL_STATES,
        ClientState,
        layer_file,
        manifest_files,
        new_manifest,
        write_manifest,
    )
    from fathom.common.run_layout import CONFIG_FILE, LATEST, step_tag
    from fathom.model.model_section import model_section
    from fathom.model.trained import saved_layers

    checkpoint = save_dir / step_tag(step)
    checkpoint.mkdir(parents=True)
    for index, name in saved_layers(model.cfg):
        torch.save(model.get_submodule(name).state_dict(), layer_file(checkpoint, index))
    torch.save({"global_steps": step, "skipped_steps": 0, **ClientState().to_dict()}, checkpoint / MODEL_STATES)
    shape = {"stages": 1, "replicas": 1, "bounds": None}
    write_manifest(checkpoint, new_manifest(checkpoint.name, step, step, manifest_files(checkpoint), shape, 1))
    (save_dir / LATEST).write_text(checkpoint.name)
    (save_dir / CONFIG_FILE).write_text(json.dumps({"model": model_section(model.cfg)}))
    return save_dir


def fold_model(model):
    """The fairseq-layout Transformer computing what `model` (at its current step) computes: model/fold.py's
    folding, which the export streams a layer at a time, over the whole model at once."""
    from fathom.model.fold import folded
    from fathom.model.norms import build_scheme
    from fathom.model.parts import module_names
    from fathom.model.transformer import Transformer

    target = Transformer(build_scheme(model.cfg).fairseq_config())
    names = module_names(model.cfg)
    for _ in folded((n, model.get_submodule(n), target.get_submodule(n)) for n in names):
        pass
    return target.eval()


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of everything under `directory`: what a refusal must leave as it was."""
    return {str(p.relative_to(directory)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in directory.rglob("*")}


def contents(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` by its path there, with its bytes: what two ways of writing it must agree on."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def without_matplotlib(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python finds no matplotlib (an optional extra), as after a plain install."""
    shim = tmp_path / "no-matplotlib" / "matplotlib"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n"
    )
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(shim.parent), os.environ.get("PYTHONPATH")]))}


def trained_in_process(
    cfg, ds: dict, prepare=None, steps: int = 3, deepspeeds: bool = False
) -> tuple[list[float], list]:
    """Losses and final weights of `steps` steps of a one-stage engine of `cfg` built in this process
    (the process_group fixture), two micro-batches of different lengths a step, with fathom's dropout
    reseeding and stability guard (patch_training), as scripts/train.py runs it; `prepare(engine)` changes
    the engine before it trains; `deepspeeds`: with DeepSpeed's own settings where fathom picks others."""
    import itertools

    from fathom.corpus.batches import DataPosition
    from fathom.pipeline.patches import patch_training
    from fathom.tools.in_process_engine import built_engine  # imports DeepSpeed: only where it is used
    from fathom.tools.timed_steps import synthetic_batch

    with built_engine(cfg, ds, "cpu", deepspeeds) as engine:
        masks = patch_training(engine, cfg, seed=1, position=DataPosition(0, 0, 2, 1)).masks
        if prepare:
            prepare(engine)
        batches = itertools.cycle([synthetic_batch(20, 2, 5, 4), synthetic_batch(20, 2, 7, 6)])
        losses = []
        for step in range(steps):
            masks.start(step)
            losses.append(engine.train_batch(data_iter=batches).item())
        weights = [p.detach().clone() for p in engine.module.parameters()]
    return losses, weights
