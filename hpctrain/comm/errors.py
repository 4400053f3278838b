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
