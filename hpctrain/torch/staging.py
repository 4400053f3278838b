"""CUDA tensors through MPI: staged through pinned host memory unless MPI is CUDA-aware.

``hpctrain.comm`` asks the MPI library whether it reads and writes CUDA memory
(``comm.cuda_support()``). When it does, CUDA tensors are passed to MPI as they are;
otherwise a CUDA tensor is copied into a pinned (page-locked) host buffer, communicated, and
copied back, and the first time this happens rank 0 logs it once, so a user who expected
GPU-direct transfers learns why the step is slower.

``HPCTRAIN_CUDA_AWARE_MPI`` overrides the query: ``1`` passes CUDA tensors to MPI (for a
library that is CUDA-aware but does not say so; with one that is not, the job crashes),
``0`` always stages, ``auto`` (the default) follows the query. Every rank must decide alike:
the agreement check reports ranks that do not.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Tuple

import torch

from hpctrain import comm, settings

log = logging.getLogger("hpctrain.torch")

ENV = "HPCTRAIN_CUDA_AWARE_MPI"
_state = {"logged": False, "cuda_aware": None}


def cuda_aware_override(environ=None) -> Optional[bool]:
    """``HPCTRAIN_CUDA_AWARE_MPI``: True (1), False (0) or None (auto, the default)."""
    if environ is None:
        return settings.rc.cuda_aware_mpi
    return settings.read("cuda_aware_mpi", environ)


def cuda_aware_mpi() -> bool:
    """True when CUDA tensors go to MPI as they are: the override, else hpctrain.comm's query.
    Decided once per process; ``hpctrain.comm`` then takes (or refuses) device tensors alike."""
    if _state["cuda_aware"] is None:
        forced = cuda_aware_override()
        decided = comm.cuda_support() if forced is None else forced
        comm.accept_device_buffers(decided)
        _state["cuda_aware"] = decided
        log.debug("hpctrain: CUDA tensors %s (%s=%s)", "go to MPI directly" if decided else "are staged",
                  ENV, "auto" if forced is None else int(forced))
    return bool(_state["cuda_aware"])


def to_host(tensor: torch.Tensor) -> Tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Return ``(tensor on the host, restore)``; ``restore(result)`` moves a result back to
    ``tensor``'s device. CPU tensors (and CUDA tensors with a CUDA-aware MPI) pass through."""
    if tensor.device.type == "cpu" or (tensor.is_cuda and cuda_aware_mpi()):
        return tensor, _identity
    if not _state["logged"]:
        _state["logged"] = True
        if comm.is_initialized() and comm.rank() == 0:
            log.warning("hpctrain: %s tensors are staged through pinned host memory for MPI "
                        "(MPI is not CUDA-aware, or %s=0); use backend='nccl' for GPU-direct transfers",
                        tensor.device.type, ENV)
    # pinning needs the CUDA runtime; without it (no driver) plain host memory does the same job
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda and torch.cuda.is_available())
    host.copy_(tensor, non_blocking=False)
    device = tensor.device

    def restore(result: torch.Tensor) -> torch.Tensor:
        return result.to(device, non_blocking=False)

    return host, restore


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
