"""scripts/launch.py's checks before launching, and the world each launcher's environment describes."""

import io
import json
import os
import socket
import subprocess
import sys

import pytest
from deepspeed.launcher import runner

from fathom.common import ports
from fathom.common.errors import REPORTER_GRACE_S, ConfigError
from fathom.pipeline.launch import command as launch_command
from fathom.pipeline.train import main as train_main
from fathom.pipeline.world.distributed import World, check_mpi_discovery, cpu_threads, launched_world, whole_lines
from tests.helpers import ROOT, assert_same_training, deepspeed_launch, launch

DEFAULT = ROOT / "ds_configs" / "default.json"
TRAIN = ROOT / "scripts" / "train.py"


@pytest.fixture
def config(tmp_path):
    raw = json.loads(DEFAULT.read_text())
    raw["train"]["save_dir"] = str(tmp_path / "ckpt")
    path = tmp_path / "exp.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture
def execs(monkeypatch):
    """Records the arguments DeepSpeed's runner would be started with, instead of starting it."""
    calls = []
    monkeypatch.setattr(launch_command, "run_runner", lambda argv: calls.append(argv) or 0)
    return calls


def hostfile(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def fail(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        launch_command.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("fathom: error: ")
    return err


TWO_HOSTS = "worker-0 slots=1\nworker-1 slots=1\n"
BAD_HOSTFILES = [
    ("worker-0 slots=1\nworker-1 slot=1\n", [], "line 2: 'worker-1 slot=1' is not 'HOST slots=N'"),
    ("worker-0 slots=1\n# spare\nworker-0 slots=1\n", [], "line 3: host worker-0 is already on line 1"),
    ("worker-0 slots=2\nworker-1 slots=0\n", [], "line 2: worker-1 has slots=0; give it at least 1 slot"),
    ("worker-0 slots=-1\n", [], "line 1: 'worker-0 slots=-1' is not 'HOST slots=N'"),
    ("# nothing yet\n\n", [], "no hosts; add one line 'HOST slots=N' per machine"),
    (TWO_HOSTS, ["--include", "worker-0@worker-2"], "host 'worker-2' is not in the hostfile"),
    (TWO_HOSTS, ["--exclude", "worker-9"], "host 'worker-9' is not in the hostfile"),
    (TWO_HOSTS, ["--include", "worker-0:1"], "worker-0 has slots 0-0, not '1'"),
    (TWO_HOSTS, ["--include", "worker-0", "--exclude", "worker-1"], "--include and --exclude: use one of them"),
    (TWO_HOSTS, ["--no_ssh", "--node_rank", "2"], "--node_rank 2: with --no_ssh give each launcher its node's index"),
    (TWO_HOSTS, ["--launcher", "openmpi", "--include", "worker-0@worker-1"], "--launcher openmpi: starts every slot"),
    (TWO_HOSTS, ["--launcher", "pbs"], "--launcher pbs: unknown; use one of pdsh, openmpi"),
    ("worker-0 slots=2\nworker-1 slots=1\n", [], "pipeline.stages: 3 processes cannot be split into 2 stages"),
    (TWO_HOSTS, ["--master_port", "99999"], "--master_port 99999: not a TCP port"),  # a traceback per rank
    # DeepSpeed's runner ignored it without a hostfile; with one, its ranks knew no world
    (TWO_HOSTS, ["--launcher", "slurm"], "--launcher slurm: start one task per rank with srun instead"),
]


@pytest.mark.parametrize("text, flags, message", BAD_HOSTFILES, ids=[case[2][:40] for case in BAD_HOSTFILES])
def test_bad_launch_is_one_line_and_starts_nothing(tmp_path, capsys, config, execs, text, flags, message):
    argv = ["--hostfile", hostfile(tmp_path, text), *flags, "scripts/train.py", "--config", str(config)]
    assert message in fail(capsys, argv)
    assert execs == [] and not (tmp_path / "ckpt").exists()


def test_missing_hostfile_is_an_error_not_a_local_run(tmp_path, capsys, config, execs):
    err = fail(capsys, ["--hostfile", str(tmp_path / "nodes"), "scripts/train.py", "--config", str(config)])
    assert "no such file; fix the path (deepspeed would silently run on this machine only)" in err
    assert execs == []


def test_a_deepspeed_env_line_without_a_value_is_one_line(tmp_path, capsys, monkeypatch, config, execs):
    monkeypatch.chdir(tmp_path)  # the runner reads ./.deepspeed_env from the launch directory
    (tmp_path / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=eth0\n\nNCCL_DEBUG=INFO\n")
    err = fail(capsys, ["--hostfile", hostfile(tmp_path, TWO_HOSTS), "scripts/train.py", "--config", str(config)])
    assert ".deepspeed_env line 2: '' is not KEY=VALUE" in err
    assert execs == []


def test_config_errors_come_before_the_launch(tmp_path, capsys, config, execs):
    argv = ["--hostfile", hostfile(tmp_path, TWO_HOSTS), "scripts/train.py", "--config", str(config)]
    err = fail(capsys, [*argv, "--override", "model.encoder_layer=3"])
    assert "model.encoder_layer: unknown key; did you mean 'encoder_layers'?" in err
    assert execs == []


def test_a_good_hostfile_runs_deepspeed_with_the_same_arguments(tmp_path, capsys, config, execs):
    path = hostfile(tmp_path, "# two nodes\nworker-0 slots=1 max_slots=4\n\nworker-1 slots=1\n")
    argv = ["--hostfile", path, "--no_ssh", "--node_rank", "1", "--master_addr", "127.0.0.1", "--master_port", "29555"]
    argv += ["scripts/train.py", "--config", str(config), "--override", "train.max_steps=4"]
    with pytest.raises(SystemExit) as exc:
        launch_command.main(argv)
    assert exc.value.code == 0 and execs == [argv]
    assert "launching 2 processes" in capsys.readouterr().out


def processes(tmp_path, *flags, text="worker-0 slots=4\nworker-1 slots=2\n"):
    args = runner.parse_args(["--hostfile", hostfile(tmp_path, text), *flags, "scripts/train.py"])
    return launch_command.launched_processes(args)


@pytest.mark.slow
def test_world_size_follows_the_runners_resource_rules(tmp_path):
    assert processes(tmp_path) == 6
    assert processes(tmp_path, "--include", "worker-0:0,1@worker-1") == 4
    assert processes(tmp_path, "--exclude", "worker-0:3") == 5
    assert processes(tmp_path, "--exclude", "worker-1") == 4
    assert processes(tmp_path, "--num_nodes", "1") == 4
    assert processes(tmp_path, "--num_gpus", "1") == 2
    no_hostfile = runner.parse_args(["--num_gpus", "3", "scripts/train.py"])
    assert launch_command.launched_processes(no_hostfile) == 3


@pytest.mark.slow
def test_launch_gives_ranks_the_environment_deepspeed_gives_them(tmp_path):
    """tests/helpers.py's launch starts a job's ranks without the deepspeed launcher's processes, forked
    from warm servers (tests/warm_ranks.py): each rank must get the arguments, the unbuffered Python, the
    working directory, the import path and the environment, variable for variable, the launcher gives
    it, but for the port; and its ranks hash strings differently, as separate interpreters do."""
    script, args = ROOT / "tests" / "workers" / "environment.py", (str(tmp_path), "--config", "x.json")

    def ranks(result) -> dict[str, dict]:
        assert result.returncode == 0
        started = {path.name: json.loads(path.read_text()) for path in tmp_path.glob("rank*.json")}
        for rank in started.values():
            rank["env"].pop("MASTER_PORT")
            (tmp_path / f"rank{rank['env']['RANK']}.json").unlink()
        return started

    real, ours = ranks(deepspeed_launch(script, *args)), ranks(launch(script, *args))
    assert sorted(real) == sorted(ours) == ["rank0.json", "rank1.json"]
    assert real["rank0.json"].pop("hash") != real["rank1.json"].pop("hash")
    assert ours["rank0.json"].pop("hash") != ours["rank1.json"].pop("hash")
    for rank in real:
        env, our_env = real[rank].pop("env"), ours[rank].pop("env")
        differing = {key: (env.get(key), our_env.get(key)) for key in env.keys() | our_env.keys()
                     if env.get(key) != our_env.get(key)}  # fmt: skip
        assert not differing, f"{rank}: variable: (deepspeed's, ours): {differing}"
        assert ours[rank] == real[rank]


@pytest.mark.slow
def test_warm_ranks_train_as_new_interpreters_do(tmp_path, monkeypatch):
    """The suite's jobs run on forked warm ranks: a job of them gives the losses, grad norms and final
    weights, bit for bit, of the same job started as new interpreters (FATHOM_TEST_COLD_RANKS=1)."""
    runs = {}
    for kind in ("cold", "warm"):
        monkeypatch.setenv("FATHOM_TEST_COLD_RANKS", "1" if kind == "cold" else "0")
        runs[kind] = tmp_path / kind
        overrides = ["model.encoder_layers=2", "model.decoder_layers=2", "train.max_steps=3",
                     "train.log_interval=1", f"train.save_dir={runs[kind]}"]  # fmt: skip
        assert launch(TRAIN, "--config", str(DEFAULT), "--override", *overrides).returncode == 0
    assert_same_training(runs["cold"], runs["warm"])


ENVIRONMENTS = {
    "not launched": ({}, World(rank=0, size=1, local_size=1, local_rank=0)),
    "deepspeed, node 1 of 2": (
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "1", "LOCAL_RANK": "0"},
        World(1, 2, 1, 0),
    ),
    "torchrun": ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"}, World(3, 8, 4, 3)),
    "open mpi": (
        {
            "OMPI_COMM_WORLD_RANK": "5",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        },
        World(5, 8, 4, 1),
    ),  # fmt: skip
    "mpich": ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "0"}, World(2, 4, 2, 0)),
    "deepspeed --launcher mpich": ({"PMI_RANK": "1", "WORLD_SIZE": "4", "LOCAL_SIZE": "2"}, World(1, 4, 2, 1)),
    "launcher without local size": ({"RANK": "1", "WORLD_SIZE": "2"}, World(1, 2, 2, 1)),
}


@pytest.mark.parametrize("environ, world", ENVIRONMENTS.values(), ids=ENVIRONMENTS.keys())
def test_world_from_each_launchers_environment(environ, world):
    assert launched_world(environ) == world


def test_cpu_threads_split_the_machine_unless_omp_num_threads_says(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert cpu_threads({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_SIZE": "4"}) == 4
    assert cpu_threads({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "1"}) == 16  # one rank per node
    assert cpu_threads({"RANK": "0", "WORLD_SIZE": "64", "LOCAL_SIZE": "32"}) == 1
    assert cpu_threads({"LOCAL_SIZE": "1", "OMP_NUM_THREADS": "3"}) == 3


class Writes(io.RawIOBase):
    """A pipe's end, counting write calls: each is what another process's output can land between."""

    def __init__(self):
        self.writes = []

    def writable(self):
        return True

    def write(self, data):
        self.writes.append(bytes(data).decode())
        return len(data)


def test_a_launched_ranks_lines_are_written_whole():
    """The launcher starts ranks with `python -u`: unbuffered, write-through. Without whole_lines a
    printed line is two writes (its text, then its newline), and the launcher's own log line on the
    same pipe could land between them."""
    pipe = Writes()
    stream = io.TextIOWrapper(pipe, write_through=True)  # what `python -u` makes of stderr
    print("fathom: a line", file=stream)
    assert pipe.writes == ["fathom: a line", "\n"]  # the interleaving CI once saw
    whole_lines(stream)
    print("fathom: stopped by SIGTERM after step 5", file=stream)
    print("partial", end="", file=stream)
    print(" rest", file=stream)
    assert pipe.writes[2:] == ["fathom: stopped by SIGTERM after step 5\n", "partial rest\n"]


@pytest.fixture
def under_mpirun(monkeypatch):
    """This process as rank R of an Open MPI job of 3 processes, before DeepSpeed's discovery."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def rank(r):
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", str(r))
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3")

    return rank


def test_train_checks_the_mpi_world_before_starting(capsys, config, under_mpirun, monkeypatch):
    """Rank 0 reports at once; another rank first waits for rank 0's exit to end the job."""
    # Under mpirun DeepSpeed discovers the world through mpi4py, an optional extra: without it the run stops
    # at that first (test_mpirun_without_mpi4py_is_one_line), before the world is checked.
    pytest.importorskip("mpi4py", reason="mpi4py is an optional extra (pip install -e '.[mpi]'), not installed")
    waits = []
    monkeypatch.setattr("fathom.common.errors.time.sleep", waits.append)
    for rank, waited in ((0, []), (1, [REPORTER_GRACE_S])):
        under_mpirun(rank)
        waits.clear()
        with pytest.raises(SystemExit) as exc:
            train_main(["--config", str(config)])
        assert exc.value.code == 2 and waits == waited
        err = capsys.readouterr().err.strip()
        assert err.startswith("fathom: error: pipeline.stages: 3 processes cannot be split into 2 stages")


def test_mpirun_without_mpi4py_is_one_line(monkeypatch, under_mpirun):
    under_mpirun(0)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # what `import mpi4py` sees when absent
    with pytest.raises(ConfigError, match=r"mpi4py is not installed; pip install -e '\.\[mpi\]'"):
        check_mpi_discovery()
    monkeypatch.setenv("RANK", "0")  # a deepspeed or torchrun launch needs no MPI discovery
    check_mpi_discovery()


def test_a_rendezvous_port_is_free_and_below_the_ephemeral_range():
    """The kernel hands out ephemeral ports to gloo's listeners and connections and to other jobs' port 0:
    a master port from that range could be taken before the rank binds it (two jobs met on one and hung)."""
    low = ports.LOWEST + 300
    chosen = {ports.free_port(low, low + 100) for _ in range(50)}
    assert all(low <= port < low + 100 for port in chosen) and len(chosen) > 10
    assert ports.LOWEST <= ports.free_port() < ports.ephemeral_start()
    listeners = []
    for port in range(low, low + 100):  # every port of the range in use: none is handed out
        listener = socket.socket()
        try:
            listener.bind(("127.0.0.1", port))
            listener.listen()
        except OSError:  # in use already
            pass
        listeners.append(listener)
    try:
        with pytest.raises(OSError, match="no free TCP port"):
            ports.free_port(low, low + 100)
    finally:
        for listener in listeners:
            listener.close()


@pytest.mark.slow
def test_a_host_probe_names_what_is_missing(tmp_path, monkeypatch):
    """A host without the launch directory, the interpreter, fathom or the script started nothing (exit 127)
    while the others waited; the front door's probe, here run by a local shell instead of ssh, names each."""
    from fathom.pipeline.launch import hosts

    monkeypatch.setattr(hosts, "ssh_command", lambda host, remote, port: ["bash", "-c", remote])
    not_fathom = tmp_path / "python"
    not_fathom.write_text("#!/bin/sh\nexit 1\n")
    not_fathom.chmod(0o755)
    cases = [
        (tmp_path / "gone", sys.executable, "scripts/train.py", f"no directory {tmp_path / 'gone'}"),
        (ROOT, "/nowhere/bin/python", "scripts/train.py", "no Python at /nowhere/bin/python"),
        (ROOT, str(not_fathom), "scripts/train.py", f"fathom does not import with {not_fathom}"),
        (ROOT, sys.executable, "scripts/no_such.py", f"no scripts/no_such.py in {ROOT}"),
    ]
    for cwd, python, program, problem in cases:
        monkeypatch.chdir(cwd if cwd.exists() else tmp_path)
        monkeypatch.setattr(hosts.os.path, "abspath", lambda path, cwd=cwd: str(cwd))
        monkeypatch.setattr(hosts.sys, "executable", python)
        with pytest.raises(ConfigError) as refused:
            hosts.check_hosts(["worker-1"], program, False, None)
        assert str(refused.value).startswith(f"host worker-1: {problem}"), refused.value
    monkeypatch.setattr(hosts.sys, "executable", sys.executable)
    monkeypatch.setattr(hosts.os.path, "abspath", lambda path: str(ROOT))
    hosts.check_hosts(["worker-0", "worker-1"], "fathom.train", True, None)  # a module found: no error


@pytest.mark.slow
def test_a_process_started_alone_is_a_world_of_one(tmp_path):
    """`python scripts/train.py` (fathom-train, python -m fathom.train) with no launcher and no mpi4py ended in
    DeepSpeed's MPI discovery: `ModuleNotFoundError: No module named 'mpi4py'`. Alone, it is a world of one
    and trains, as fairseq's and torchtitan's train.py do."""
    shim = tmp_path / "no-mpi4py" / "mpi4py"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'mpi4py'\", name='mpi4py')\n")
    launched = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launched} | {"PYTHONPATH": str(shim.parent)}
    run = tmp_path / "run"
    alone = subprocess.run([sys.executable, str(TRAIN), "--config", "default", "--override", "pipeline.stages=1",
                            "train.max_steps=2", f"train.save_dir={run}"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert alone.returncode == 0 and "Traceback" not in alone.stderr, alone.stderr[-3000:]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "latin-1"])
def test_a_hostfile_that_is_not_utf8_is_one_line(tmp_path, capsys, config, execs, encoding):
    """UTF-16 (as a Windows editor may save it) was a UnicodeDecodeError traceback, and the runner too stops on
    it; without a byte-order mark it decodes as UTF-8 with a NUL beside every character."""
    path = tmp_path / "hostfile"
    path.write_text("# nodes à Orsay\nworker-0 slots=1\nworker-1 slots=1\n", encoding=encoding)
    err = fail(capsys, ["--hostfile", str(path), "scripts/train.py", "--config", str(config)])
    assert f"--hostfile {path}: not UTF-8 text" in err and "save it as UTF-8 or plain ASCII" in err
    assert ("as in UTF-16" in err) == encoding.startswith("utf-16")
    assert not execs
