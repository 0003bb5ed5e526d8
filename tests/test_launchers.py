"""How a rank recognizes the launchers above it and an output nobody reads (pipeline/safety/launchers.py), and
how an srun task finds its world (pipeline/world/slurm.py), on hand-made process chains and environments."""

import io
import os
from dataclasses import dataclass, field

from fathom.pipeline.safety.launchers import GuardedStream, launcher_chain, output_closed, python_program
from fathom.pipeline.world.slurm import adopt_slurm_world, hostnames, step_port, tasks_on_node

PY = "/venv/bin/python3"


@dataclass
class FakeProcess:
    """What launcher_chain reads of a process: its pid, command line, name, and its parents."""

    pid: int
    args: list[str]
    above: list["FakeProcess"] = field(default_factory=list)

    def cmdline(self) -> list[str]:
        return self.args

    def name(self) -> str:
        return os.path.basename(self.args[0])

    def parents(self) -> list["FakeProcess"]:
        return self.above


def chain(*commands: list[str], environ: dict[str, str] | None = None) -> list[int]:
    """The pids launcher_chain watches for a rank whose ancestors, nearest first, run `commands` (pid 1, 2, ...)."""
    ancestors = [FakeProcess(pid, args) for pid, args in enumerate(commands, 1)]
    rank = FakeProcess(99, [PY, "-u", "scripts/train.py"], ancestors)
    return [process.pid for process in launcher_chain(rank, environ or {})]


LAUNCH = [PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30="]
RUNNER = [PY, "/venv/bin/deepspeed", "--num_gpus", "2", "scripts/train.py"]


def test_a_python_command_line_names_its_program():
    assert python_program(LAUNCH) == "deepspeed.launcher.launch"
    assert python_program(RUNNER) == "deepspeed"
    assert python_program([PY, "-X", "dev", "-u", "/repo/scripts/launch.py", "--hostfile", "h"]) == "launch.py"
    assert python_program([PY, "-c", "import x"]) is None and python_program(["/usr/bin/pdsh", "-w"]) is None


def test_the_launchers_above_a_rank_end_at_the_first_process_that_is_none():
    shell, login = ["-bash"], ["sshd: alice@pts/0"]
    assert chain(LAUNCH, RUNNER, shell, login) == [1, 2]  # a nohup'd job outlives the terminal's session
    assert chain([PY, "/venv/bin/torchrun", "--nproc_per_node", "2"], shell) == [1]
    assert chain(LAUNCH, ["sshd: root@notty"]) == [1, 2]  # pdsh's remote command: bash exec'd launch.py
    assert chain(LAUNCH, ["bash", "-c", "cd /x; python -m deepspeed.launcher.launch"], ["sshd: root@notty"]) == [1, 3]
    assert chain(["slurmstepd: [7.0]"]) == [] and chain(["orted", "--hnp"]) == []
    assert chain([PY, "scripts/launch.py", "--num_gpus", "2"], environ={"FATHOM_LAUNCHER_PID": "1"}) == [1]


def test_an_output_nobody_reads_is_seen_and_writing_to_it_does_not_raise():
    """A killed pdsh closes the pipes its ranks print into: the rank crashed on its next print."""
    read, write = os.pipe()
    assert not output_closed([write])
    os.close(read)
    assert output_closed([write])
    closed = []
    stream = GuardedStream(io.TextIOWrapper(io.FileIO(write, "w"), line_buffering=True), lambda: closed.append(1))
    assert stream.write("step 7\n") == 7 and closed == [1]
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, write)  # as silence_output does: what is still buffered goes nowhere
    os.close(devnull)
    stream.close()


def test_an_srun_task_takes_its_world_from_slurm():
    assert hostnames("gpu[01-03,07],login5,r[1-2]-n[8-9]") == [
        "gpu01", "gpu02", "gpu03", "gpu07", "login5", "r1-n8", "r1-n9", "r2-n8", "r2-n9"]  # fmt: skip
    assert tasks_on_node("2(x3),1", 1) == 2 and tasks_on_node("2(x3),1", 3) == 1
    task = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1",
            "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_STEP_NODELIST": "node[04-06]",
            "SLURM_JOB_ID": "812"}  # fmt: skip
    assert adopt_slurm_world(task)
    assert {k: task[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "MASTER_ADDR": "node04",
        "MASTER_PORT": str(step_port(812, 0))}  # fmt: skip
    # the batch script itself (no step), and a launcher's rank inside a step, keep what they have
    slurm = {k: v for k, v in task.items() if k.startswith("SLURM_")}
    batch = {k: v for k, v in slurm.items() if k != "SLURM_STEP_ID"}
    assert not adopt_slurm_world(batch) and "RANK" not in batch
    launched = {**slurm, "OMPI_COMM_WORLD_RANK": "3"}
    assert not adopt_slurm_world(launched) and "RANK" not in launched
