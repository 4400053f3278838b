"""Faults must end the job fast, non-zero, naming the rank — never hang."""
import time

import pytest

from mpirun import ROOT, python_argv, run_mpi

pytestmark = pytest.mark.mpi

SCRIPTS = ROOT / "tests" / "mpi_scripts"


# the flag exchange; auto's run-time choice (its agreement exchange); the piped path; the C
# ring and the Python ring (rank 0 waits for its left neighbour, rank 1)
@pytest.mark.parametrize("n,elements,autotune,algorithm,ring_c", [
    (2, 4, "1", "auto", "1"), (3, 4, "1", "auto", "1"), (2, 1_000_000, "1", "auto", "1"),
    (2, 1_000_000, "0", "auto", "1"), (2, 1_000_000, "1", "ring", "1"), (2, 1_000_000, "1", "ring", "0")])
def test_stall_watchdog_names_missing_rank_and_aborts(n, elements, autotune, algorithm, ring_c):
    t0 = time.monotonic()
    result = run_mpi(n, python_argv(str(SCRIPTS / "stall.py"), str(elements), algorithm), timeout=60,
                     env={"HPCTRAIN_STALL_TIMEOUT": "3", "HPCTRAIN_AUTOTUNE": autotune, "HPCTRAIN_RING_C": ring_c,
                          # the ring: no agreement check in front of it, so the wait is in the ring
                          "HPCTRAIN_CHECK_COLLECTIVES": "0" if algorithm == "ring" else "1"})
    elapsed = time.monotonic() - t0
    assert result.returncode not in (0, -9), result.stdout
    missing = "Not arrived: ranks 1 (left neighbour)" if algorithm == "ring" else "Not arrived: ranks 1"
    assert "STALL" in result.stdout and missing in result.stdout, result.stdout
    assert "unreachable" not in result.stdout
    assert elapsed < 40, f"took {elapsed:.0f}s"


def test_stall_in_the_check_through_rank_0_names_only_the_missing_rank():
    """Without the shared-memory flags (as across nodes) rank 0 coordinates the check: of
    ranks 1 and 2, only rank 1 never sends its header, after one call that agreed."""
    result = run_mpi(3, python_argv(str(SCRIPTS / "stall.py"), "4", "auto", "after-one"), timeout=60,
                     env={"HPCTRAIN_STALL_TIMEOUT": "3", "HPCTRAIN_SHM_FLAGS": "0"})
    assert result.returncode not in (0, -9), result.stdout
    assert "(agreement check)" in result.stdout and "Not arrived: ranks 1." in result.stdout, result.stdout
    assert "unreachable" not in result.stdout


def test_ranks_exit_when_their_launcher_is_killed():
    """SIGKILL to mpiexec (Open MPI 5's prterun leaves its ranks running then): every rank
    sees that the launcher that started it is gone and exits within seconds."""
    import os
    import re
    import signal
    import subprocess

    from mpirun import mpi_env, mpiexec_argv

    proc = subprocess.Popen(mpiexec_argv(2) + python_argv(str(SCRIPTS / "report_pids.py")), env=mpi_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    pids = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            m = re.match(r"PID (\d+) PARENT (\d+)", line)
            if m:
                pids.append(int(m.group(1)))
        assert len(pids) == 2, "the ranks did not start"
        proc.kill()  # mpiexec alone, as `kill -9` does; its ranks are not signalled
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [pid for pid in pids if _running(pid)]
        assert not alive, f"ranks {alive} still run after their launcher was killed"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# A rank that ended (a normal exit, or shutdown()) while another waits in a collective it never
# started: reported within seconds, not after the stall timeout (here 120 s).
@pytest.mark.parametrize("n,how,elements,algorithm,early,check", [
    (2, "exit", 4, "auto", 1, "1"), (3, "exit", 4, "auto", 0, "1"), (2, "shutdown", 1_000_000, "auto", 1, "1"),
    (2, "exit", 1_000_000, "ring", 1, "0"), (2, "exit", 1000, "native", 1, "1")])
def test_a_rank_that_ended_early_is_reported_at_once(n, how, elements, algorithm, early, check):
    t0 = time.monotonic()
    result = run_mpi(n, python_argv(str(SCRIPTS / "end_early.py"), how, str(elements), algorithm, str(early)),
                     timeout=100, env={"HPCTRAIN_STALL_TIMEOUT": "120", "HPCTRAIN_CHECK_COLLECTIVES": check})
    elapsed = time.monotonic() - t0
    assert result.returncode not in (0, -9), result.stdout
    assert f"cannot finish: rank {early} has ended (shutdown() or a normal exit) after 1 collective(s) on the " \
           "world, where this rank has started 2." in result.stdout, result.stdout
    assert "STALL" not in result.stdout and "unreachable" not in result.stdout, result.stdout
    assert elapsed < 60, f"took {elapsed:.0f}s"


def test_ranks_that_end_seconds_apart_after_the_same_calls_are_not_reported():
    result = run_mpi(3, python_argv(str(SCRIPTS / "end_early.py"), "in-time", "4", "auto", "1"), timeout=100)
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("ended in time") == 3 and "cannot finish" not in result.stdout, result.stdout


@pytest.mark.parametrize("how", ["new_group", "split"])
def test_group_creation_with_a_missing_rank_aborts(how):
    t0 = time.monotonic()
    result = run_mpi(2, python_argv(str(SCRIPTS / "stall_group.py"), how), timeout=60,
                     env={"HPCTRAIN_STALL_TIMEOUT": "3"})
    assert result.returncode not in (0, -9), result.stdout
    assert "STALL" in result.stdout and f"{how}" in result.stdout and "in the same order" in result.stdout, result.stdout
    assert "unreachable" not in result.stdout
    assert time.monotonic() - t0 < 40


@pytest.mark.parametrize("n,bad", [(2, 1), (3, 1), (3, 0)])
def test_exception_on_one_rank_aborts_job(n, bad):
    t0 = time.monotonic()
    result = run_mpi(n, python_argv(str(SCRIPTS / "raise_on_rank.py"), str(bad)), timeout=60,
                     env={"HPCTRAIN_STALL_TIMEOUT": "300"})
    assert result.returncode not in (0, -9), result.stdout
    assert f"rank {bad} raised an unhandled exception" in result.stdout
    assert "injected failure" in result.stdout and "unreachable" not in result.stdout
    assert time.monotonic() - t0 < 40


def test_cli_exception_aborts_job():
    """A failing hpctrain command on one rank aborts every rank (here: a bad --sizes value
    only rank 1 sees would hang rank 0 otherwise; we use a missing JSON directory instead)."""
    result = run_mpi(2, python_argv("-m", "hpctrain.cli.main", "selfcheck", "--fail-on-rank", "1"), timeout=60)
    assert result.returncode not in (0, -9), result.stdout
    assert "rank 1 raised an unhandled exception" in result.stdout
    # the user's error is what gets reported, not a failure of the abort path itself
    assert "injected failure" in result.stdout and "AttributeError" not in result.stdout, result.stdout
