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
