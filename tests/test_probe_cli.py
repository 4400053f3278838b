"""`hpctrain probe` driven from outside, under a real mpiexec."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpirun import ROOT, mpi_env, run_mpi

pytestmark = pytest.mark.mpi

HPCTRAIN = str(Path(sys.executable).parent / "hpctrain")


def _json_from(stdout: str) -> dict:
    start = stdout.index("{")
    return json.loads(stdout[start:stdout.rindex("}") + 1])


def test_probe_json_two_ranks_and_cluster_view():
    result = run_mpi(2, [HPCTRAIN, "probe", "--json"], timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]
    data = _json_from(result.stdout)
    assert result.stdout.count('"cluster"') == 1, "only rank 0 prints"
    ranks = data["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        for key in ("hostname", "cpus", "memory", "gpus", "mpi", "launcher", "slurm", "binding"):
            assert key in r, key
        assert r["size"] == 2 and r["mpi"]["implementation"] == "Open MPI"
        assert r["launcher"]["kind"] == "mpiexec"
        assert r["binding"]["device"] == "cpu"
    assert len({r["pid"] for r in ranks}) == 2
    cluster = data["cluster"]
    assert cluster["world_size"] == 2
    assert sorted(rv["rank"] for n in cluster["nodes"] for rv in n["ranks"]) == [0, 1]


def test_probe_text_table():
    result = run_mpi(2, [HPCTRAIN, "probe", "--checkpoint-dir", "/tmp/hpctrain-probe-test/ckpt"], timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]
    out = result.stdout
    assert "2 rank(s) on 1 node(s)" in out and "Open MPI" in out
    assert "disk (checkpoint) /tmp/hpctrain-probe-test/ckpt" in out and "[measured at /tmp]" in out
    assert "rank  local  pid" in out


def test_probe_tune_batch_two_ranks():
    result = run_mpi(2, [HPCTRAIN, "probe", "--tune-batch", "examples/tune_wide.py:factory",
                         "--max-memory", "40MiB", "--json"], timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    tune = _json_from(result.stdout)["tune"]
    assert tune["per_device_batch"] >= 1
    assert tune["global_batch"] == 2 * tune["per_device_batch"]
    assert len(tune["per_rank"]) == 2 and {c["batch"] for c in tune["per_rank"]} == {tune["per_device_batch"]} or \
        min(c["batch"] for c in tune["per_rank"]) == tune["per_device_batch"]
    assert "square-root" in tune["explanation"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HPCTRAIN, "probe", *args], capture_output=True, text=True, env=mpi_env(),
                          cwd=str(ROOT), timeout=120)


def test_bad_inputs_say_what_and_how():
    r = run_cli("--tune-batch", "examples/tune_wide.py:factory", "--max-memory", "lots")
    assert r.returncode != 0 and "--max-memory: cannot read 'lots' as a size" in r.stderr
    r = run_cli("--tune-batch", "examples/tune_wide.py")
    assert r.returncode != 0 and "MODULE:FACTORY" in r.stderr
    r = run_cli("--tune-batch", "examples/tune_wide.py:nope")
    assert r.returncode != 0 and "has no 'nope'" in r.stderr and "factory" in r.stderr
    r = run_cli("--tune-batch", "no_such_module_xyz:factory")
    assert r.returncode != 0 and "cannot import" in r.stderr
    r = run_cli("--tune-batch", "examples/tune_wide.py:make_batch")
    assert r.returncode != 0 and "no arguments" in r.stderr
    r = run_cli("--margin", "1.5")
    assert r.returncode != 0 and "--margin" in r.stderr
