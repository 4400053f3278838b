"""tests/mpirun.file_verdicts: one launch of several tests/mpi/ files, judged file by file."""
from mpirun import file_verdicts

A, B = "tests/mpi/test_a.py", "tests/mpi/test_b.py"


def lines(*tests, failed=(), skipped=(), stop_after=None):
    out = [("collected", "-", t) for t in tests]
    for t in tests:
        if t == stop_after:
            break
        out.append(("setup", "passed", t))
        if t in skipped:
            out[-1] = ("setup", "skipped", t)
            continue
        out.append(("call", "failed" if t in failed else "passed", t))
        out.append(("teardown", "passed", t))
    return out


TESTS = (f"{A}::test_1", f"{A}::test_2", f"{B}::test_1")


def test_every_test_finished_on_every_rank_passes_every_file():
    results = {"rank0": lines(*TESTS, skipped={f"{A}::test_2"}), "rank1": lines(*TESTS)}
    assert file_verdicts([A, B], results, 2, 0) == {A: None, B: None}


def test_a_failure_is_charged_to_its_file_and_the_files_after_it_did_not_run():
    results = {"rank0": lines(*TESTS, stop_after=f"{B}::test_1"),
               "rank1": lines(*TESTS, failed={f"{A}::test_2"}, stop_after=f"{B}::test_1")}
    verdicts = file_verdicts([A, B], results, 2, 1)
    assert verdicts[A] == f"{A}::test_2 failed on rank1"
    assert "0 of" not in verdicts[B] and "did not finish" in verdicts[B] and f"after {A}::test_2 failed" in verdicts[B]


def test_a_rank_that_recorded_nothing_fails_the_launch():
    verdicts = file_verdicts([A, B], {"rank0": lines(*TESTS)}, 2, 1)
    assert all("did not finish" in v or "rank1" in v for v in verdicts.values())


def test_a_crash_after_every_test_passed_is_charged_to_the_last_file():
    results = {"rank0": lines(*TESTS), "rank1": lines(*TESTS)}
    assert file_verdicts([A, B], results, 2, 134) == {A: None, B: "every test passed but the launch exited with rc=134"}


def test_a_file_that_collected_nothing_fails():
    results = {"rank0": lines(f"{A}::test_1"), "rank1": lines(f"{A}::test_1")}
    assert "no test of it was collected" in file_verdicts([A, B], results, 2, 0)[B]
