"""``hpctrain bench train`` runs end to end under mpiexec and prints its table."""
import json

import pytest

from mpirun import python_argv, run_mpi

pytestmark = pytest.mark.mpi


def test_bench_train_one_and_two_ranks(tmp_path):
    out = tmp_path / "train.json"
    result = run_mpi(2, python_argv("-m", "hpctrain.cli.main", "bench", "train", "--models", "cnn", "--batch", "8",
                                    "--steps", "2", "--warmup", "1", "--repeats", "2",
                                    "--competitors", "plain,hpctrain,hpctrain-sync,ddp-gloo",
                                    "--json", str(out)), timeout=300)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "hpctrain / DDP-Gloo step (2 rank(s))" in result.stdout
    assert "hpctrain 1-rank overhead (1 rank(s))" in result.stdout
    assert "hpctrain scaling efficiency (2 vs 1 rank(s))" in result.stdout
    assert "torch threads per rank: 1" in result.stdout
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["competitor"], r["ranks"]) for r in rows} == {
        (c, n) for c in ("plain", "hpctrain", "hpctrain-sync", "ddp-gloo") for n in (1, 2)}
    hp = next(r for r in rows if r["competitor"] == "hpctrain" and r["ranks"] == 2)
    assert hp["step_s"] > 0 and hp["comm_s"] > 0 and "wait_s" in hp and hp["repeats"] == 2
    assert hp["threads"] == 1 and hp["spread_s"] >= 0 and hp["shared_buckets"] is True
    solo = next(r for r in rows if r["competitor"] == "hpctrain" and r["ranks"] == 1)
    assert solo["comm_s"] is None and solo["samples_per_s"] > 0
    assert "malloc" in data["environment"]


def test_bench_train_rejects_bad_ranks():
    result = run_mpi(2, python_argv("-m", "hpctrain.cli.main", "bench", "train", "--models", "cnn", "--ranks", "3"),
                     timeout=120)
    assert result.returncode != 0
    assert "each count must be 1 or 2" in result.stdout


def test_bench_allreduce_streams_rows_and_keeps_each_cell_in_its_budget(tmp_path):
    """Rows appear size by size (a run across nodes takes minutes), and --max-seconds cuts the
    calls of a slow cell: here a budget far below the default 1000 calls of a 1 KiB timing."""
    import subprocess

    from mpirun import mpi_env

    out = tmp_path / "ar.json"
    argv = python_argv("-m", "hpctrain.cli.main", "launch", "-n", "2", "--", *python_argv(
        "-m", "hpctrain.cli.main", "bench", "allreduce", "--sizes", "1KiB,64KiB", "--algos", "mpi,auto",
        "--repeats", "2", "--warmup", "1", "--max-seconds", "0.002", "--json", str(out)))
    result = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=mpi_env())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["size", "algo"])
    sizes = [line.split()[0] for line in lines[header + 1:] if line.split()[:1] and line.split()[0].endswith("KiB")]
    assert sizes == ["1KiB", "1KiB", "64KiB", "64KiB"], result.stdout
    records = json.loads(out.read_text())
    assert all(1 <= r["iters"] < 1000 for r in records if r["bytes"] == 1024), records
    assert "OSC UCX" not in result.stdout + result.stderr


def test_no_open_mpi_component_noise_under_a_bare_mpiexec():
    """Not only `hpctrain launch` (which passes --mca osc ^ucx): ranks started by any mpiexec
    leave osc/ucx out before importing hpctrain.comm starts MPI, so a shared window prints
    nothing (the Open MPI wheel's osc/ucx printed one error per rank here)."""
    result = run_mpi(2, python_argv("-m", "hpctrain.cli.main", "bench", "allreduce", "--sizes", "1KiB",
                                    "--algos", "shm", "--repeats", "1", "--max-seconds", "0.01"), timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "osc_ucx" not in result.stdout and "OSC UCX" not in result.stdout, result.stdout[-4000:]
