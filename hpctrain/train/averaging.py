"""The ranks' models agree where it matters: model averaging merges and buffer sync.

- ``sync.strategy: model_average`` (local SGD): every rank steps alone on its own gradients
  (a plain torch optimizer); every ``sync.average_every`` optimizer steps (counted from the
  start of the run, so a resumed run merges at the same steps), at the last step, at a stop,
  and before every evaluation and checkpoint, the weights become the mean of every rank's
  weights **weighted by the real samples each rank trained on since the last merge**:
  ``w = sum_r n_r w_r / sum_r n_r``.
- ``sync.buffers`` — buffers (BatchNorm running statistics) are updated by each rank from its
  own batches and never all-reduced; before every evaluation and checkpoint (and with every
  model-average merge) they are made equal: ``average`` (the same sample-weighted mean),
  ``broadcast`` (rank 0's, as torch DDP does) or ``none`` (left per rank; a checkpoint then
  holds rank 0's). Integer buffers (``num_batches_tracked``) are equal on every rank already
  (the same number of steps) and only take part in ``broadcast``.

With a pipeline, each stage's buffers agree over the stage's data-parallel group.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence

import numpy as np
import torch

from hpctrain import comm
from hpctrain.train.callbacks import Callback

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.train.build import Run
    from hpctrain.train.loop import TrainLoop


def floating_buffers(module: torch.nn.Module) -> List[torch.Tensor]:
    """Floating-point buffers in registration order (the same order on every rank)."""
    return [b for b in module.buffers() if b.is_floating_point()]


def merge_weight(mine: float, total: float, members: int) -> float:
    """This rank's share of a sample-weighted mean (equal shares when nothing was counted)."""
    return mine / total if total > 0 else 1.0 / members


def average_(tensors: Sequence[torch.Tensor], weight: float, group: Any = None) -> None:
    """In place on every rank: ``t = sum_r weight_r * t_r`` (float64 sums, one message)."""
    if not tensors:
        return
    with torch.no_grad():
        flat = np.concatenate([t.detach().to("cpu", torch.float64).reshape(-1).numpy() for t in tensors])
        flat *= weight
        comm.allreduce_(flat, op="sum", group=group)
        _scatter(tensors, flat)


def broadcast_(tensors: Sequence[torch.Tensor], group: Any = None) -> None:
    """In place: every rank takes the values of rank 0 (of ``group``)."""
    for t in tensors:  # a few small buffers: one message each keeps every dtype exact
        with torch.no_grad():
            host = t.detach().cpu().contiguous().numpy().copy()
            comm.broadcast_(host, root=0, group=group)
            t.copy_(torch.from_numpy(host).to(t.device))


def _scatter(tensors: Sequence[torch.Tensor], flat: np.ndarray) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(torch.from_numpy(flat[offset:offset + n]).view(t.shape).to(t.device, t.dtype))
        offset += n


class ModelSync(Callback):
    """Merges (``model_average``) on schedule and buffer agreement at every sync point; the
    evaluation and checkpoint hooks call :meth:`sync` first (at most once per step)."""

    def __init__(self, run: "Run") -> None:
        cfg = run.cfg
        self.every = cfg.sync.average_every if cfg.sync.strategy == "model_average" else 0
        self.buffers = cfg.sync.buffers
        self.module = run.model
        self.group = run.step_impl.buffer_group
        self.samples = 0.0            # real samples this rank trained on since the last sync
        self.synced_at: Optional[int] = None

    def on_step_end(self, loop: "TrainLoop") -> None:
        run, st = loop.run, loop.state
        if not loop.last_step_skipped:
            self.samples += loop.rank_samples()
        if self.every and (st.step % self.every == 0 or st.step == run.plan.total_steps or st.stopping):
            self.sync(loop)

    def sync(self, loop: "TrainLoop") -> None:
        """Make this step's model the same on every rank (collective; a no-op when done already)."""
        step = loop.state.step
        if self.synced_at == step:
            return
        self.synced_at = step
        tensors = list(self.module.parameters()) if self.every else []
        if self.buffers == "average":
            tensors += floating_buffers(self.module)
        if tensors:
            members = comm.size() if self.group is None else self.group.size
            total = comm.allreduce(np.array([self.samples]), op="sum", group=self.group)
            average_(tensors, merge_weight(self.samples, float(total[0]), members), self.group)
        if self.buffers == "broadcast":
            broadcast_(list(self.module.buffers()), self.group)
        self.samples = 0.0
