"""Pure parts of `hpctrain bench allreduce`."""
from hpctrain.bench.allreduce import MAX_ITERS, TIMING_BYTES, busbw_factor, iterations


def test_small_messages_get_more_calls_per_timing_large_ones_what_was_asked():
    assert iterations(1024, 20) == MAX_ITERS
    assert iterations(64 << 10, 20) == TIMING_BYTES // (64 << 10) == 320
    assert iterations(1 << 20, 20) == 20
    assert iterations(64 << 20, 20) == 20
    assert iterations(64 << 20, 50) == 50  # never fewer than asked
    assert iterations(0, 5) == MAX_ITERS


def test_busbw_factor_is_the_nccl_tests_definition():
    assert busbw_factor(1) == 1.0
    assert busbw_factor(2) == 1.0
    assert busbw_factor(4) == 1.5


def test_chosen_label_shows_the_fixed_choice_or_the_run_time_shares():
    from hpctrain.bench.allreduce import chosen_label

    assert chosen_label("shm", {}) == "shm"
    assert chosen_label("shm", {"shm": 0, "native": 0}) == "shm"
    assert chosen_label("shm", {"shm": 13, "native": 87}) == "native 87%+shm 13%"
    assert chosen_label("ring", {"ring": 3, "shm": 0, "native": 1}) == "ring 75%+native 25%"


def test_a_cell_is_cut_to_its_time_budget_never_below_one_call():
    from hpctrain.bench.allreduce import capped_iterations

    assert capped_iterations(1000, 3, 3, 1e-6, 30.0) == 1000          # fast calls: what was asked
    assert capped_iterations(1000, 3, 3, 0.01, 30.0) == 997           # 3 × (3 + 997) × 10 ms = 30 s
    assert capped_iterations(20, 3, 3, 1.0, 30.0) == 7                # 3 × (3 + 7) × 1 s = 30 s
    assert capped_iterations(20, 3, 3, 100.0, 30.0) == 1              # one call per timing at least
    assert capped_iterations(20, 3, 3, 0.0, 30.0) == 20


def test_rows_print_against_the_references_measured_so_far():
    import io

    from hpctrain.bench.allreduce import print_header, print_rows

    def rec(algo, nbytes, t):
        return {"algo": algo, "bytes": nbytes, "time_s": t, "time_min_s": t, "time_max_s": t,
                "algbw_GBps": nbytes / t / 1e9, "busbw_GBps": nbytes / t / 1e9, "chosen": algo}

    rows = [rec("mpi", 1024, 2e-5), rec("auto", 1024, 1e-5), rec("gloo", 1024, 4e-5)]
    out = io.StringIO()
    print_header(["gloo"], out)
    print_rows(rows, rows, ["gloo"], out)
    lines = out.getvalue().splitlines()
    assert lines[0].split()[-2:] == ["x_best_mpi", "x_gloo"]
    auto = next(line for line in lines if "auto(auto)" in line).split()
    assert auto[-2:] == ["2.00", "4.00"]


def test_auto_check_has_the_check_on_for_its_whole_timing_then_as_before():
    """The switch is entered once around a timing (a job does not pay it per call), and
    --check stays on for the competitors timed after auto-check."""
    import contextlib

    import numpy as np

    from hpctrain import comm
    from hpctrain.bench import allreduce as bench

    was = comm.checks_enabled()
    try:
        for before in (False, True):
            comm.set_checks(before)
            run = bench._checked_runner(np.ones(4, dtype=np.float32))
            with bench.setting_of(run):
                assert comm.checks_enabled()
            assert comm.checks_enabled() == before
        assert isinstance(bench.setting_of(lambda: None), contextlib.nullcontext)
    finally:
        comm.set_checks(was)
