"""hpctrain.comm — MPI for hpctrain: start-up, groups, collectives, ring/shm/hierarchical
all-reduce, agreement checks and the stall watchdog. The only package that imports mpi4py.

Importing it imports ``mpi4py.MPI``, which starts MPI (mpi4py's default); ``init()`` builds
the world group on top.
"""
import os as _os

import mpi4py as _mpi4py

# Set before any module below imports mpi4py.MPI (that import runs MPI_Init): the watchdog and
# the async worker call MPI from threads; Open MPI's shared windows need only osc/sm, and
# osc/ucx prints errors where UCX has no usable transport (workstations). A user's own
# OMPI_MCA_osc wins.
_mpi4py.rc.thread_level = "multiple"
OSC_DEFAULTED = "OMPI_MCA_osc" not in _os.environ  # `hpctrain launch --exact` hands on the environment as it was
_os.environ.setdefault("OMPI_MCA_osc", "^ucx")
from .windows import note_mpi_state as _note_mpi_state

_note_mpi_state(OSC_DEFAULTED)  # MPI started by the script before this setting: windows.py

from .errors import (CollectiveMismatchError, CommError, ElasticError, HorovodInternalError, JoinedRanksError,
                     NotInitializedError, RanksLostError, StallError, WorldSizeError)
from .guard import checks_enabled, set_checks
from .plan import ALGORITHMS, parse_size
from .world import (Group, abort_job, cross_rank, cross_size, generation, hostname, init, is_initialized,
                    local_rank, local_size, mpi_library_version, mpi_threads_supported, new_group, note_reform, on_reform, rank,
                    reform, reforms, shutdown, size, rendezvous_store, split, world, world_ranks_of)
from .asyncq import Handle, drain as synchronize_all


def __getattr__(name):
    # The collectives import mpi4py; load them on first use so `import hpctrain.comm` stays cheap.
    import importlib

    if name.startswith("_"):  # private names (the C extensions among them) are never the collectives':
        raise AttributeError(name)  # `from . import _shmsync` asks here first, mid-import of shmsync
    collectives = importlib.import_module("hpctrain.comm.collectives")
    if hasattr(collectives, name):
        value = getattr(collectives, name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'hpctrain.comm' has no attribute {name!r}")


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "world", "world_ranks_of", "new_group", "split", "Group", "reform", "reforms", "generation", "on_reform", "note_reform", "hostname", "mpi_library_version",
    "mpi_threads_supported", "abort_job", "rendezvous_store", "allreduce", "allreduce_", "allreduce_async", "grouped_allreduce_", "grouped_allreduce_async", "grouped_adasum_",
    "allgather",
    "broadcast", "broadcast_", "reduce_scatter", "alltoall", "broadcast_object", "allgather_object",
    "barrier", "join", "refuse", "shared_buffer", "free_shared_buffer", "send", "recv", "send_object", "recv_object", "choose_algorithm", "allreduce_route", "tuned_counts", "Handle",
    "synchronize_all", "cuda_support", "accept_device_buffers", "set_checks", "checks_enabled", "ALGORITHMS", "parse_size", "CommError",
    "CollectiveMismatchError", "JoinedRanksError", "StallError", "NotInitializedError", "WorldSizeError",
    "RanksLostError", "ElasticError", "HorovodInternalError",
]
