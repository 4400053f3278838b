"""hpctrain.comm as a single process (no mpiexec): init works, collectives are identities,
buffers keep their type, bad input says what is wrong."""
import numpy as np
import pytest
import torch

from hpctrain import comm
from hpctrain.comm import guard
from hpctrain.comm.buffers import finish_average, flatten, reduce_into


def test_single_process_collectives():
    comm.init()
    assert comm.size() >= 1 and comm.is_initialized()
    if comm.size() != 1:
        pytest.skip("this module is meant to run as a single process")
    x = np.arange(10, dtype=np.float32)
    for algo in comm.ALGORITHMS:
        np.testing.assert_array_equal(comm.allreduce(x, algorithm=algo), x)
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    out = comm.allreduce(t, op="avg")
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3) and torch.equal(out, t)
    assert comm.allgather(x).shape == (10,)
    assert comm.allgather_object("a") == ["a"]
    assert comm.broadcast_object({"k": 1}) == {"k": 1}
    h = comm.allreduce_async(torch.ones(3))
    assert torch.equal(h.wait(), torch.ones(3)) and h.done()


def test_bad_input_messages():
    comm.init()
    with pytest.raises(ValueError, match="not contiguous"):
        comm.allreduce_(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="unknown reduction op 'mean'"):
        comm.allreduce(np.ones(3), op="mean")
    with pytest.raises(ValueError, match="unknown all-reduce algorithm"):
        comm.allreduce(np.ones(3), algorithm="magic")
    with pytest.raises(TypeError, match="numpy array or a CPU torch tensor"):
        comm.allreduce([1, 2, 3])
    with pytest.raises(ValueError, match="root must be a rank"):
        comm.broadcast(np.ones(2), root=5)
    with pytest.raises(ValueError, match="splits must be 1 non-negative row counts summing to 3"):
        comm.alltoall(np.ones(3), splits=[2])


def test_reduction_kernels_all_dtypes():
    for dtype in ["float16", "float32", "float64", "int8", "int32", "int64", "uint8"]:
        a, b = np.array([1, 5, 3], dtype=dtype), np.array([4, 2, 3], dtype=dtype)
        for op, ref in [("sum", a + b), ("max", np.maximum(a, b)), ("min", np.minimum(a, b)), ("prod", a * b)]:
            acc = a.copy()
            reduce_into(acc, b, op, dtype)
            np.testing.assert_array_equal(acc, ref)
    ta, tb = torch.tensor([1.5, -2.0], dtype=torch.bfloat16), torch.tensor([0.5, 3.0], dtype=torch.bfloat16)
    fa, fb = flatten(ta.clone()), flatten(tb)
    reduce_into(fa.array, fb.array, "sum", "bfloat16")
    assert torch.equal(torch.from_numpy(fa.array.view(np.int16)).view(torch.bfloat16), ta + tb)
    ints = np.array([7, -7], dtype=np.int32)
    finish_average(ints, 2, "int32")
    np.testing.assert_array_equal(ints, [3, -3])  # truncates toward zero, like C


def test_flatten_for_in_place_names_what_cannot_take_a_result():
    frozen = np.zeros(4, dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="allreduce_: array is read-only.*HINT"):
        flatten(frozen, writable=True, what="allreduce_")
    assert flatten(frozen).array is frozen  # reading it is fine
    with pytest.raises(ValueError, match="not C-contiguous"):
        flatten(np.zeros((4, 2))[:, 0], writable=True)


class _FakeGroup:
    name = "world"

    def describe_ranks(self, ranks):
        return "ranks " + ", ".join(map(str, ranks))


def test_mismatch_message_names_ranks_and_calls():
    h0 = guard.make_header(4, "allreduce", "sum", "float32", 10, "ring")
    h1 = guard.make_header(4, "allreduce", "sum", "float32", 12, "ring")
    msg = guard.mismatch_message(np.stack([h0, h0, h1]), _FakeGroup())
    assert "ranks 0, 1 called allreduce(sum, float32, 10 elements, ring)" in msg
    assert "ranks 2 called allreduce(sum, float32, 12 elements, ring)" in msg
    assert "HINT" in msg


def test_the_count_word_tells_shapes_apart_at_no_cost_for_1d():
    import torch

    assert guard.count_word((1000,), 1000) == 1000  # 1-D: the bare count, as before
    words = {guard.count_word(s, 1000) for s in [(10, 100), (100, 10), (1000, 1), (1, 1000), (1000,)]}
    assert len(words) == 5  # same element count, five shapes, five words
    assert guard.count_word(torch.Size([10, 100]), 1000) == guard.count_word((10, 100), 1000)
    assert guard.count_word((), 1) != guard.count_word((1,), 1)
    one = guard.grouped_shape([(5,), (9,)])
    assert guard.count_word(one, 14) not in (14, guard.count_word(guard.grouped_shape([(14,)]), 14))
    for w in words:  # the count is still there to read
        assert w & ((1 << 40) - 1) == 1000 and w >= 0


def test_mismatch_message_names_every_rank_s_shape_when_shapes_differ():
    h0 = guard.make_header(4, "allreduce", "sum", "float32", guard.count_word((10, 100), 1000), "native")
    h1 = guard.make_header(4, "allreduce", "sum", "float32", guard.count_word((100, 10), 1000), "native")
    headers = np.stack([h0, h1, h1])
    assert guard.shapes_differ(headers) and not guard.shapes_differ(np.stack([h1, h1]))
    msg = guard.mismatch_message(headers, _FakeGroup(), [(10, 100), (100, 10), (100, 10)])
    assert "ranks 0 called allreduce(sum, float32, 1000 elements of shape (10, 100), native)" in msg
    assert "ranks 1, 2 called allreduce(sum, float32, 1000 elements of shape (100, 10), native)" in msg
    shapes = [guard.grouped_shape([(3, 2), (4,)]), guard.grouped_shape([(2, 3), (4,)])]
    msg = guard.mismatch_message(np.stack([h0, h1]), _FakeGroup(), shapes)
    assert "shapes [(3, 2), (4,)]" in msg and "shapes [(2, 3), (4,)]" in msg
    assert "1000 elements of shape #" in guard.mismatch_message(np.stack([h0, h1]), _FakeGroup())


def test_join_headers_are_told_apart_from_a_mismatch():
    from hpctrain.comm import joining

    call = guard.make_header(7, "allreduce", "avg", "float32", guard.count_word((2, 3), 6), "shm")
    other = guard.make_header(7, "allreduce", "avg", "float32", 5, "shm")
    join = guard.make_header(7, "join")
    joins, common = joining.classify(np.stack([join, call, call]))
    assert joins == [0] and (common == call).all()
    assert common[4] & ((1 << 40) - 1) == 6  # what the joined rank adds zeros for
    assert joining.classify(np.stack([join, join, call]))[0] == [0, 1]
    assert joining.classify(np.stack([join, call, other])) == ([0], None)  # the others disagree
    assert joining.classify(np.stack([call, other])) == ([], None)  # no join: a plain mismatch
    assert joining.classify(np.stack([join, join])) == ([0, 1], None)  # every rank joined
    assert "join()" in guard.mismatch_message(np.stack([join, call]), _FakeGroup())


def test_refused_calls_and_names_in_the_mismatch_message():
    refused = guard.make_header(3, "invalid_call")
    call = guard.make_header(3, "allreduce", "sum", "float32", 4, "shm")
    msg = guard.mismatch_message(np.stack([call, refused]), _FakeGroup())
    assert "ranks 1 called a call whose arguments it refused" in msg
    a, b = guard.named_shape("grad.a", (4,)), guard.named_shape("grad.b", (4,))
    assert guard.count_word(a, 4) != guard.count_word(b, 4) and guard.count_word(a, 4) & ((1 << 40) - 1) == 4
    msg = guard.mismatch_message(np.stack([guard.make_header(3, "allreduce", "sum", "float32", guard.count_word(s, 4))
                                           for s in (a, b)]), _FakeGroup(), [a, b])
    assert "shape (4,) named 'grad.a'" in msg and "shape (4,) named 'grad.b'" in msg


def test_in_band_merges_keep_the_lower_ranks_part_on_the_left_with_mpis_conventions():
    left = np.array([1e8, 1.0, np.nan], dtype=np.float32)
    right = np.array([1.0, -2.0, 0.0], dtype=np.float32)
    out = np.empty(3, dtype=np.float32)
    guard.combine_parts(left, right, "min", out)
    assert np.isnan(out[2]) and out[1] == -2.0  # NaN anywhere is NaN, as every algorithm gives
    with np.errstate(over="raise"):  # overflow gives inf, as from MPI, without a numpy warning
        guard.combine_parts(np.full(1, 3e38, np.float32), np.full(1, 3e38, np.float32), "sum", out[:1])
    assert np.isinf(out[0])
    assert guard.part_dtype(np.dtype(np.float16), "sum") == np.float32  # float16 sums in float32 ...
    assert guard.part_dtype(np.dtype(np.float16), "max") == np.float16
    assert guard.part_dtype(np.dtype(np.int8), "sum") == np.int8
    part = np.array([2050.0, 2051.0], np.float32)
    guard.finish_part(part, np.dtype(np.float16), "sum", 3, "float16")  # ... rounded once at the end
    assert part.tolist() == [2050.0, 2052.0]
    part = np.array([3073.0], np.float32)  # 3073 rounds to 3072 in float16; / 3 in float16
    guard.finish_part(part, np.dtype(np.float16), "avg", 3, "float16")
    assert part[0] == np.float16(1024.0)
    ints = np.array([8, -8], np.int32)
    guard.finish_part(ints, np.dtype(np.int32), "avg", 3, "int32")
    assert ints.tolist() == [2, -2]  # integer averages truncate toward zero


def test_in_band_limit_and_dtypes():
    assert guard.inband_limit(64 * 1024, 4) == 64 * 1024
    # a rank swaps at most 512 KiB of in-band data per check (7 steps at 65 ranks)
    assert guard.inband_limit(1 << 20, 65) == guard.INBAND_SWAP_BYTES // 7 // 8 * 8
    assert guard.inband_limit(1 << 20, 4) == guard.INBAND_SWAP_BYTES // 2 == 256 * 1024
    assert guard.inband_limit(1001, 2) == 1000 and guard.inband_limit(4096, 1) == 0
    assert guard.inband_limit(0, 8) == 0
    assert guard.inband_reducible("float16", np.dtype(np.float16), "avg")
    assert guard.inband_reducible("complex64", np.dtype(np.complex64), "sum")
    assert not guard.inband_reducible("bfloat16", np.dtype(np.int16), "sum")  # held as int16: MPI upcasts it
    assert not guard.inband_reducible("bool", np.dtype(bool), "sum")
    assert not guard.inband_reducible("float32", np.dtype(np.float32), "adasum")
