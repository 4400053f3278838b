"""Horovod's exception types, under the same names (``horovod.common.exceptions``)."""
from __future__ import annotations

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]


class HorovodInternalError(RuntimeError):
    """A collective failed inside the communication layer (Horovod's elastic mode treats it as
    recoverable: restore the last committed state and retry)."""


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts of an elastic job changed; ``skip_sync`` says whether the state may be
    reset without synchronizing it first."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts changed")
        self.skip_sync = skip_sync
