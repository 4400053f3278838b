"""``SyncBatchNorm``: batch normalization with statistics over the whole global batch.

Forward: each rank computes per-channel count, mean and M2 (sum of squared deviations) of its
local batch; one all-gather brings every rank's triple and they are combined with the parallel
variance formula (stable, unlike sum / sum-of-squares). Backward: one all-reduce of the
per-channel sums of ``dy`` and ``dy * x_hat``. With local means of the loss on every rank and
the optimizer averaging gradients, training equals single-process training with plain
BatchNorm on the concatenated batch.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hpctrain import comm

from .ops import ProcessSet, _group, global_process_set

__all__ = ["SyncBatchNorm", "combine_moments"]


def combine_moments(counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine per-rank (count, mean, M2) rows into the global (count, mean, biased var).

    ``counts``: (R,), ``means`` and ``m2s``: (R, C). Pure; used by the forward pass.
    """
    total = counts.sum()
    if float(total) <= 0:
        raise ValueError("SyncBatchNorm: the global batch is empty on every rank")
    w = counts.to(means.dtype).unsqueeze(1)
    mean = (w * means).sum(0) / total
    m2 = (m2s + w * (means - mean) ** 2).sum(0)
    return total, mean, m2 / total


def _bcast_shape(x: torch.Tensor) -> Tuple[int, ...]:
    return (1, -1) + (1,) * (x.dim() - 2)


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], eps: float,
                momentum: float, group: Any) -> torch.Tensor:  # type: ignore[override]
        c = x.shape[1]
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        xc = x.detach().transpose(0, 1).reshape(c, -1).to(compute)
        n_local = xc.shape[1]
        if n_local:
            mean_l = xc.mean(1)
            m2_l = ((xc - mean_l.unsqueeze(1)) ** 2).sum(1)
        else:
            mean_l = torch.zeros(c, dtype=compute)
            m2_l = torch.zeros(c, dtype=compute)
        row = torch.cat([torch.tensor([float(n_local)], dtype=compute), mean_l.cpu(), m2_l.cpu()]).unsqueeze(0)
        rows = comm.allgather(row.contiguous(), group=group).to(xc.device)
        total, mean, var = combine_moments(rows[:, 0], rows[:, 1:1 + c], rows[:, 1 + c:])
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                n = float(total)
                unbiased = var * (n / (n - 1)) if n > 1 else var
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = _bcast_shape(x)
        x_hat = (x.to(compute) - mean.view(shape)) * invstd.view(shape)
        y = x_hat
        if weight is not None:
            y = y * weight.to(compute).view(shape)
        if bias is not None:
            y = y + bias.to(compute).view(shape)
        ctx.save_for_backward(x_hat, invstd, weight)
        ctx.total = float(total)
        ctx.group = group
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        x_hat, invstd, weight = ctx.saved_tensors
        shape = _bcast_shape(dy)
        dims = [d for d in range(dy.dim()) if d != 1]
        dyc = dy.to(x_hat.dtype)
        sum_dy = dyc.sum(dims)
        sum_dy_xhat = (dyc * x_hat).sum(dims)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xhat]).cpu().contiguous()
            both = comm.allreduce(both, op="sum", group=ctx.group).to(dy.device)
            c = sum_dy.numel()
            mean_dy = (both[:c] / ctx.total).view(shape)
            mean_dy_xhat = (both[c:] / ctx.total).view(shape)
            scale = invstd.view(shape)
            if weight is not None:
                scale = scale * weight.to(x_hat.dtype).view(shape)
            grad_x = ((dyc - mean_dy - x_hat * mean_dy_xhat) * scale).to(dy.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xhat.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(dy.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` that normalizes over the global batch in
    training mode (Horovod's ``hvd.SyncBatchNorm``). In eval mode, or on one rank, it is plain
    BatchNorm with the running statistics."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set, device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...), "
                             f"got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        group_size = self.process_set.size() if comm.is_initialized() else 1
        if not self.training or group_size == 1:
            return super().forward(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got {input.shape[1]} channels")
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        return _SyncBatchNormFn.apply(
            input, self.weight, self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps, momentum, _group(self.process_set))

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_set: ProcessSet = global_process_set) -> torch.nn.Module:
        """Replace every BatchNorm layer of ``module`` (recursively) by a SyncBatchNorm."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            ref = module.weight if module.affine else module.running_mean
            kw = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_set=process_set, **kw)
            if module.affine:
                with torch.no_grad():
                    out.weight.copy_(module.weight)
                    out.bias.copy_(module.bias)
            if module.track_running_stats:
                out.running_mean.copy_(module.running_mean)
                out.running_var.copy_(module.running_var)
                out.num_batches_tracked.copy_(module.num_batches_tracked)
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return out
