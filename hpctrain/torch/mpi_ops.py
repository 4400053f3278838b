"""``horovod.torch.mpi_ops`` under hpctrain: the collectives and basics, for scripts that import
them from there (``from horovod.torch.mpi_ops import allreduce_async_, synchronize``), and the
``_basics`` internals that Horovod's own tests call."""
from . import process_sets as _process_sets
from .ops import *  # noqa: F401,F403 - the same names as horovod.torch.mpi_ops
from .ops import __all__  # noqa: F401


class _Basics:
    """The parts of Horovod's ``HorovodBasics`` object that scripts and tests reach through
    ``mpi_ops._basics``."""

    @staticmethod
    def _get_process_set_ids_and_ranks():
        return _process_sets.ids_and_ranks()

    @staticmethod
    def _comm_process_set_id(mpi_comm):
        return _process_sets.comm_process_set_id(mpi_comm)

    def __getattr__(self, name):  # rank(), size(), mpi_built() … as hvd.<name>
        from . import ops

        if name.startswith("_") or name not in ops.__all__:
            raise AttributeError(f"hpctrain has no Horovod basics function {name!r}; "
                                 "HINT: call the public hvd.<name> functions of hpctrain.torch")
        return getattr(ops, name)


_basics = _Basics()
