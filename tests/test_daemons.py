"""The real daemons other tests start (tests/daemons.py): pdsh reaches both host names through the sshd, srun
starts ranks 0 and 1, a batch job completes, and one exiting 75 is requeued and runs again within seconds."""

import socket

import pytest

from tests import daemons
from tests.daemons import HOSTS, PACKAGES, REQUIRE, programs

sshd, slurm = daemons.sshd, daemons.slurm  # the fixtures


@pytest.mark.slow
def test_pdsh_runs_on_both_host_names(sshd):
    result = sshd.run(sshd.pdsh("hostname; echo reached $SSH_CONNECTION"))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for host in HOSTS:
        assert f"{host}: {socket.gethostname()}" in lines
        # SSH_CONNECTION ends with the address and port the session came in on
        assert any(line.startswith(f"{host}: reached ") and line.endswith(f" {host} {sshd.port}") for line in lines)


@pytest.mark.slow
def test_srun_starts_two_ranks(slurm):
    result = slurm.run("srun", "-n", "2", "bash", "-c", "echo rank $SLURM_PROCID of $SLURM_NTASKS")
    assert sorted(result.stdout.splitlines()) == ["rank 0 of 2", "rank 1 of 2"]


@pytest.mark.slow
def test_a_batch_job_runs_its_step_and_completes(slurm, tmp_path):
    job = slurm.sbatch("srun bash -c 'echo task $SLURM_PROCID'\n", "-n", "2", cwd=tmp_path)
    assert slurm.wait_state(job, ["COMPLETED", "FAILED"], timeout=30) == "COMPLETED"
    assert sorted(slurm.output(job, tmp_path).splitlines()) == ["task 0", "task 1"]
    assert slurm.job(job)["ExitCode"] == "0:0"


@pytest.mark.slow
def test_a_job_exiting_75_runs_again(slurm, tmp_path):
    """RequeueExit=75: the job is requeued and starts again a few seconds later, with SLURM_RESTART_COUNT."""
    script = 'echo run ${SLURM_RESTART_COUNT:-0}\n[ -n "$SLURM_RESTART_COUNT" ] || exit 75\n'
    job = slurm.sbatch(script, "--requeue", "--open-mode=append", cwd=tmp_path)
    assert slurm.wait_state(job, ["COMPLETED", "FAILED"], timeout=30) == "COMPLETED"
    assert slurm.output(job, tmp_path).splitlines() == ["run 0", "run 1"]
    assert slurm.job(job)["Restarts"] == "1"


@pytest.mark.parametrize("required", ["", "1"])
def test_a_missing_program_skips_or_fails_naming_its_package(monkeypatch, required):
    monkeypatch.setenv(REQUIRE, required)
    monkeypatch.setitem(PACKAGES, "fathom-no-such-daemon", "fathom-no-such-package")
    outcome = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(outcome, match="fathom-no-such-daemon not installed: apt-get install fathom-no-such-package"):
        programs("fathom-no-such-daemon")
