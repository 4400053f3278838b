"""Errors raised by hpctrain.comm. Each message says what was seen and what to do."""


class CommError(RuntimeError):
    """Base class of communication errors."""


class NotInitializedError(CommError):
    """A collective was called before ``hpctrain.comm.init()``."""


class WorldSizeError(CommError):
    """The MPI world does not match what the launcher (e.g. SLURM) asked for."""


class CollectiveMismatchError(CommError):
    """Ranks entered the same collective with different shapes, dtypes, ops or algorithms.

    ``headers``: every rank's agreement header (the same array on every rank), when the
    agreement check found the mismatch; ``hpctrain.comm.joining`` reads joined ranks from it."""

    def __init__(self, message: str, headers=None, group=None) -> None:
        super().__init__(message)
        self.headers = headers
        self.group = group


class JoinedRanksError(CollectiveMismatchError):
    """A collective other than an all-reduce was called while some ranks had joined
    (``hpctrain.comm.join``): they take part in all-reduces only, as in Horovod."""


class StallError(CommError):
    """A collective waited longer than HPCTRAIN_STALL_TIMEOUT seconds."""


class HorovodInternalError(RuntimeError):
    """A collective failed inside the communication layer, under Horovod's name
    (``horovod.common.exceptions``): its elastic mode treats it as recoverable (restore the
    last committed state, re-form the world, retry). Defined here so that the comm layer's
    failures are instances of it; ``hpctrain.torch`` re-exports it."""


class RanksLostError(CommError, HorovodInternalError):
    """A peer rank died (or left a collective after a failure) while this rank was in a
    collective with it. Raised only in fault-tolerant jobs (``hpctrain launch --elastic``):
    elsewhere the launcher ends the whole job when a rank dies. ``comm.reform()`` re-forms
    the world from the survivors."""


class ElasticError(CommError):
    """The world cannot go on after a failure: fewer survivors than ``min_ranks``, or an MPI
    without the fault-tolerance extension."""
