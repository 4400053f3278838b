"""CUDA tensors through MPI: staged through pinned host memory unless MPI is CUDA-aware.

``hpctrain.comm`` moves CPU memory. A CUDA tensor is copied into a pinned (page-locked) host
buffer, communicated, and copied back; the first time this happens rank 0 logs it once, so a
user who expected GPU-direct transfers learns why the step is slower. When ``hpctrain.comm``
reports a CUDA-aware MPI (``comm.cuda_aware()``), CUDA tensors are passed through as they are.
"""
from __future__ import annotations

import logging
from typing import Callable, Tuple

import torch

from hpctrain import comm

log = logging.getLogger("hpctrain.torch")

_state = {"logged": False, "cuda_aware": None}


def cuda_aware_mpi() -> bool:
    """True when hpctrain.comm says its MPI can read and write CUDA memory directly."""
    if _state["cuda_aware"] is None:
        probe = getattr(comm, "cuda_aware", None)
        try:
            _state["cuda_aware"] = bool(probe()) if callable(probe) else False
        except Exception:  # a probe that fails means "not known to be CUDA-aware"
            _state["cuda_aware"] = False
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
                        "(MPI is not CUDA-aware); use backend='nccl' for GPU-direct transfers",
                        tensor.device.type)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    host.copy_(tensor, non_blocking=False)
    device = tensor.device

    def restore(result: torch.Tensor) -> torch.Tensor:
        return result.to(device, non_blocking=False)

    return host, restore


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
