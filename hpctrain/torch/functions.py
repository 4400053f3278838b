"""Broadcasting model and optimizer state, and picklable objects (Horovod's ``functions.py``)."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from hpctrain import comm

from .ops import ProcessSet, _group, _require_init, _root_in_set, broadcast_, global_process_set

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params: Union[Dict[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]], Iterable[torch.Tensor]],
                         root_rank: int = 0, process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s (a global rank), in place.

    ``params``: ``model.state_dict()`` or ``model.named_parameters()`` (or a list of tensors).
    Named tensors are broadcast sorted by name, so ranks whose dictionaries were built in a
    different order still pair the same tensors.
    """
    _require_init("hvd.broadcast_parameters")
    if isinstance(params, dict):
        items: List[Tuple[Optional[str], torch.Tensor]] = sorted(params.items(), key=lambda kv: kv[0])
    else:
        raw = list(params)
        if raw and all(isinstance(x, tuple) for x in raw):
            items = sorted(raw, key=lambda kv: kv[0])
        elif all(isinstance(x, torch.Tensor) for x in raw):
            items = [(None, x) for x in raw]
        else:
            raise ValueError(f"broadcast_parameters: invalid params of type {type(params).__name__}; expected "
                             "model.state_dict(), model.named_parameters() or a list of tensors")
    names = [n for n, _ in items]
    if any(n is not None for n in names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"broadcast_parameters: duplicate names {dupes}")
    # Fuse tensors of one dtype into a single message; state_dict tensors share storage with
    # the model, so writing into them updates it.
    by_dtype: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    for _, t in items:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {type(t).__name__} is not a tensor")
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for tensors in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else None
            broadcast_(flat, root_rank, process_set=process_set)
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view(t.shape))
                offset += n


_SPARSE = ":sparse"


def _strip_tensors(obj: Any, out: List[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):  # a sparse one (SGD's momentum on sparse gradients) travels dense
        out.append(obj.to_dense() if obj.is_sparse else obj)
        return ("__hpctrain_tensor__", len(out) - 1, tuple(obj.shape),
                str(obj.dtype).replace("torch.", "") + (_SPARSE if obj.is_sparse else ""))
    if isinstance(obj, dict):
        return {k: _strip_tensors(v, out) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strip_tensors(v, out) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_strip_tensors(v, out) for v in obj)
    return obj


def _fill_tensors(obj: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == "__hpctrain_tensor__":
        return tensors[obj[1]].to_sparse() if obj[3].endswith(_SPARSE) else tensors[obj[1]]
    if isinstance(obj, dict):
        return {k: _fill_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill_tensors(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_fill_tensors(v, tensors) for v in obj)
    return obj


def _initialize_state(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module]) -> None:
    """Horovod's start for an optimizer without state: every parameter that requires a gradient
    gets a zero gradient (sparse for SparseAdam, and for SGD on the sparse embeddings of
    ``model``), then the wrapped optimizer steps once, here on every rank, without any
    all-reduce. This creates the state (momentum buffers …) and applies what a zero gradient
    does, e.g. weight decay; the gradients stay zero tensors."""
    sparse = {id(q) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for q in m.parameters()}
    inner = getattr(optimizer, "_inner", optimizer)  # a DistributedOptimizer steps with an all-reduce
    for group in optimizer.param_groups:
        for q in group["params"]:
            if q.requires_grad:
                q.grad = torch.zeros_like(q.data)
                if isinstance(inner, torch.optim.SparseAdam) or (isinstance(inner, torch.optim.SGD) and id(q) in sparse):
                    q.grad = q.grad.to_sparse()
    inner.step()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: Optional[torch.nn.Module] = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyper-parameters (lr, momentum, ...).

    As in Horovod, an optimizer without state first steps once on zero gradients on every rank
    (``model``: to find sparse embeddings), which creates its state and applies e.g. weight
    decay. The structure of root's ``state_dict()`` then travels as one pickled object, its
    tensors as raw buffers, and every rank loads it.
    """
    _require_init("hvd.broadcast_optimizer_state")
    if not optimizer.state_dict()["state"]:
        _initialize_state(optimizer, model)
    group = _group(process_set)
    me = (process_set or global_process_set).rank()
    root_rank = _root_in_set(root_rank, process_set, "broadcast_optimizer_state")  # now a position in the set
    tensors: List[torch.Tensor] = []
    skeleton = _strip_tensors(optimizer.state_dict(), tensors) if me == root_rank else None
    skeleton = comm.broadcast_object(skeleton, root=root_rank, group=group)
    if me == root_rank:
        received = [t.detach().cpu().contiguous() for t in tensors]
    else:
        specs: List[Tuple[Tuple[int, ...], str]] = []

        def collect(obj: Any) -> None:
            if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == "__hpctrain_tensor__":
                specs.append((obj[2], obj[3]))
            elif isinstance(obj, dict):
                for v in obj.values():
                    collect(v)
            elif isinstance(obj, (list, tuple)):
                for v in obj:
                    collect(v)

        collect(skeleton)
        received = [torch.empty(shape, dtype=getattr(torch, dtype.split(":")[0])) for shape, dtype in specs]
    for t in received:
        if t.numel():
            comm.broadcast_(t.reshape(-1) if t.dim() else t.reshape(1), root=root_rank, group=group)
    if me != root_rank:
        optimizer.load_state_dict(_fill_tensors(skeleton, received))


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s picklable ``obj`` on every rank of ``process_set``; ``root_rank``
    is a global rank, as in Horovod."""
    _require_init("hvd.broadcast_object")
    root = _root_in_set(root_rank, process_set, "broadcast_object")
    return comm.broadcast_object(obj, root=root, group=_group(process_set))


def allgather_object(obj: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> List[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order."""
    _require_init("hvd.allgather_object")
    return comm.allgather_object(obj, group=_group(process_set))
