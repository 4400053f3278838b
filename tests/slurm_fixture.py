"""The local SLURM for tests: use it when it answers, else start it (root, apt), else skip
with the reason printed — or fail, when HPCTRAIN_REQUIRE_SLURM=1 (.ci/run sets it)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest

from require import skip_or_fail

ROOT = Path(__file__).resolve().parent.parent
LOCAL_CLUSTER = ROOT / "slurm" / "local-cluster.sh"


def unavailable_reason() -> Optional[str]:
    """None when sbatch can submit to an idle node; otherwise why not."""
    for tool in ("sbatch", "squeue", "scontrol", "sinfo", "srun"):
        if not shutil.which(tool):
            return f"{tool} not found on PATH (start one with: sudo slurm/local-cluster.sh start)"
    try:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s (slurmctld down?)"
    states = done.stdout.split()
    if done.returncode != 0 or not states:
        return f"sinfo failed: {(done.stderr or done.stdout).strip() or 'no nodes'}"
    if not any(s.rstrip("*~#") in ("idle", "mix", "alloc") for s in states):
        return f"no usable node (states: {' '.join(states)})"
    return None


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> None:
    reason = unavailable_reason()
    if reason and os.geteuid() == 0 and os.access(LOCAL_CLUSTER, os.X_OK):
        done = subprocess.run([str(LOCAL_CLUSTER), "start"], capture_output=True, text=True, timeout=600)
        reason = unavailable_reason()
        if reason and done.returncode != 0:
            reason = f"{reason}; slurm/local-cluster.sh start said: {(done.stderr or done.stdout).strip()}"
    if reason:
        skip_or_fail("slurm", f"local SLURM not available: {reason}", request)
