"""``op=hvd.Adasum`` for the all-reduces of :mod:`hpctrain.torch.ops` (Horovod's CPU Adasum:
``hpctrain.comm.grouped_adasum_``), run on the background queue like every other async op.
Device tensors go through host memory."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from hpctrain import comm
from hpctrain.comm import asyncq

from .ops import Handle, ProcessSet, _group, _group_size, _scale_


def check_ranks(process_set: Optional[ProcessSet]) -> None:
    """Horovod's CPU Adasum refuses a rank count that is not a power of two, at the call."""
    n = _group_size(process_set)
    if n & (n - 1):
        raise NotImplementedError(f"Running Adasum with non-power of 2 ranks is not supported yet ({n} ranks).\n"
                                  "HINT: run on 1, 2, 4, 8 … ranks, or reduce with op=hvd.Average")


def start(tensors: Sequence[torch.Tensor], prescale: float, postscale: float, compression: Any,
          process_set: Optional[ProcessSet], outs: Optional[Sequence[torch.Tensor]], name: str,
          single: bool = False) -> Handle:
    """Start the Adasum of ``tensors`` (each with its own coefficients, in one exchange).
    The handle's result: ``outs`` filled, or new tensors; one tensor when ``single``."""
    check_ranks(process_set)
    group = _group(process_set)
    bufs: List[torch.Tensor] = []
    undo = []
    for t in tensors:
        # always through host memory, even with a CUDA-aware MPI: the combination runs in numpy
        host = t.detach().cpu()
        wire, ctx = compression.compress(host)
        buf = wire.contiguous().clone() if wire is host else wire.contiguous()
        bufs.append(_scale_(buf, prescale))
        undo.append((t.device, ctx))

    def run() -> None:
        # one exchange per dtype, in first-seen order (the same on every rank for the same call)
        dtypes = list(dict.fromkeys(b.dtype for b in bufs))
        for dtype in dtypes:
            comm.grouped_adasum_([b for b in bufs if b.dtype == dtype], group=group)

    inner = asyncq.submit(name, run)

    def finish(_: Any) -> Any:
        results = []
        for i, (buf, (device, ctx)) in enumerate(zip(bufs, undo)):
            result = compression.decompress(_scale_(buf, postscale), ctx).to(device).view(tensors[i].shape)
            if outs is not None:
                with torch.no_grad():
                    outs[i].copy_(result)
                result = outs[i]
            results.append(result)
        return results[0] if single else results

    return Handle(inner, finish, name=name)
