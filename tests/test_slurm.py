"""Slurm starts fathom and preempts it without losing a step, against real daemons (tests/daemons.py): srun's
tasks train as one launcher's ranks do, and a job of scripts/train.sbatch preempted twice by the scheduler
ends bit-equal to an uninterrupted run, with no step trained twice."""

import re
import sys
from pathlib import Path

import pytest

from tests import daemons
from tests.daemons import running_slurm
from tests.helpers import ROOT, assert_same_training, launch
from tests.test_crash import OVERRIDES, steps_done
from tests.test_stopping import wait_for

pytestmark = pytest.mark.slow

TRAIN = ROOT / "scripts" / "train.py"
# one thread a rank everywhere: matmul reductions split differently over 2 threads, and bit-equality is the claim
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
slurm = daemons.slurm  # the fixture


def args(save_dir: Path, steps: int) -> list[str]:
    return ["--config", str(ROOT / "ds_configs" / "default.json"), "--override", *OVERRIDES,
            "train.save_interval=1000", f"train.max_steps={steps}", f"train.save_dir={save_dir}"]  # fmt: skip


def uninterrupted(save_dir: Path, steps: int) -> Path:
    assert launch(TRAIN, *args(save_dir, steps), env=ENV).returncode == 0
    return save_dir


def test_srun_tasks_train_as_one_launchers_ranks(slurm, tmp_path):
    """`srun -n 2 python scripts/train.py ...` failed in both tasks with `pipeline.stages: 1 processes cannot be
    split into 2 stages`: fathom read no SLURM_* variable; `deepspeed --launcher slurm` (which runs srun) the
    same. Now each task takes its rank, the world and the master from Slurm's, and each run equals one of
    warm ranks bit for bit."""
    expected = uninterrupted(tmp_path / "expected", 4)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{slurm.node} slots=2\n")
    deepspeed = ["deepspeed", "--launcher", "slurm", "--hostfile", str(hostfile), "--force_multi", "--no_ssh_check",
                 "--master_addr", "127.0.0.1"]  # fmt: skip
    for name, launcher in (("srun", ["srun", "-n", "2", sys.executable, "-u"]), ("deepspeed", deepspeed)):
        run = tmp_path / name
        result = slurm.run(*launcher, str(TRAIN), *args(run, 4), cwd=ROOT, env=ENV, timeout=300)
        assert "Traceback" not in result.stderr, name
        assert_same_training(expected, run)


def test_a_job_preempted_twice_by_the_scheduler_ends_as_an_uninterrupted_run(tmp_path):
    """`scancel --signal=TERM` at step 159 resumed from step 100, and a time limit's warning signal (USR1) killed
    the ranks with no message. Now a job of scripts/train.sbatch, requeued by the scheduler (SIGTERM to every
    process of the job, as a preemption sends) and warned as before a time limit (SIGUSR1 to the tasks), saves
    each time, goes back into the queue by itself (the cluster has no RequeueExit=75) and resumes at the step it
    stopped after; it ends bit-equal to a run never stopped."""
    steps, run = 30, tmp_path / "run"
    expected = uninterrupted(tmp_path / "expected", steps)
    output = tmp_path / "job.out"
    with running_slurm(requeue_exit=False) as cluster:
        submitted = cluster.run("sbatch", "--parsable", "-n", "2", f"--output={output}",
                                str(ROOT / "scripts" / "train.sbatch"), *args(run, steps)[1:], cwd=ROOT,
                                env={**ENV, "FATHOM_TRAIN": f"{sys.executable} -u {TRAIN}"})  # fmt: skip
        job = submitted.stdout.strip().split(";")[0]
        for preempt, after in ((cluster.requeue, 6), (lambda job: cluster.scancel(job, signal="USR1"), 14)):
            cluster.wait_state(job, "RUNNING", timeout=120)
            wait_for(lambda after=after: steps_done(run) >= after)
            preempt(job)
            cluster.wait_state(job, ["PENDING", "REQUEUED", "REQUEUE_FED"], timeout=60)
        assert cluster.wait_state(job, ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"], timeout=300) == "COMPLETED"
        record = cluster.job(job)
    text = output.read_text()
    stopped = [int(n) for n in re.findall(r"^fathom: stopped by SIG\w+ after step (\d+);", text, re.M)]
    resumed = [int(n) for n in re.findall(r"^fathom: resumed from \S+ at step (\d+);", text, re.M)]
    assert len(stopped) == 2 and stopped == resumed, text[-4000:]  # each start goes on from where the last stopped
    assert re.search(r"stopped by SIGTERM after", text) and re.search(r"stopped by SIGUSR1 after", text)
    assert record["Restarts"] == "2" and text.count("requeueing job") == 2, text[-4000:]
    assert_same_training(expected, run)
