"""Process sets registered by hvd.init(process_sets=...), as in Horovod's own process-set tests:
a duplicate entry fails init but registers the rest; a second init attaches the same ranks to
the ids they have; sets given as mpi4py communicators (each rank its part of a split); the
world's ranks are the global set's; ids freed by remove_process_set are reused.

Runs against Horovod too (HVD_MODULE=horovod.torch HOROVOD_DYNAMIC_PROCESS_SETS=1), where
init must come first in the process, as here.
"""
import importlib
import os

import torch
from mpi4py import MPI

hvd = importlib.import_module(os.environ.get("HVD_MODULE", "hpctrain.torch"))
IS_HOROVOD = hvd.__name__.startswith("horovod")
world = MPI.COMM_WORLD
R, N = world.rank, world.size
assert N >= 2, "run with 2 or more ranks"


def raises(exc, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as err:
        return err
    raise AssertionError(f"{fn.__name__} did not raise {exc.__name__}")


def ids_and_ranks():
    return hvd.mpi_ops._basics._get_process_set_ids_and_ranks()


# 1. A duplicate in the list (the world's ranks, a communicator over the world, a set listed
#    twice) fails init; what is new is registered all the same: communicators' sets first.
parity = world.Split(color=R % 2, key=R)
evens, odds = list(range(0, N, 2)), list(range(1, N, 2))
raises(ValueError, hvd.init, comm=world, process_sets=[
    hvd.ProcessSet(parity), hvd.ProcessSet(world.Dup()), hvd.ProcessSet(range(N - 1, -1, -1)), hvd.ProcessSet([0])])
expected = {0: list(range(N)), 1: evens, 2: odds}
if N > 2:
    expected[3] = [0]
assert ids_and_ranks() == expected, ids_and_ranks()

# 2. The same sets again, without the duplicates: attached to the ids they have.
mine = hvd.ProcessSet(parity)
first = hvd.ProcessSet([0])
hvd.init(comm=world, process_sets=[mine] + ([first] if N > 2 else []))
assert mine.process_set_id == (1 if R % 2 == 0 else 2) and mine.ranks == (evens if R % 2 == 0 else odds)
assert N == 2 or first.process_set_id == 3
assert ids_and_ranks() == expected
assert hvd.global_process_set.process_set_id == 0 and hvd.global_process_set.ranks == list(range(N))
assert hvd.global_process_set.mpi_comm == world

# 3. Collectives run on the registered sets.
total = hvd.allreduce(torch.tensor([float(R)]), op=hvd.Sum, process_set=mine, name="parity.sum")
assert total.item() == sum(mine.ranks), total
assert mine.size() == len(mine.ranks) and mine.rank() == mine.ranks.index(R)
gathered = hvd.allgather(torch.tensor([R]), process_set=mine, name="parity.gather")
assert gathered.tolist() == mine.ranks
mpi_ops = importlib.import_module(hvd.__name__ + ".mpi_ops")  # `from horovod.torch.mpi_ops import ...` works too
x = torch.ones(2)
mpi_ops.synchronize(mpi_ops.allreduce_async_(x, op=mpi_ops.Sum, name="mpi_ops.sum"))
assert x.tolist() == [float(N)] * 2

# 4. The world's ranks are the global set's: adding them is a duplicate. A removed id is reused.
raises(ValueError, hvd.add_process_set, list(range(N)))
tail = hvd.add_process_set(range(1, N)) if N > 2 else None
assert hvd.remove_process_set(hvd.ProcessSet(evens)) is False  # this object was never registered
if N > 2:
    assert hvd.remove_process_set(tail) and tail.process_set_id is None
    again = hvd.add_process_set(range(1, N))
    assert again.process_set_id == 4, again  # the id tail had
    hvd.remove_process_set(again)

# 5. hpctrain only: ranks that pass different sets get a ValueError, every one of them.
if not IS_HOROVOD:
    err = raises(ValueError, hvd.add_process_set, [R])
    assert "mismatching values on different ranks" in str(err), err
    err = raises(ValueError, hvd.init, process_sets=[hvd.ProcessSet([R])])
    assert "mismatching values on different ranks" in str(err), err
    # A rank that cannot even build its sets still joins the comparison: an error everywhere, no wait.
    if R == 0:
        raises(NotImplementedError, hvd.add_process_set, hvd.ProcessSet(world))
        raises(TypeError, hvd.init, process_sets=["not a set"])
    else:
        err = raises(ValueError, hvd.add_process_set, [0, 1])
        assert "rank 0 could not use its process sets" in str(err), err
        err = raises(ValueError, hvd.init, process_sets=[hvd.ProcessSet([0, 1])])
        assert "rank 0 could not use its process sets" in str(err), err

world.Barrier()
hvd.shutdown()
assert hvd.global_process_set.ranks == list(range(N))  # kept after shutdown, as in Horovod
print(f"rank {R}: HOROVOD-SCRIPT-OK", flush=True)
