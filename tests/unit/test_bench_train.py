"""Pure parts of ``hpctrain bench train``: phase plan, combining ranks and repeats, the table."""
from io import StringIO

import pytest
from hypothesis import given, strategies as st

from hpctrain.bench.train import (COMPETITORS, MODELS, combine, parse_list, parse_ranks, plan_phases, print_table,
                                  summarize_repeats, target_lines)


@given(ranks=st.sampled_from([[1], [2], [1, 2], [1, 4]]),
       models=st.lists(st.sampled_from(MODELS), min_size=1, max_size=2, unique=True),
       competitors=st.lists(st.sampled_from(COMPETITORS), min_size=1, max_size=6, unique=True),
       repeats=st.integers(1, 4))
def test_plan_covers_every_row_repeats_times_horovod_last(ranks, models, competitors, repeats):
    phases = plan_phases(ranks, models, competitors, repeats)
    assert len(phases) == len(ranks) * len(models) * len(competitors) * repeats
    for n in ranks:
        for m in models:
            for c in competitors:
                got = sorted(p.repeat for p in phases if (p.ranks, p.model, p.competitor) == (n, m, c))
                assert got == list(range(repeats))
    kinds = [p.competitor == "horovod" for p in phases]
    assert kinds == sorted(kinds), "Horovod runs after every other competitor"
    others = [p for p in phases if p.competitor != "horovod"]
    assert [p.ranks for p in others] == sorted(p.ranks for p in others), "1-rank rows first"


def test_plan_rotates_the_order_between_repeats():
    phases = plan_phases([2], ["mlp"], ["plain", "hpctrain", "ddp-gloo"], 3)
    firsts = [phases[i * 3].competitor for i in range(3)]
    assert firsts == ["plain", "hpctrain", "ddp-gloo"]


def test_parse_ranks_and_lists():
    assert parse_ranks(None, 2) == [1, 2]
    assert parse_ranks(None, 1) == [1]
    assert parse_ranks("2", 2) == [2]
    with pytest.raises(ValueError, match="each count must be 1 or 2"):
        parse_ranks("1,3", 2)
    with pytest.raises(ValueError, match="comma list of integers"):
        parse_ranks("two", 2)
    assert parse_list("mlp, cnn,mlp", MODELS, "model") == ["mlp", "cnn"]
    with pytest.raises(ValueError, match="valid: plain"):
        parse_list("plain,tensorflow", COMPETITORS, "competitor")


def test_combine_takes_each_ranks_median_then_the_slowest_rank():
    r0 = {"step_s": [1.0, 2.0, 9.0], "faults": [0.0, 0.0, 0.0]}
    r1 = {"step_s": [3.0, 3.0, 3.0], "faults": [5.0, 5.0, 5.0]}
    assert combine([r0, r1]) == {"step_s": 3.0, "faults": 5.0}
    row = summarize_repeats([{"step_s": 0.1}, {"step_s": 0.3}, {"step_s": 0.2}])
    assert row["step_s"] == 0.2 and row["spread_s"] == pytest.approx(0.2) and row["repeats"] == 3


def _row(model, competitor, ranks, step, **extra):
    return dict(model=model, competitor=competitor, ranks=ranks, step_s=step, samples_per_s=ranks * 64 / step,
                spread_s=0.001, **extra)


def test_table_and_targets():
    rows = [_row("mlp", "plain", 1, 0.100), _row("mlp", "hpctrain", 1, 0.102, compute_s=0.1, wait_s=0.0),
            _row("mlp", "plain", 2, 0.104), _row("mlp", "hpctrain", 2, 0.110, compute_s=0.1, wait_s=0.01, comm_s=0.02,
                                             cpu_s=0.1),
            _row("mlp", "ddp-gloo", 2, 0.200), _row("mlp", "horovod", 2, 0.180, cpu_s=0.2)]
    lines = target_lines(rows, 2)
    text = "\n".join(lines)
    assert "hpctrain / DDP-Gloo step (2 rank(s)) 0.550" in text and "met" in text
    assert "hpctrain / DDP-Gloo step (2 rank(s)) 0.550  target" in text
    assert "hpctrain / Horovod step (2 rank(s)) 0.611 (CPU per step: 0.500)  target <= 0.55: NOT met" in text
    assert "hpctrain scaling efficiency (2 vs 1 rank(s)) 90.9%  target >= 90%: met" in text
    assert "hpctrain 1-rank overhead (1 rank(s)) +2.0%  target <= 3%: met" in text
    # added over plain at 2 ranks: hpctrain 6 ms, DDP 96 ms, Horovod 76 ms
    assert "hpctrain / DDP-Gloo added time (2 rank(s)) +6.0 ms / +96.0 ms = 0.063  target <= 0.15: met" in text
    assert "hpctrain / Horovod added time (2 rank(s)) +6.0 ms / +76.0 ms = 0.079  target <= 0.15: met" in text
    buf = StringIO()
    print_table(rows, 2, {"malloc": "x"}, out=buf)
    table = buf.getvalue()
    assert "malloc: x" in table
    hp2 = next(line for line in table.splitlines() if line.split()[:3] == ["2", "mlp", "hpctrain"])
    assert hp2.split()[3:12] == ["110.0", "1.0", "1164", "91%", "100.0", "10.0", "20.0", "100.0", "-"]


def test_targets_skip_missing_rows_and_single_rank_runs():
    rows = [_row("cnn", "plain", 1, 0.1), _row("cnn", "hpctrain", 1, 0.2)]
    lines = target_lines(rows, 1)
    assert len(lines) == 1 and "1-rank overhead" in lines[0] and "NOT met" in lines[0]


def test_added_time_ratio_fails_when_hpctrain_adds_too_much_and_says_when_the_peer_added_nothing():
    rows = [_row("mlp", "plain", 2, 0.100), _row("mlp", "hpctrain", 2, 0.120),
            _row("mlp", "ddp-gloo", 2, 0.200), _row("mlp", "horovod", 2, 0.095)]
    text = "\n".join(target_lines(rows, 2))
    assert "hpctrain / DDP-Gloo added time (2 rank(s)) +20.0 ms / +100.0 ms = 0.200  target <= 0.15: NOT met" in text
    assert "hpctrain / Horovod added time (2 rank(s)) +20.0 ms / -5.0 ms: the peer added nothing, no ratio" in text
    # without the plain row at 2 ranks there is nothing to subtract: no added-time line
    text = "\n".join(target_lines([r for r in rows if r["competitor"] != "plain"], 2))
    assert "added time" not in text and "DDP-Gloo step" in text
