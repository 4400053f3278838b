"""``hvd.elastic`` — Horovod's elastic API, recovering inside one MPI job.

A Horovod elastic script runs by changing its import (``import hpctrain.torch as hvd``)::

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([lambda: rescale_lr(hvd.size())])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

Started with ``hpctrain launch --elastic -n N -- python train.py`` (Open MPI's
``mpiexec --with-ft ulfm`` and ``HPCTRAIN_ELASTIC=1``): when a rank dies, every survivor's
collective raises ``HorovodInternalError``; ``run`` restores the last committed state,
re-forms the world from the survivors (``hpctrain.comm.reform``: shrink, new communicators,
new shared-memory windows), synchronizes the state from the new rank 0, calls the reset
callbacks and calls ``train(state)`` again. Horovod re-forms its rings over Gloo with
``horovodrun`` and a host-discovery script; hpctrain does it with MPI's fault-tolerance
extension, without restarting any process. Ranks are only lost, never added (docs/elastic.md).
"""
from __future__ import annotations

import copy
import functools
import logging
import math
import queue
import random
from typing import Any, Callable, Dict, List, Tuple

import torch

from .. import comm, settings
from ..comm import faults
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HorovodInternalError",
           "HostsUpdatedInterrupt", "get_handler_registry", "set_handler_registry"]

log = logging.getLogger("hpctrain.elastic")


class State:
    """State kept in memory across resets (Horovod's ``horovod.common.elastic.State``).

    ``commit()`` saves it and checks for host updates; ``restore()`` goes back to the last
    commit; ``sync()`` gives every rank rank 0's state; ``register_reset_callbacks`` adds
    functions called after each reset (e.g. to rescale the learning rate to ``hvd.size()``)."""

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object,
                 get_rank: Callable[[], int] = comm.rank) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: "queue.Queue[Tuple[int, bool]]" = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Functions to call (in order) after every reset."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, removed_only: bool = False) -> None:
        """Record a change of the job's hosts (raised at the next ``check_host_updates``)."""
        self._host_messages.put((timestamp, removed_only))

    def commit(self) -> None:
        """Save the state in memory (a copy: costly for big models, so commit every few
        batches rather than every one), then check for host updates."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank alike when a host update was recorded
        on rank 0 (the decision is broadcast, so all ranks stop at the same step)."""
        prev = last = self._last_updated_timestamp
        removed_only = True
        while not self._host_messages.empty():
            timestamp, removed = self._host_messages.get()
            if timestamp > last:
                last = timestamp
                removed_only = removed_only and removed
        prev, self._last_updated_timestamp, removed_only = self._bcast_object((prev, last, removed_only))
        if self._last_updated_timestamp > prev:
            raise HostsUpdatedInterrupt(removed_only)

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def reset(self) -> None:
        """Called after the world was re-formed, before the reset callbacks."""


class ObjectState(State):
    """Plain Python values kept as attributes (Horovod's ``ObjectState``): every keyword
    argument becomes an attribute, saved by ``commit``, restored by ``restore`` and
    broadcast from rank 0 by ``sync``."""

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object,
                 get_rank: Callable[[], int] = comm.rank, **kwargs: Any) -> None:
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset across the ranks and re-partitions what is left of the epoch
    after a reset (Horovod's ``ElasticSampler``).

    Call ``record_batch(batch_idx, batch_size)`` after each batch and ``set_epoch(epoch)`` at
    the end of each epoch; keep the sampler in the ``TorchState`` so that the count of
    processed samples is committed, restored and synchronized with the rest."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: List[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (call it at the end of the previous one): nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` samples as processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: List[int]) -> None:
        """Remember indices processed by this rank (kept for Horovod compatibility)."""
        self.processed_indices.update(indices)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def state_dict(self) -> Dict[str, Any]:
        return dict(epoch=self.epoch, processed_num=self.processed_num)

    def reset(self) -> None:
        """Re-read the world's size and this rank, and share the epoch's unprocessed samples."""
        self.num_replicas = comm.size() if comm.is_initialized() else 1
        self.rank = comm.rank() if comm.is_initialized() else 0
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)  # the same order on every rank
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = self.remaining_indices[:]
        indices += indices[:(self.total_size - len(indices))]  # pad to a multiple of the ranks
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


class StateHandler:
    """How ``TorchState`` saves, restores and synchronizes one kind of value."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class _StateDictHandler(StateHandler):
    """A value with ``state_dict()`` / ``load_state_dict()``: saved as a deep copy of it."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        # rank 0's state dict, loaded everywhere (a sampler re-partitions the epoch's remaining
        # samples over the current world as it loads)
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


class ModelStateHandler(_StateDictHandler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class LRSchedulerStateHandler(_StateDictHandler):
    pass


class SamplerStateHandler(_StateDictHandler):
    pass


_handler_registry: List[Tuple[type, type]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (torch.optim.lr_scheduler.LRScheduler, LRSchedulerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> List[Tuple[type, type]]:
    return _handler_registry


def set_handler_registry(registry: List[Tuple[type, type]]) -> None:
    global _handler_registry
    _handler_registry = registry


def _handler_for(value: Any):
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """The state of a PyTorch training process (Horovod's ``TorchState``): ``model``,
    ``optimizer``, and any keyword value — modules, optimizers, LR schedulers and
    ``ElasticSampler`` through their state dicts, anything else as a plain object."""

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is not None:
                handlers[name] = handler
            else:
                plain[name] = value
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=comm.rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self, "_handlers") and name in self._handlers:
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function ``func(state, ...)``: it is called after ``state.sync()``
    and called again after every reset — a lost rank (``HorovodInternalError``: the state is
    restored to its last commit, the world re-formed from the survivors) or a
    ``HostsUpdatedInterrupt``. Below ``HPCTRAIN_ELASTIC_MIN_RANKS`` survivors, every survivor
    raises ``ElasticError``. Outside an elastic job a failure is raised as it is (the
    launcher ends such a job when a rank dies)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        _note_if_not_elastic()
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as exc:
                if not (settings.rc.elastic and faults.is_failure(exc)):
                    raise
                state.restore()
                skip_sync = False
                lost = exc
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
                lost = None
            _reset(lost, state)
            state.on_reset()

    return wrapper


def _reset(cause: Any, state: State) -> None:
    """Re-form the world (a lost rank), or keep it (a host update of the same world)."""
    if cause is None:
        return
    comm.reform(min_ranks=settings.rc.elastic_min_ranks)
    commit = _committed_scalars(state)
    comm.note_reform(resumed_from=commit)
    event = comm.reforms()[-1]
    if comm.rank() == 0:
        where = ", ".join(f"{k}={v}" for k, v in commit.items()) or "the last commit"
        log.warning("elastic: lost rank(s) %s (launched ranks %s) of %d; continuing on %d rank(s) from %s "
                    "(re-formed in %.3f s)", ", ".join(map(str, event["lost"])),
                    ", ".join(map(str, event["lost_launched"])), event["old_size"], event["new_size"], where,
                    event["seconds"])


def _committed_scalars(state: State) -> Dict[str, Any]:
    """The committed numbers of ``state`` (epoch, batch, step...): where training resumes."""
    saved = getattr(state, "_saved_state", {}) or {}
    return {k: v for k, v in saved.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


_noted: Dict[str, bool] = {}


def _note_if_not_elastic() -> None:
    if settings.rc.elastic or _noted.get("done") or not comm.is_initialized():
        return
    _noted["done"] = True
    if comm.rank() == 0 and comm.size() > 1:
        log.warning("elastic.run: this job is not elastic, so a lost rank ends it. %s", faults.HOW_TO_ENABLE)
