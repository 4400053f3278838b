"""The templates against a real slurmctld/slurmd (slurm/local-cluster.sh): rendered,
submitted with `hpctrain slurm submit`, followed with squeue/scontrol.

All the short jobs are submitted at once by a module fixture, so they run while the
preemption test waits for its requeue; the whole module takes well under two minutes.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

from hpctrain.slurm.nodelist import expand_nodelist
from hpctrain.slurm.submit import sbatch, wait_for_job
from slurm_fixture import LOCAL_CLUSTER, ROOT, slurm_cluster  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]

pytestmark = pytest.mark.usefixtures("slurm_cluster")

JOBS = ROOT / "tests" / "slurm_jobs"
PY = sys.executable
VENV = sys.prefix
TIMEOUT = 180


def submit(template: str, run_dir: Path, *options: str, command: List[str]) -> int:
    """`hpctrain slurm submit` as a user runs it; returns the job id it printed."""
    argv = [PY, "-m", "hpctrain.cli.main", "slurm", "submit", template, "--job-dir", str(run_dir),
            "--venv", VENV, "--time", "5", "--signal-seconds", "30", *options, "--", *command]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, f"submit failed:\n{done.stderr}"
    return int(done.stdout.strip())


def logs(run_dir: Path, job: int) -> str:
    text = ""
    for suffix in ("out", "err"):
        p = run_dir / f"slurm-{job}.{suffix}"
        text += p.read_text() if p.exists() else f"[no {p.name}]\n"
    return text


def controller_log(job: int, lines: int = 40) -> str:
    """slurmctld's log lines about this job (readable as root on the test cluster)."""
    path = Path("/var/log/slurm/slurmctld.log")
    try:
        hits = [l for l in path.read_text(errors="replace").splitlines() if re.search(rf"JobId={job}\b", l)]
    except OSError as exc:
        return f"[slurmctld log unreadable: {exc}]"
    return "\n".join(hits[-lines:])


def story(job: int, run_dir: Path, info: Dict[str, str]) -> str:
    """Everything that tells what happened to a job, for an assertion message."""
    fields = " ".join(f"{k}={info.get(k)}" for k in ("JobState", "Restarts", "ExitCode", "Reason"))
    return f"job {job}: {fields}\n{logs(run_dir, job)}\n--- slurmctld:\n{controller_log(job)}"


def finished(job: int, run_dir: Path) -> Dict[str, str]:
    info = wait_for_job(job, timeout=TIMEOUT)
    assert info, f"SLURM forgot job {job} (MinJobAge too short?)"
    return info


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> Dict[str, tuple]:
    """Submit the short jobs up front; each test then waits for its own."""
    base = tmp_path_factory.mktemp("slurm")
    jobs = {}
    check = [PY, str(JOBS / "allreduce_check.py")]
    for launcher in ("srun", "mpirun"):
        d = base / f"allreduce-{launcher}"
        jobs[f"allreduce-{launcher}"] = (submit("cpu-mpi", d, "--launcher", launcher, "--nodes", "1",
                                                "--tasks-per-node", "2", "--job-name", f"ar-{launcher}",
                                                command=check), d)
    # A rank calls MPI_Abort(7) under the mpirun launcher: the job fails with that code.
    d = base / "abort-mpirun"
    jobs["abort-mpirun"] = (submit("cpu-mpi", d, "--launcher", "mpirun", "--nodes", "1", "--tasks-per-node", "2",
                                   "--job-name", "abort-mpirun",
                                   command=[PY, "-c", "import hpctrain.comm; from mpi4py import MPI; w = MPI.COMM_WORLD; "
                                            "w.Abort(7) if w.rank == 1 else w.Barrier()"]), d)
    if importlib.util.find_spec("hpctrain.cli.selfcheck") is not None:
        d = base / "selfcheck"
        jobs["selfcheck"] = (submit("cpu-mpi", d, "--job-name", "selfcheck",
                                    command=[PY, "-m", "hpctrain.cli.main", "selfcheck"]), d)
    # The silent-singleton trap: plain srun (no --mpi=pmix) must fail loudly.
    d = base / "plain-srun"
    d.mkdir()
    script = d / "plain.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH -n 2 -t 5 -o {d}/slurm-%j.out -e {d}/slurm-%j.err\n"
                      f"export OPAL_PREFIX={shlex.quote(VENV)}\n"
                      f"srun {shlex.quote(PY)} {shlex.quote(str(JOBS / 'allreduce_check.py'))}\n")
    jobs["plain-srun"] = (sbatch(script, cwd=ROOT), d)
    # Hostile values through the whole path: CLI -> script -> sbatch -> bash -> srun -> python.
    d = base / "inject"
    marker = d / "owned"
    m = shlex.quote(str(marker))
    hostile = [f"x; touch {m}", f"$(touch {m})", f"`touch {m}`", f"'\"; touch {m}; \"'", "*", ""]
    jobs["inject"] = (submit("cpu-mpi", d, "--tasks-per-node", "1", "--job-name", hostile[0] + " $(id)",
                             "--export", f"EVIL={hostile[1]}",
                             command=[PY, "-c", "import os, sys; print('ARGS', repr(sys.argv[1:])); "
                                      "print('EVIL', repr(os.environ['EVIL']))", *hostile]), (d, marker, hostile))
    # An elastic job: one of 3 ranks SIGKILLs itself; the two survivors finish.
    d = base / "elastic"
    jobs["elastic"] = (submit("cpu-mpi", d, "--launcher", "mpirun", "--tasks-per-node", "3", "--elastic-min-ranks",
                              "2", "--job-name", "elastic",
                              command=[PY, str(ROOT / "tests" / "elastic" / "elastic_train.py"), "--steps", "12",
                                       "--kill", "2:5", "--out", str(d)]), d)
    # A job array: one task per shard.
    d = base / "array"
    jobs["array"] = (submit("data-shard-array", d, "--array", "0-2", "--job-name", "shards",
                            command=[PY, "-c", "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
                                     str(d / "out{task}.txt"), "shard-{task}-of-{task_count}"]), d)
    return jobs


# ------------------------------------------------------------------------ preemption first
STEPS = 40


def progress_lines(run_dir: Path) -> int:
    p = run_dir / "progress.log"
    return len(p.read_text().splitlines()) if p.exists() else 0


def test_preempt_checkpoint_requeue_resume(batch, tmp_path):
    """scancel -b --signal=USR1 -> forwarded to the step -> checkpoint -> scontrol requeue ->
    rerun with SLURM_RESTART_COUNT=1 resumes -> same result as an uninterrupted run."""
    loop = [PY, str(JOBS / "preempt_loop.py"), "--steps", str(STEPS), "--step-seconds", "0.25"]
    runs = {}
    for name, launcher in (("reference", "srun"), ("srun", "srun"), ("mpirun", "mpirun")):
        d = tmp_path / name
        d.mkdir()
        runs[name] = (submit("cpu-mpi", d, "--launcher", launcher, "--job-name", f"pre-{name}",
                             command=[*loop, "--dir", str(d)]), d)
    for name in ("srun", "mpirun"):
        job, d = runs[name]
        deadline = time.monotonic() + TIMEOUT
        while progress_lines(d) < 5:
            assert time.monotonic() < deadline, f"job {job} made no progress:\n{logs(d, job)}"
            time.sleep(0.2)
        subprocess.run(["scancel", "-b", "--signal=USR1", str(job)], check=True, timeout=30)
    results = {}
    for name, (job, d) in runs.items():
        info = finished(job, d)
        text = logs(d, job)
        assert info["JobState"] == "COMPLETED" and (d / "result.npy").exists(), f"{name}: {story(job, d, info)}"
        results[name] = np.load(d / "result.npy")
        lines = (d / "progress.log").read_text().splitlines()
        if name == "reference":
            assert info["Restarts"] == "0" and lines == [f"restart 0 step {s}" for s in range(STEPS)]
            continue
        assert info["Restarts"] == "1", text
        assert "batch script got SIGUSR1; forwarding it to the job step" in text
        m = re.search(r"resumed from step (\d+) \(SLURM_RESTART_COUNT=1\)", text)
        assert m, text
        k = int(m.group(1))
        assert 5 <= k < STEPS, text
        # Every step exactly once: 0..k-1 before the requeue, k..STEPS-1 after it.
        assert lines == [f"restart 0 step {s}" for s in range(k)] + [f"restart 1 step {s}" for s in range(k, STEPS)]
    for name in ("srun", "mpirun"):
        assert np.array_equal(results[name], results["reference"]), f"{name}: resumed result differs"


# ------------------------------------------------------------------------ all-reduce jobs
@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_cpu_template_allreduce(batch, launcher):
    job, d = batch[f"allreduce-{launcher}"]
    info = finished(job, d)
    text = logs(d, job)
    assert info["JobState"] == "COMPLETED", text
    assert f"allreduce-check OK world=2 sum=3.0 expected=3.0 launcher={launcher}" in text, text
    assert "rank 1: launcher=" + launcher in text
    script = (d / f"ar-{launcher}.sbatch").read_text()
    assert ("srun --mpi=pmix" if launcher == "srun" else "mpirun -n") in script


def test_an_abort_under_mpirun_fails_the_job_with_its_code(batch):
    """The mpirun launcher runs under `hpctrain launch --exact`, which hands on mpirun's
    output and exit status: the job ends FAILED with the code given to MPI_Abort."""
    job, d = batch["abort-mpirun"]
    info = finished(job, d)
    text = logs(d, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "7:0", story(job, d, info)
    assert "running: hpctrain launch --exact -- mpirun -n 2" in text, text
    assert "MPI_ABORT was invoked on rank 1" in text and "job step finished with exit status 7" in text, text


def test_elastic_job_loses_a_rank_and_completes(batch):
    job, d = batch["elastic"]
    info = finished(job, d)
    text = logs(d, job)
    assert info["JobState"] == "COMPLETED", story(job, d, info)
    assert "elastic job: 1 of 3 rank(s) lost; 2 finished" in text and "lost launched rank(s) 2" in text, text
    assert sorted(p.name for p in d.glob("final-*.pt")) == ["final-0.pt", "final-1.pt"], text
    assert "hpctrain launch --elastic" in (d / "elastic.sbatch").read_text()


def test_selfcheck_verb_in_a_job(batch):
    if "selfcheck" not in batch:
        pytest.skip("hpctrain selfcheck is not written yet (hpctrain/cli/selfcheck.py)")
    job, d = batch["selfcheck"]
    info = finished(job, d)
    text = logs(d, job)
    assert info["JobState"] == "COMPLETED" and "selfcheck OK world=2" in text, text


def test_plain_srun_fails_loudly(batch):
    job, d = batch["plain-srun"]
    info = finished(job, d)
    text = logs(d, job)
    assert info["JobState"] == "FAILED", text
    assert "MPI world size is 1 but SLURM started 2 tasks" in text and "HINT" in text, text
    assert "srun --mpi=pmix" in text
    assert "allreduce-check OK" not in text


def test_hostile_values_stay_data(batch):
    job, (d, marker, hostile) = batch["inject"]
    info = finished(job, d)
    text = logs(d, job)
    assert info["JobState"] == "COMPLETED", text
    assert not marker.exists(), "a hostile value was executed by the job"
    assert f"ARGS {hostile!r}" in text, text
    assert f"EVIL {hostile[1]!r}" in text, text
    assert info["JobName"] == hostile[0] + " $(id)"


def test_array_template(batch):
    job, d = batch["array"]
    wait_for_job(job, timeout=TIMEOUT)
    shown = subprocess.run(["scontrol", "show", "job", str(job)], capture_output=True, text=True).stdout
    assert shown.count("JobState=COMPLETED") == 3, shown
    for task in range(3):
        assert (d / f"out{task}.txt").read_text() == f"shard-{task}-of-3"


# ------------------------------------------------------------------------ parser vs Slurm
@pytest.mark.parametrize("text", ["node[001-004,010]", "gpu-a[1-2],gpu-b7", "rack[1-2]-node[01-02]",
                                  "n[08-11]", "n[1-010]", "nid[00012-00013],login1", "r[1-2]n[1-2]g[0-1]",
                                  "a[1-2]b[1-2]c[1-2]d[1-2]", "cn[1,3,5]"])
def test_nodelist_parser_matches_scontrol(text):
    shown = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True, check=True)
    assert expand_nodelist(text) == shown.stdout.split()


def test_local_cluster_start_is_idempotent():
    if os.geteuid() != 0:
        pytest.skip("slurm/local-cluster.sh needs root")
    t0 = time.monotonic()
    done = subprocess.run([str(LOCAL_CLUSTER), "start"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "up:" in done.stdout, done.stdout + done.stderr
    assert time.monotonic() - t0 < 15
    status = subprocess.run([str(LOCAL_CLUSTER), "status"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "slurmctld: running (pid" in status.stdout, status.stdout
