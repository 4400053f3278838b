"""Errors raised by hpctrain.comm. Each message says what was seen and what to do."""


class CommError(RuntimeError):
    """Base class of communication errors."""


class NotInitializedError(CommError):
    """A collective was called before ``hpctrain.comm.init()``."""


class WorldSizeError(CommError):
    """The MPI world does not match what the launcher (e.g. SLURM) asked for."""


class CollectiveMismatchError(CommError):
    """Ranks entered the same collective with different shapes, dtypes, ops or algorithms."""


class StallError(CommError):
    """A collective waited longer than HPCTRAIN_STALL_TIMEOUT seconds."""
