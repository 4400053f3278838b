"""The slurm.conf of the two SLURMs this project starts on one machine (slurm/local-cluster.sh:
one node; tests/cluster/slurm-cluster.sh: several) comes from one writer, slurm/slurm-conf.sh:
the same settings in both, only the cluster's own names, paths and nodes differ."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Dict

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "slurm" / "local-cluster.sh"
MULTI = ROOT / "tests" / "cluster" / "slurm-cluster.sh"
# What differs between the two by design: names, addresses, paths, sizes, the private munged.
OWN = {"ClusterName", "SlurmctldHost", "AuthInfo", "StateSaveLocation", "SlurmdSpoolDir", "SlurmctldPidFile",
       "SlurmdPidFile", "SlurmctldLogFile", "SlurmdLogFile", "TmpFS", "NodeName", "PartitionName"}


def conf(*argv: str) -> Dict[str, str]:
    done = subprocess.run(["bash", *argv], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HPCTRAIN_SLURM_CPUS": "6"})
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line and not line.startswith("#")]
    settings = dict(line.split("=", 1) for line in lines)
    assert len(settings) == len(lines), "a setting written twice"
    return settings


def test_both_clusters_share_every_setting_but_their_own():
    local, multi = conf(str(LOCAL), "conf"), conf(str(MULTI), "conf", "--nodes", "3")
    shared = set(local) - OWN
    assert shared == set(multi) - OWN and {"SchedulerParameters", "SlurmdParameters", "MinJobAge"} <= shared
    assert {k: local[k] for k in shared} == {k: multi[k] for k in shared}
    assert local["AuthInfo"] == "cred_expire=10" and multi["AuthInfo"].endswith(",cred_expire=10")
    assert local["NodeName"].split()[2] == "CPUs=6"
    assert multi["NodeName"].startswith("node[1-3] NodeAddr=10.99.0.[1-3] CPUs=8 ")
    assert "TmpFS" in multi and "TmpFS" not in local  # several slurmds on one machine need their own


def test_the_settings_are_written_in_one_place():
    writers = [p.relative_to(ROOT).as_posix() for p in (ROOT / "slurm").glob("*.sh")]
    writers += [p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("*.sh")]
    where = sorted(w for w in writers if "SchedulerParameters=" in (ROOT / w).read_text())
    assert where == ["slurm/slurm-conf.sh"]


def test_a_missing_or_unknown_setting_is_an_error():
    lib = ROOT / "slurm" / "slurm-conf.sh"
    done = subprocess.run(["bash", "-c", f"source {lib}; slurm_conf header=x colour=blue"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "unknown setting 'colour'" in done.stderr
    done = subprocess.run(["bash", "-c", f"source {lib}; slurm_conf header=x"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode != 0 and "cluster" in done.stderr


@pytest.mark.parametrize("script", [LOCAL, MULTI])
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
