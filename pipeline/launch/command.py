"""scripts/launch.py: the deepspeed launcher's command line, checked before anything starts.

    python scripts/launch.py --hostfile HF scripts/train.py --config ds_configs/NAME.json [--override ...]

takes exactly `deepspeed`'s arguments. DeepSpeed's runner stops on a hostfile with a bad line or a
duplicate host with a ValueError traceback, and launches on this machine alone when the hostfile
path does not exist. This front end reads the hostfile and --include/--exclude the way the runner
will, computes the number of processes it will start, checks the run against that world size
(everything scripts/train.py checks before training), then runs DeepSpeed's runner (what the
`deepspeed` command runs) with the same arguments, as a child it passes stop signals through to the
ranks (pipeline/launch/supervise.py). Each mistake is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import OrderedDict
from pathlib import Path

from deepspeed.accelerator import get_accelerator
from deepspeed.launcher import runner

from fathom.common.cli import versions
from fathom.common.errors import ConfigError, exit_on_config_error
from fathom.pipeline.launch.checks import check_run, parse_train_args
from fathom.pipeline.launch.hosts import check_hosts
from fathom.pipeline.launch.supervise import run_runner

# The runner's own pattern is r'^(\S+)\s+slots=(\d+)', which reads "slots=4x" as 4; trailing fields
# (Open MPI's max_slots=N, a comment) stay allowed.
HOSTFILE_LINE = re.compile(r"(\S+)\s+slots=(\d+)(?:\s.*)?")
# These launchers hand the whole hostfile to mpirun/srun and refuse resource filters.
WHOLE_HOSTFILE_LAUNCHERS = ("openmpi", "mpich", "impi", "mvapich")


def read_hostfile(path: str) -> OrderedDict[str, int]:
    """HOST slots=N per line, # comments and blank lines skipped; hosts in file order, as the runner ranks them."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"--hostfile {path}: no such file; fix the path (deepspeed would silently run on this machine only)"
        ) from None
    except OSError as err:
        raise ConfigError(f"--hostfile {path}: cannot read it ({err.strerror})") from None
    # UTF-8 whatever the locale's encoding (host names are ASCII, which all of them read alike). UTF-16,
    # as some Windows editors save, is refused: with a byte-order mark it is no UTF-8, without one it
    # decodes as UTF-8 with a NUL beside every character, and either way no line would be 'HOST slots=N'.
    nul = data.find(b"\0")
    try:
        lines = data.decode("utf-8").splitlines()
        bad = nul  # the first byte that is no text, -1 if none
    except UnicodeDecodeError as err:
        bad = err.start if nul < 0 else min(nul, err.start)
    if bad >= 0:
        utf16 = ", as in UTF-16" if data[bad] == 0 or data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise ConfigError(
            f"--hostfile {path}: not UTF-8 text (byte {bad} is {data[bad]:#04x}{utf16}); "
            "save it as UTF-8 or plain ASCII, one 'HOST slots=N' line per machine"
        )
    hosts: OrderedDict[str, int] = OrderedDict()
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = HOSTFILE_LINE.fullmatch(line)
        if match is None:
            raise ConfigError(f"{path} line {number}: {line!r} is not 'HOST slots=N'; write e.g. 'worker-0 slots=8'")
        host, slots = match.group(1), int(match.group(2))
        if host in hosts:
            raise ConfigError(
                f"{path} line {number}: host {host} is already on line {first_line[host]}; "
                "list each host once with all its slots"
            )
        if slots < 1:
            raise ConfigError(f"{path} line {number}: {host} has slots={slots}; give it at least 1 slot or remove it")
        hosts[host], first_line[host] = slots, number
    if not hosts:
        raise ConfigError(f"{path}: no hosts; add one line 'HOST slots=N' per machine")
    return hosts


def check_filter(flag: str, text: str, hosts: OrderedDict[str, int]) -> None:
    """--include/--exclude NAME[:SLOT[,SLOT...]][@...] must name hosts and slots of the hostfile."""
    for spec in text.split("@"):
        host, _, slots = spec.partition(":")
        if host not in hosts:
            raise ConfigError(f"{flag} {text}: host {host!r} is not in the hostfile; use one of {', '.join(hosts)}")
        for slot in slots.split(",") if slots else ():
            if not slot.isdigit() or int(slot) >= hosts[host]:
                raise ConfigError(
                    f"{flag} {text}: {host} has slots 0-{hosts[host] - 1}, not {slot!r}; write e.g. {host}:0,1"
                )


def check_environment_files() -> None:
    """The runner exports every line of ~/.deepspeed_env and ./.deepspeed_env to a multi-node job and
    stops on a line without '=' (a blank line or a comment too) with a traceback."""
    for directory in runner.DEEPSPEED_ENVIRONMENT_PATHS:
        path = Path(directory) / runner.DEEPSPEED_ENVIRONMENT_NAME
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text().splitlines(keepends=True), 1):
            if "=" not in line:
                raise ConfigError(
                    f"{path} line {number}: {line.strip()!r} is not KEY=VALUE; deepspeed accepts no blank "
                    "lines or comments there"
                )


def launched_processes(args: argparse.Namespace) -> int:
    """The world size the runner will start for these arguments, computed with its own functions."""
    return sum(len(slots) for slots in launched_hosts(args).values())


def launched_hosts(args: argparse.Namespace) -> OrderedDict[str, list[int]]:
    """The hosts and slots the runner will start processes on for these arguments, by its own functions."""
    if args.launcher.lower() == "slurm":  # DeepSpeed's wants a hostfile, ssh and --master_addr for it
        raise ConfigError(
            "--launcher slurm: start one task per rank with srun instead, inside an allocation: "
            "srun --ntasks N python scripts/train.py --config ... (or fathom-train); docs/CLUSTERS.md"
        )
    if args.include and args.exclude:
        raise ConfigError("--include and --exclude: use one of them")
    if not 0 < args.master_port < 65536:
        raise ConfigError(f"--master_port {args.master_port}: not a TCP port; use one from 1024 to 65535")
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        raise ConfigError(f"--ssh_port {args.ssh_port}: not a TCP port; use the port sshd listens on (22)")
    for flag, count in (("--num_nodes", args.num_nodes), ("--num_gpus", args.num_gpus)):
        if count == 0 or count < -1:  # -1, the runner's default: all of them
            raise ConfigError(f"{flag} {count}: must be at least 1, or left out for all")
    if (args.include or args.exclude) and (args.num_nodes >= 0 or args.num_gpus >= 0):
        raise ConfigError("--include/--exclude cannot be combined with --num_nodes or --num_gpus; drop one")
    # The runner's default hostfile (/job/hostfile, DLTS clusters) may be absent; one that was named must not.
    if os.path.exists(args.hostfile) or args.hostfile != runner.DLTS_HOSTFILE:
        pool = read_hostfile(args.hostfile)
    else:  # this machine's accelerators (on CPUs: LOCAL_SIZE, else its NUMA nodes)
        if args.num_nodes > 1:
            raise ConfigError(f"--num_nodes {args.num_nodes}: without --hostfile there is one node")
        pool = OrderedDict(localhost=get_accelerator().device_count())
        if pool["localhost"] == 0:
            raise ConfigError("no accelerators found on this machine; pass --num_gpus N (N CPU processes)")
    for flag, text in (("--include", args.include), ("--exclude", args.exclude)):
        if text:
            check_filter(flag, text, pool)
    active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    if not active:
        raise ConfigError(f"--exclude {args.exclude}: leaves no slots to launch on")
    launcher = args.launcher.lower()
    multi_node = (args.force_multi or len(active) > 1) and not args.no_ssh
    filtered = args.include or args.exclude or args.num_nodes >= 0 or args.num_gpus >= 0
    if multi_node and launcher in WHOLE_HOSTFILE_LAUNCHERS and filtered:
        raise ConfigError(
            f"--launcher {launcher}: starts every slot of the hostfile; edit the hostfile instead of "
            "--include/--exclude/--num_nodes/--num_gpus"
        )
    if launcher in runner.LAUNCHER_CLASSES:
        try:
            runner.LAUNCHER_CLASSES[launcher].validate_active_resources(active)
        except ValueError as err:
            raise ConfigError(f"--launcher {launcher}: {err}") from None
    elif multi_node:
        raise ConfigError(f"--launcher {args.launcher}: unknown; use one of {', '.join(runner.LAUNCHER_CLASSES)}")
    if args.no_ssh and not 0 <= args.node_rank < len(active):
        raise ConfigError(
            f"--node_rank {args.node_rank}: with --no_ssh give each launcher its node's index, 0 to {len(active) - 1}"
        )
    if multi_node:
        check_environment_files()
    return active


def check_launch(argv: list[str]) -> int:
    """Checks the launcher's arguments and the run they start; returns the world size."""
    args = runner.parse_args(argv)
    hosts = launched_hosts(args)
    world_size = sum(len(slots) for slots in hosts.values())
    # Sizes only: each machine's first rank verifies the data's checksums before any rank can train.
    check_run(parse_train_args(args.user_args), world_size, checksums=False)
    if (args.force_multi or len(hosts) > 1) and not args.no_ssh and args.launcher.lower() == "pdsh":
        check_hosts(list(hosts), args.user_script, args.module, args.ssh_port)
    return world_size


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--version"]:  # DeepSpeed's runner has no --version of its own to keep
        print(versions())
        return
    with exit_on_config_error():
        world_size = check_launch(argv)
    print(f"fathom: checked; launching {world_size} processes", flush=True)
    sys.exit(run_runner(argv))  # what the `deepspeed` command runs, as a child that stops the ranks with a save


if __name__ == "__main__":  # python -m fathom.pipeline.launch.command: fathom-launch by this interpreter
    main()
