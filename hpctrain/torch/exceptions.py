"""Horovod's exception types, under the same names (``horovod.common.exceptions``)."""
from __future__ import annotations

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "HpctrainNotInitialized"]


from .. import comm
from ..comm.errors import HorovodInternalError  # the comm layer's failures are instances of it


class HpctrainNotInitialized(ValueError):
    """An hpctrain.torch function was called before ``hvd.init()``."""


def require_init(what: str) -> None:
    if not comm.is_initialized():
        raise HpctrainNotInitialized(
            f"{what}: hpctrain.torch has not been initialized.\n"
            "HINT: call hvd.init() (import hpctrain.torch as hvd) at the top of the script, "
            "before creating the DistributedOptimizer or calling any collective.")


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts of an elastic job changed; ``skip_sync`` says whether the state may be
    reset without synchronizing it first."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts changed")
        self.skip_sync = skip_sync
