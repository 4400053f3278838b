"""Conformance of hpctrain.torch with horovod.torch 0.28, one test per semantic.

Every expected value is derived from Horovod's own definitions (horovod/torch/mpi_ops.py and
functions.py of 0.28.1, and the C++ ScaleBuffer / ReducescatterOp it calls), written next to
each test as the rule it checks. The file uses only names that exist in both packages, so it
runs against Horovod with ``HVD_MODULE=horovod.torch HOROVOD_TIMELINE=DYNAMIC
HOROVOD_DYNAMIC_PROCESS_SETS=1`` (the last for ``add_process_set`` after ``init``).

Horovod names an unnamed operation ``<op>.noname.<handle>``, with a per-rank handle counter
that every call advances (a refused one too): once ranks have made different numbers of
calls (a rank outside a process set, a call refused on some ranks, a joined rank), their
unnamed operations no longer match and wait forever. So from the first such test on, every
collective here has an explicit name.
"""
import importlib
import os

import pytest
import torch

hvd = importlib.import_module(os.environ.get("HVD_MODULE", "hpctrain.torch"))
IS_HOROVOD = hvd.__name__.startswith("horovod")

RANKS = (2, 3)
TIMEOUT = 240

hvd.init()
R, N = hvd.rank(), hvd.size()
torch.set_num_threads(1)

# Process sets are registered collectively, once, in the same order on every rank.
EVEN = hvd.add_process_set([r for r in range(N) if r % 2 == 0])
ODD = hvd.add_process_set([r for r in range(N) if r % 2 == 1])
# Every rank but 0: set positions differ from global ranks (at 2 ranks that is ODD; Horovod
# refuses to register the same ranks twice).
TAIL = ODD if N == 2 else hvd.add_process_set(list(range(1, N)))
MY_PARITY = EVEN if R % 2 == 0 else ODD
PARITY_RANKS = [r for r in range(N) if r % 2 == R % 2]


@pytest.fixture(scope="module", autouse=True)
def _remove_process_sets_when_done():
    """The sets go with this file: other files run in the same processes (tests/test_mpi_suites.py)
    may register the same ranks."""
    yield
    for ps in (EVEN, ODD) if TAIL is ODD else (EVEN, ODD, TAIL):
        hvd.remove_process_set(ps)


def rows_of(dim0, rank, n):
    """ReducescatterOp::ComputeOutputShapeForRank: the first dim0 % n ranks get one row more."""
    return dim0 // n + (1 if rank < dim0 % n else 0)


# --------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("op,expected", [("Sum", N), ("Average", 1.0), ("Max", 1.0)])
def test_allreduce_gradient_reduces_with_the_forward_op(op, expected):
    # HorovodAllreduce.backward: allreduce(grad_output, op=ctx.op, same scale factors, same set).
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    y = hvd.allreduce(x, op=getattr(hvd, op))
    assert y.grad_fn is not None
    y.backward(torch.ones(3, dtype=torch.float64))
    assert torch.allclose(x.grad, torch.full((3,), float(expected), dtype=torch.float64))


def test_allreduce_gradient_uses_the_scale_factors():
    # An explicit contiguous output gradient: Horovod refuses the expanded one of .sum().backward().
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0)
    y.backward(torch.ones_like(y))
    assert torch.allclose(x.grad, torch.full((2,), 6.0 * N, dtype=torch.float64))
    if not IS_HOROVOD:  # hpctrain also takes a non-contiguous output gradient
        x.grad = None
        hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0).sum().backward()
        assert torch.allclose(x.grad, torch.full((2,), 6.0 * N, dtype=torch.float64))


def test_grouped_allreduce_gradient():
    # HorovodGroupedAllreduce.backward: grouped_allreduce of the output gradients.
    xs = [torch.ones(2, dtype=torch.float64, requires_grad=True), torch.ones(3, 2, requires_grad=True)]
    ys = hvd.grouped_allreduce(xs, op=hvd.Sum)
    assert all(y.grad_fn is not None for y in ys)
    torch.autograd.backward(ys, [torch.full_like(y, float(R + 1)) for y in ys])
    for x in xs:
        assert torch.allclose(x.grad.double(), torch.full(x.shape, N * (N + 1) / 2, dtype=torch.float64))


def test_allgather_gradient_is_my_slice_of_the_average():
    # HorovodAllgather.backward: allreduce(grad_output, average=True), narrowed to this rank's rows.
    x = torch.ones(R + 1, 2, dtype=torch.float64, requires_grad=True)
    out = hvd.allgather(x)
    out.backward(torch.full_like(out, float(R + 1)))
    assert torch.allclose(x.grad, torch.full_like(x, (N + 1) / 2))


def test_allgather_gradient_horovod_test_form():
    # test_horovod_allgather_grad: the same grad_ys on every rank gives rank r the rows valued r.
    x = torch.ones(R + 2, 3, dtype=torch.float64, requires_grad=True)
    out = hvd.allgather(x)
    grad_ys = torch.cat([torch.full((r + 2, 3), float(r), dtype=torch.float64) for r in range(N)])
    out.backward(grad_ys)
    assert torch.equal(x.grad, torch.full_like(x, float(R)))


def test_grouped_allgather_forward_and_gradient():
    xs = [torch.full((R + 1,), float(R), requires_grad=True),
          torch.ones(R + 1, 2, dtype=torch.float64, requires_grad=True)]
    outs = hvd.grouped_allgather(xs)
    assert torch.equal(outs[0].detach(), torch.cat([torch.full((r + 1,), float(r)) for r in range(N)]))
    assert outs[1].shape == (N * (N + 1) // 2, 2)
    torch.autograd.backward(outs, [torch.full_like(o, float(R + 1)) for o in outs])
    for x in xs:
        assert torch.allclose(x.grad.double(), torch.full(x.shape, (N + 1) / 2, dtype=torch.float64))


@pytest.mark.parametrize("root", sorted({0, N - 1}))
def test_broadcast_gradient_goes_to_root_only(root):
    # HorovodBroadcast.backward: allreduce(grad_output, average=True); zero where rank() != root_rank.
    x = torch.full((3,), float(R), dtype=torch.float64, requires_grad=True)
    y = hvd.broadcast(x, root)
    assert torch.equal(y.detach(), torch.full((3,), float(root), dtype=torch.float64))
    y.backward(torch.full((3,), float(R + 1), dtype=torch.float64))
    assert torch.allclose(x.grad, torch.full((3,), (N + 1) / 2 if R == root else 0.0, dtype=torch.float64))


def test_alltoall_gradient_returns_to_the_sender():
    # HorovodAlltoall.backward: alltoall(grad_output, splits=received_splits): every row's
    # gradient goes back to the rank it came from, so grad_output = output gives grad = input.
    splits = [(R + d) % 3 + 1 for d in range(N)]
    x = torch.arange(sum(splits) * 2, dtype=torch.float64).reshape(-1, 2).add(100 * R).requires_grad_(True)
    out, received = hvd.alltoall(x, splits=splits)
    assert received.dtype == torch.int32 and received.tolist() == [(r + R) % 3 + 1 for r in range(N)]
    out.backward(out.detach())
    assert torch.equal(x.grad, x.detach())
    y = torch.ones(2 * N, dtype=torch.float64, requires_grad=True)
    z = hvd.alltoall(y)  # even split: a single tensor comes back
    z.backward(torch.ones_like(z))
    assert torch.equal(y.grad, torch.ones_like(y))


@pytest.mark.parametrize("op,factor", [("Average", 1), ("Sum", N)])
def test_reducescatter_gradient_is_an_allgather(op, factor):
    # HorovodReducescatter.backward: grad_output * (size if Sum) * prescale * postscale, allgathered.
    dim0 = 2 * N + 1
    x = torch.ones(dim0, 2, dtype=torch.float64, requires_grad=True)
    part = hvd.reducescatter(x, op=getattr(hvd, op), prescale_factor=2.0)
    assert part.shape == (rows_of(dim0, R, N), 2) and part.grad_fn is not None
    part.backward(torch.full_like(part, float(R + 1)))
    expected = torch.cat([torch.full((rows_of(dim0, r, N), 2), float(r + 1)) for r in range(N)]).double()
    assert torch.allclose(x.grad, expected * factor * 2.0)


def test_grouped_reducescatter_forward_and_gradient():
    xs = [torch.full((N + 1, 2), float(R + 1), dtype=torch.float64, requires_grad=True),
          torch.full((N,), float(R + 1), dtype=torch.float64, requires_grad=True)]
    parts = hvd.grouped_reducescatter(xs, op=hvd.Sum)
    assert parts[0].shape == (rows_of(N + 1, R, N), 2) and parts[1].shape == (1,)
    assert torch.allclose(parts[1], torch.full((1,), N * (N + 1) / 2, dtype=torch.float64))
    torch.autograd.backward(parts, [torch.ones_like(p) for p in parts])
    for x in xs:
        assert torch.allclose(x.grad, torch.full_like(x, float(N)))


# --------------------------------------------------------------------------- integer scaling
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_prescale_postscale_truncate(dtype):
    # ScaleBufferCPUImpl: output = scale_factor (double) * input, stored back in the integer type.
    x = torch.full((4,), R + 1, dtype=dtype)
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.5)
    assert out.dtype == dtype
    assert out.tolist() == [sum(int(2.5 * (r + 1)) for r in range(N))] * 4
    out = hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.5)
    assert out.tolist() == [int(0.5 * (N * (N + 1) // 2))] * 4


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.bool])
def test_allreduce_refuses_the_types_horovod_has_no_kernel_for(dtype):
    # _check_function: no horovod_torch_allreduce_async_torch_ByteTensor (nor Char, Short, Bool).
    with pytest.raises(ValueError, match="is not supported"):
        hvd.allreduce(torch.ones(4, dtype=dtype), op=hvd.Sum, name="refused.type")
    with pytest.raises(ValueError, match="is not supported"):
        hvd.grouped_allreduce([torch.ones(4, dtype=dtype), torch.ones(2)], op=hvd.Sum, name="refused.types")
    _still_usable()


def test_integer_average_is_sum_times_one_over_size():
    # Average: the sum scaled by postscale_factor / size, truncated.
    x = torch.full((3,), R + 1, dtype=torch.int32)
    assert hvd.allreduce(x).tolist() == [int(N * (N + 1) / 2 * (1.0 / N))] * 3
    y = x.clone()
    hvd.allreduce_(y, op=hvd.Average, prescale_factor=3.0)
    assert y.tolist() == [int(3 * N * (N + 1) / 2 * (1.0 / N))] * 3


# --------------------------------------------------------------------------- names
def test_duplicate_process_set_is_refused():
    with pytest.raises(ValueError):
        hvd.add_process_set([r for r in range(N) if r % 2 == 0])


def test_exceptions_exist_with_horovods_bases():
    # horovod.torch exports HorovodInternalError only; HostsUpdatedInterrupt lives in
    # horovod.common.exceptions (hpctrain.torch exports both).
    interrupt = importlib.import_module("horovod.common.exceptions").HostsUpdatedInterrupt if IS_HOROVOD \
        else hvd.HostsUpdatedInterrupt
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert issubclass(interrupt, RuntimeError)
    assert interrupt(True).skip_sync is True


def test_grouped_async_variants():
    h = hvd.grouped_allgather_async([torch.full((1,), float(R)), torch.full((2,), float(R))])
    outs = hvd.synchronize(h)
    assert [o.tolist() for o in outs] == [[float(r) for r in range(N)], [float(r) for r in range(N) for _ in (0, 1)]]
    h = hvd.grouped_reducescatter_async([torch.ones(N, 3)], op=hvd.Sum)
    (part,) = hvd.synchronize(h)
    assert torch.equal(part, torch.full((1, 3), float(N)))


def test_sparse_allreduce_async_allgathers_indices_and_values():
    # sparse_allreduce_async: allgather of indices and values; Average divides the values by size.
    t = torch.sparse_coo_tensor(torch.tensor([[R, N]]), torch.tensor([1.0, float(R + 1)]), (N + 1,))
    handle = hvd.sparse_allreduce_async(t, name="sparse.test", op=hvd.Average)
    result = handle()
    dense = result.to_dense()
    expected = torch.zeros(N + 1)
    expected[:N] = 1.0 / N
    expected[N] = (N + 1) / 2
    assert torch.allclose(dense, expected)


# --------------------------------------------------------------------------- process sets
def test_broadcast_root_is_a_global_rank_in_a_process_set():
    if R == 0:
        return  # not a member of TAIL
    root = N - 1  # global rank; its position in TAIL is N - 2
    x = torch.full((2,), float(R))
    assert torch.equal(hvd.broadcast(x, root, process_set=TAIL, name="tail.bcast"), torch.full((2,), float(root)))
    y = x.clone()
    hvd.broadcast_(y, root, process_set=TAIL, name="tail.bcast_")
    assert torch.equal(y, torch.full((2,), float(root)))
    assert hvd.broadcast_object({"r": R}, root_rank=root, process_set=TAIL) == {"r": root}


def test_broadcast_object_in_parity_sets():
    root = PARITY_RANKS[-1]
    assert hvd.broadcast_object(("from", R), root_rank=root, process_set=MY_PARITY) == ("from", root)


def test_distributed_optimizer_with_even_and_odd_sets():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), process_set=MY_PARITY)
    # loss = (R + 1) * sum(w): each rank's gradient is R + 1; the set averages over its ranks.
    (model.weight.sum() * (R + 1)).backward()
    opt.step()
    mean = sum(r + 1 for r in PARITY_RANKS) / len(PARITY_RANKS)
    assert torch.allclose(model.weight.detach(), torch.full((1, 2), 1.0 - mean, dtype=torch.float64))
    w = torch.full((2,), float(R))
    hvd.broadcast_(w, root_rank=PARITY_RANKS[-1], process_set=MY_PARITY, name="parity.w")  # root: a global rank
    assert torch.equal(w, torch.full((2,), float(PARITY_RANKS[-1])))


# --------------------------------------------------------------------------- reducescatter
@pytest.mark.parametrize("dim0", [N, N + 1, 2 * N - 1])
def test_reducescatter_uneven_rows_and_average(dim0):
    x = torch.arange(dim0, dtype=torch.float64).reshape(dim0, 1) * (R + 1)
    start = sum(rows_of(dim0, r, N) for r in range(R))
    mine = torch.arange(start, start + rows_of(dim0, R, N), dtype=torch.float64).reshape(-1, 1)
    assert torch.allclose(hvd.reducescatter(x, name="rs.avg"), mine * (N + 1) / 2)  # default op is Average
    assert torch.allclose(hvd.reducescatter(x, op=hvd.Sum, name="rs.sum"), mine * N * (N + 1) / 2)


def test_reducescatter_in_a_process_set():
    x = torch.full((3, 2), float(R + 1))
    part = hvd.reducescatter(x, op=hvd.Sum, process_set=MY_PARITY, name="rs.parity")
    me = PARITY_RANKS.index(R)
    assert part.shape == (rows_of(3, me, len(PARITY_RANKS)), 2)
    assert torch.allclose(part, torch.full_like(part, float(sum(r + 1 for r in PARITY_RANKS))))


# --------------------------------------------------------------------------- init(comm=...)
def test_init_accepts_a_rank_list_and_a_communicator():
    from mpi4py import MPI

    hvd.init(comm=list(range(N)))
    hvd.init(comm=MPI.COMM_WORLD)
    assert (hvd.rank(), hvd.size()) == (R, N)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="init.again").item() == N


# --------------------------------------------------------------------------- errors
def _still_usable():
    x = torch.full((2,), float(R))
    assert hvd.allreduce(x, op=hvd.Sum, name="usable.sum").tolist() == [N * (N - 1) / 2] * 2
    assert hvd.broadcast(x[:1], N - 1, name="usable.bcast").item() == N - 1


def test_root_outside_the_set_raises_everywhere():
    # EnqueueTensorBroadcast: "broadcast received invalid root rank" is an InvalidArgument (ValueError).
    with pytest.raises(ValueError):
        hvd.broadcast(torch.ones(2), N, name="bad.root")
    if R != 0:
        with pytest.raises(ValueError):
            hvd.broadcast(torch.ones(2), 0, process_set=TAIL, name="bad.root.tail")  # rank 0 is not in TAIL
    _still_usable()


def test_mismatched_root_raises_on_every_rank():
    # Controller: "Mismatched broadcast root ranks" reaches every rank through synchronize().
    with pytest.raises(RuntimeError):
        hvd.broadcast(torch.ones(2), 0 if R == 0 else 1, name="mismatch.root")
    _still_usable()


def test_mismatched_shapes_and_dtypes_raise_on_every_rank():
    with pytest.raises(RuntimeError):
        hvd.allgather(torch.ones(2, R + 1), name="mismatch.allgather")  # dims other than the first must match
    with pytest.raises(RuntimeError):
        hvd.broadcast(torch.ones(2, dtype=torch.float32 if R == 0 else torch.float64), 0, name="mismatch.bcast")
    with pytest.raises(RuntimeError):
        hvd.reducescatter(torch.ones(N + R, 2), name="mismatch.rs")
    with pytest.raises(RuntimeError):
        hvd.allreduce(torch.ones(R + 1), name="mismatch.allreduce")
    _still_usable()


def test_scalar_to_reducescatter_raises_everywhere():
    # GetReducescatterOutputShape: "Reducescatter does not support scalar inputs" (ValueError).
    with pytest.raises(ValueError):
        hvd.reducescatter(torch.tensor(1.0), name="scalar.rs")
    if not IS_HOROVOD:  # Horovod raises on that rank only and the others wait for it forever
        with pytest.raises((ValueError, RuntimeError)):  # one rank's scalar: every rank raises
            hvd.reducescatter(torch.tensor(1.0) if R == N - 1 else torch.ones(N), name="scalar.rs.one")
    _still_usable()


def test_duplicate_pending_name_raises_and_the_first_survives():
    # TensorQueue::AddToTensorQueue: DUPLICATE_NAME_ERROR (InvalidArgument: ValueError).
    x = torch.full((3,), float(R))
    first = hvd.allreduce_async(x, name="dup.name", op=hvd.Sum)
    with pytest.raises(ValueError):
        hvd.allreduce_async(x, name="dup.name", op=hvd.Sum)
    assert hvd.synchronize(first).tolist() == [N * (N - 1) / 2] * 3
    again = hvd.allreduce_async(x, name="dup.name", op=hvd.Sum)  # free again once synchronized
    assert hvd.synchronize(again).tolist() == [N * (N - 1) / 2] * 3
    _still_usable()


# The same queue holds every kind of operation: the rule is not allreduce's alone.
ASYNC_STARTS = {
    "allgather_async": lambda x, name: hvd.allgather_async(x, name=name),
    "grouped_allgather_async": lambda x, name: hvd.grouped_allgather_async([x, x], name=name),
    "broadcast_async": lambda x, name: hvd.broadcast_async(x, root_rank=0, name=name),
    "broadcast_async_": lambda x, name: hvd.broadcast_async_(x, root_rank=0, name=name),
    "alltoall_async": lambda x, name: hvd.alltoall_async(x, name=name),
    "reducescatter_async": lambda x, name: hvd.reducescatter_async(x, name=name, op=hvd.Sum),
    "grouped_reducescatter_async": lambda x, name: hvd.grouped_reducescatter_async([x, x], name=name, op=hvd.Sum),
}


@pytest.mark.parametrize("kind", sorted(ASYNC_STARTS))
def test_every_async_operation_refuses_a_pending_name(kind):
    # test_horovod_allgather/broadcast_duplicate_name_error: a second operation under a name
    # still pending raises ValueError; once the first is synchronized the name is free.
    start = ASYNC_STARTS[kind]
    x = torch.full((N * 2,), float(R + 1))
    name = f"dup.{kind}"
    first = start(x, name)
    with pytest.raises(ValueError):
        start(x, name)
    hvd.synchronize(first)
    hvd.synchronize(start(x, name))
    _still_usable()


@pytest.mark.parametrize("kind", sorted(ASYNC_STARTS))
def test_a_dropped_handle_keeps_its_name_until_a_later_wait(kind):
    # Horovod's test_torch.py run in one process: each *_duplicate_name_error test drops its
    # first handle unsynchronized and a later test reuses the name. Right after the drop the
    # name is still refused (in a tight loop, on every rank); once a later collective has
    # waited past the dropped operation, it is free again.
    start = ASYNC_STARTS[kind]
    x = torch.full((N * 2,), float(R + 1))
    name = f"dropped.{kind}"
    start(x, name)  # the handle is dropped
    with pytest.raises(ValueError):
        for _ in range(10):
            start(x, name)
    hvd.allreduce(torch.ones(1), op=hvd.Sum, name=f"after.{kind}")
    hvd.synchronize(start(x, name))
    _still_usable()


@pytest.mark.skipif(IS_HOROVOD, reason="Horovod checks a name against this rank's own queue only")
@pytest.mark.parametrize("kind", sorted(ASYNC_STARTS))
def test_a_name_pending_on_one_rank_only_raises_everywhere_for_every_async_operation(kind):
    start = ASYNC_STARTS[kind]
    x = torch.full((N * 2,), float(R + 1))
    name = f"dup.one.{kind}"
    first = start(x, name)
    if R == 0:
        hvd.synchronize(first)  # free again on rank 0 only
    with pytest.raises((ValueError, RuntimeError)):  # ValueError where pending, HorovodInternalError on rank 0
        hvd.synchronize(start(x, name))
    if R != 0:
        hvd.synchronize(first)
    _still_usable()


@pytest.mark.skipif(IS_HOROVOD, reason="Horovod raises on that rank only and the others wait for it forever")
def test_argument_error_on_one_rank_raises_on_every_rank():
    # Horovod's rule (a bad call costs one exception per rank, the job stays usable), for the
    # all-reduces, whose calls hpctrain does not describe to each other beforehand.
    bad = R == N - 1
    with pytest.raises((ValueError, RuntimeError)):
        hvd.allreduce(torch.ones(3), op=99 if bad else hvd.Sum)
    _still_usable()
    with pytest.raises((TypeError, RuntimeError)):
        hvd.allreduce_("not a tensor" if bad else torch.ones(3), op=hvd.Sum)
    _still_usable()
    if bad:
        with pytest.raises(ValueError):
            hvd.allreduce_async(torch.ones(2), op=99)
    else:
        handle = hvd.allreduce_async(torch.ones(2), op=hvd.Sum)
        with pytest.raises(RuntimeError):
            hvd.synchronize(handle)
    with pytest.raises((ValueError, RuntimeError)):
        hvd.grouped_allreduce([torch.ones(2), torch.ones(1)], op=99 if bad else hvd.Sum)
    _still_usable()


def test_duplicate_name_pending_on_one_rank_only_raises_everywhere():
    x = torch.full((3,), float(R))
    first = hvd.allreduce_async(x, name="dup.one", op=hvd.Sum)
    total = [N * (N - 1) / 2] * 3
    if R == 0:
        assert hvd.synchronize(first).tolist() == total  # rank 0's name is free again, the others' still pending
    if IS_HOROVOD:
        # Horovod checks a name against this rank's own queue only: nothing is refused, and the
        # pending operation completes on the others.
        if R != 0:
            assert hvd.synchronize(first).tolist() == total
        _still_usable()
        return
    with pytest.raises((ValueError, RuntimeError)):
        hvd.synchronize(hvd.allreduce_async(x, name="dup.one", op=hvd.Sum))
    if R != 0:
        assert hvd.synchronize(first).tolist() == total
    _still_usable()


def test_names_submitted_in_different_orders():
    # Horovod matches by name, so both orders give each name's sum. hpctrain matches by
    # submission order and checks the names: every rank raises, none mixes two tensors.
    a, b = torch.full((2,), float(R)), torch.full((2,), 10.0 * R)
    order = ["order.a", "order.b"] if R % 2 == 0 else ["order.b", "order.a"]
    handles = {name: hvd.allreduce_async({"order.a": a, "order.b": b}[name], name=name, op=hvd.Sum)
               for name in order}
    if IS_HOROVOD:
        assert hvd.synchronize(handles["order.a"]).tolist() == [N * (N - 1) / 2] * 2
        assert hvd.synchronize(handles["order.b"]).tolist() == [10 * N * (N - 1) / 2] * 2
    else:
        for name in order:
            with pytest.raises(RuntimeError, match="order"):
                hvd.synchronize(handles[name])
    gathers = {name: hvd.allgather_async(torch.full((1, 2), float(R)), name=name.replace("order", "order.g"))
               for name in order}
    for name in order:
        if IS_HOROVOD:
            assert hvd.synchronize(gathers[name]).tolist() == [[float(r)] * 2 for r in range(N)]
        else:
            with pytest.raises(RuntimeError, match="order"):
                hvd.synchronize(gathers[name])
    same = [hvd.allreduce_async(a, name="order.same", op=hvd.Sum)]
    assert hvd.synchronize(same[0]).tolist() == [N * (N - 1) / 2] * 2
    _still_usable()


# --------------------------------------------------------------------------- timeline
def _spans(events, pid):
    """(name, enclosing span's name or None) of every B event of trace process ``pid``."""
    stack, spans = [], []
    for e in events:
        if e.get("pid") != pid or e["ph"] not in "BE":
            continue
        if e["ph"] == "B":
            spans.append((e["name"], stack[-1] if stack else None))
            stack.append(e["name"])
        else:
            stack.pop()
    return spans


def test_timeline_is_a_chrome_trace_written_by_rank_0(tmp_path):
    # TimelineWriter: rank 0 writes JSON events, first a metadata event (pid 0) holding the
    # start time; each tensor is a trace "process" named "<op>.<name>" (M events); each
    # operation a NEGOTIATE_<OP> span, then an <OP> span holding its MPI_<OP> activity
    # (Timeline::NegotiateStart, Start, ActivityStart); the file is valid JSON once stopped.
    import json

    path = hvd.broadcast_object(str(tmp_path / "timeline.json"), root_rank=0)
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(2), name="tl.reduce")
    hvd.allgather(torch.ones(1), name="tl.gather")
    hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="tl.async"))
    hvd.stop_timeline()
    if R != 0:
        return
    events = json.load(open(path))
    assert events[0]["ph"] == "M" and events[0]["pid"] == 0
    assert events[0]["args"]["start_time_since_epoch_in_micros"] > 1.5e15  # microseconds since the epoch
    names = {e["args"]["name"]: e["pid"] for e in events if e.get("name") == "process_name" and "name" in e["args"]}
    assert {"allreduce.tl.reduce", "allgather.tl.gather", "allreduce.tl.async"} <= set(names)
    for row, op, activity in [("allreduce.tl.reduce", "ALLREDUCE", "MPI_ALLREDUCE"),
                              ("allgather.tl.gather", "ALLGATHER", "MPI_ALLGATHER"),
                              ("allreduce.tl.async", "ALLREDUCE", "MPI_ALLREDUCE")]:
        spans = _spans(events, names[row])
        assert spans[0] == (f"NEGOTIATE_{op}", None) and (op, None) in spans and (activity, op) in spans
    assert sum(e["ph"] == "B" for e in events) == sum(e["ph"] == "E" for e in events)


# --------------------------------------------------------------------------- optimizer state
@pytest.mark.parametrize("wrapped", [False, True])
def test_broadcast_optimizer_state_first_steps_on_zero_gradients(wrapped):
    # functions.py broadcast_optimizer_state: an optimizer with no state gets a zero gradient
    # for every parameter and one step of the wrapped optimizer (no all-reduce, on every rank),
    # which creates its state and applies weight decay: w1 = w0 - lr * wd * w0, and SGD's
    # momentum buffer is wd * w0; the gradients stay zero tensors.
    torch.manual_seed(4)
    model = torch.nn.Linear(3, 2).double()
    w0 = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    if wrapped:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    torch.testing.assert_close(model.weight.detach(), w0 - 0.1 * 0.01 * w0, rtol=1e-12, atol=1e-15)
    state = opt.state_dict()["state"]
    assert len(state) == 2
    torch.testing.assert_close(state[0]["momentum_buffer"], 0.01 * w0, rtol=1e-12, atol=1e-15)
    assert model.weight.grad is not None and not model.weight.grad.any()


def test_broadcast_optimizer_state_takes_the_model_for_sparse_embeddings():
    # With model=, SGD's parameters of sparse embeddings get a sparse zero gradient for that step
    # (the third positional argument is the model, as in Horovod).
    torch.manual_seed(5)
    model = torch.nn.Embedding(6, 2, sparse=True).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(opt, 0, model)
    assert model.weight.grad.is_sparse


# --------------------------------------------------------------------------- sparse gradients
def _embedding_batch(rank):
    return torch.tensor([[rank % 4, 4], [rank + 1, 5 + rank % 3]])


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embedding_with_sparse_adam(sparse_as_dense):
    # DistributedOptimizer: a sparse gradient goes through sparse_allreduce_async (allgather of
    # indices and values, values / size for Average); sparse_as_dense all-reduces it densely,
    # then makes the result sparse again before the update (optimizer.py synchronize()).
    def make():
        torch.manual_seed(1)
        return torch.nn.Embedding(8, 3, sparse=True).double()

    model, ref = make(), make()
    inner = torch.optim.SparseAdam(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), sparse_as_dense=sparse_as_dense)
    for _ in range(2):
        opt.zero_grad()
        model(_embedding_batch(R)).pow(2).sum().backward()
        opt.step()
        assert model.weight.grad.is_sparse
    # Reference: one process, the average of every rank's gradient, the same optimizer.
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    for _ in range(2):
        grads = []
        for r in range(N):
            ref.zero_grad()
            ref(_embedding_batch(r)).pow(2).sum().backward()
            grads.append(ref.weight.grad.coalesce())
        g = grads[0]
        for other in grads[1:]:
            g = g + other
        ref.weight.grad = (g / N).coalesce()
        ref_opt.step()
    assert torch.allclose(model.weight.detach(), ref.weight.detach(), atol=1e-12)


def test_sparse_as_dense_still_needs_a_sparse_optimizer():
    # The gradient is sparse again when the wrapped optimizer runs: torch.optim.Adam refuses it.
    torch.manual_seed(1)
    model = torch.nn.Embedding(8, 3, sparse=True).double()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), sparse_as_dense=True)
    opt.zero_grad()
    model(_embedding_batch(R)).pow(2).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    _still_usable()


# --------------------------------------------------------------------------- asynchronous ops
@pytest.mark.parametrize("kind", ["allgather", "broadcast", "alltoall", "reducescatter"])
def test_async_ops_return_before_the_others_arrive(kind):
    # Every *_async op is enqueued and returns a handle; poll() is False until it has run.
    import time

    x = torch.full((N, 2), float(R + 1))
    name = f"async.{kind}"
    start = {"allgather": lambda: hvd.allgather_async(x, name=name),
             "broadcast": lambda: hvd.broadcast_async(x, 0, name=name),
             "alltoall": lambda: hvd.alltoall_async(x, name=name),
             "reducescatter": lambda: hvd.reducescatter_async(x, op=hvd.Sum, name=name)}
    hvd.barrier()
    if R != 0:
        time.sleep(1.5)  # rank 0 submits long before the others
    t0 = time.perf_counter()
    handle = start[kind]()
    submitted = time.perf_counter() - t0
    if R == 0:
        assert submitted < 1.0 and not hvd.poll(handle)
    out = hvd.synchronize(handle)
    with pytest.raises(ValueError, match="cleared"):  # synchronize() released the handle
        hvd.poll(handle)
    expected = {"allgather": lambda: torch.cat([torch.full((N, 2), float(r + 1)) for r in range(N)]),
                "broadcast": lambda: torch.full((N, 2), 1.0),
                "alltoall": lambda: torch.tensor([[float(r + 1)] * 2 for r in range(N)]),
                "reducescatter": lambda: torch.full((1, 2), N * (N + 1) / 2)}[kind]()
    if kind == "alltoall":  # Horovod's alltoall_async handle yields (output, received_splits)
        out, received = out
        assert received.tolist() == [1] * N
    assert torch.equal(out, expected)


def test_async_errors_reach_every_rank():
    with pytest.raises(ValueError):
        hvd.broadcast_async(torch.ones(2), N, name="async.bad.root")  # invalid root: raised when enqueued
    handle = hvd.broadcast_async(torch.ones(2), 0 if R == 0 else N - 1, name="async.mismatch")  # mismatched roots
    with pytest.raises(RuntimeError):
        hvd.synchronize(handle)
    _still_usable()


# --------------------------------------------------------------------------- join
def test_join_stands_in_for_zeros_in_the_others_allreduces():
    # Controller: a joined rank's requests count as ready; its part of an allreduce is a zero
    # tensor, and Average divides by the set's size (postscale_factor /= size), joined or not.
    # Allgather and broadcast are refused while a rank is joined ("not supported with Join").
    others = sum(r + 1.0 for r in range(1, N))
    if R == 0:
        assert hvd.join() == N - 1
    else:
        sums = hvd.allreduce(torch.full((2, 3), R + 1.0), op=hvd.Sum, name="join.sum")
        assert sums.tolist() == [[others] * 3] * 2
        assert torch.allclose(hvd.allreduce(torch.full((4,), R + 1.0), name="join.avg"), torch.full((4,), others / N))
        ints = hvd.allreduce(torch.full((3,), R + 1, dtype=torch.int32), op=hvd.Sum, name="join.int")
        assert ints.tolist() == [int(others)] * 3
        parts = hvd.grouped_allreduce([torch.full((2,), R + 1.0), torch.full((1, 2), 2.0 * R)], op=hvd.Sum,
                                      name="join.grouped")
        assert parts[0].tolist() == [others] * 2 and parts[1].tolist() == [[2.0 * (others - N + 1)] * 2]
        handle = hvd.allreduce_async_(torch.full((5,), R + 1.0), op=hvd.Sum, name="join.async")
        assert hvd.synchronize(handle).tolist() == [others] * 5
        with pytest.raises(RuntimeError):
            hvd.allgather(torch.ones(1, 2), name="join.allgather")
        with pytest.raises(RuntimeError):
            hvd.broadcast(torch.ones(2), 1, name="join.bcast")
        if not IS_HOROVOD:  # Horovod 0.28.1 crashes (SIGSEGV) on a barrier while a rank is joined
            with pytest.raises(RuntimeError):
                hvd.barrier()
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="join.usable").item() == N - 1  # still usable
        assert hvd.join() == N - 1
    _still_usable()
    everyone = hvd.allgather(torch.full((1, 2), float(R)), name="join.after")
    assert everyone.tolist() == [[float(r)] * 2 for r in range(N)]


def test_join_returns_the_last_rank_to_join():
    # Every rank r > 0 makes r all-reduces after rank 0 joined, then joins: rank N-1 is last.
    if R > 0:
        for i in range(R):
            hvd.allreduce(torch.ones(3), op=hvd.Sum, name=f"join.last.{i}")
    assert hvd.join() == N - 1
    if not IS_HOROVOD:  # every rank joining at once: the highest rank counts as the last
        assert hvd.join() == N - 1
    _still_usable()


def test_join_lets_ranks_with_more_batches_train_with_the_distributed_optimizer():
    # Rank 0 has 2 batches, the others 4: their steps 3 and 4 average over all N ranks with
    # rank 0's zeros (w -= lr * sum_{r>0} grad_r / N), as Horovod computes them.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    w0 = model.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    batches = {r: 2 if r == 0 else 4 for r in range(N)}

    def batch(r, step):
        g = torch.Generator().manual_seed(100 * r + step)
        return torch.randn(5, 3, generator=g), torch.randn(5, 1, generator=g)

    for step in range(batches[R]):
        x, y = batch(R, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = hvd.join()
    assert last in range(1, N)
    # the same steps by hand
    w = w0.clone()
    for step in range(4):
        total = torch.zeros_like(w)
        for r in range(N):
            if step < batches[r]:
                x, y = batch(r, step)
                wr = w.clone().requires_grad_(True)
                torch.nn.functional.mse_loss(x @ wr.t(), y).backward()
                total += wr.grad
        w = w - 0.1 * total / N
        if step == 1 and R == 0:
            assert torch.allclose(model.weight.detach(), w, atol=1e-6)
    if R > 0:
        assert torch.allclose(model.weight.detach(), w, atol=1e-6)
    everyone = hvd.allgather(model.weight.detach(), name="join.weights")
    assert all(torch.equal(everyone[r], everyone[1]) for r in range(1, N))
    _still_usable()
