"""Horovod's exception types, under the same names (``horovod.common.exceptions``)."""
from __future__ import annotations

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]


from ..comm.errors import HorovodInternalError  # the comm layer's failures are instances of it


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts of an elastic job changed; ``skip_sync`` says whether the state may be
    reset without synchronizing it first."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts changed")
        self.skip_sync = skip_sync
