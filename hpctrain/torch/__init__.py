"""``import hpctrain.torch as hvd`` — Horovod's PyTorch API on hpctrain's MPI layer.

Everything a Horovod PyTorch script uses is here under the same name: ``init``, ``rank``,
``size``, the collectives (``allreduce``, ``allgather``, ``broadcast``, ``alltoall``,
``reducescatter`` and their async/in-place forms), ``DistributedOptimizer``,
``broadcast_parameters``, ``broadcast_optimizer_state``, ``Compression``, ``SyncBatchNorm``,
``elastic`` (``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``: docs/elastic.md).
hpctrain adds sync strategies (``sync="parameter_server"``, ``"model_average"``), backends
(``backend="gloo"``, ``"nccl"``, ``"horovod"``) and helpers (``metric_average``,
``DistributedSampler``, ``scale_lr``, ``print0``). See docs/torch.md.
"""
from .buckets import DEFAULT_FUSION_THRESHOLD, BucketPlan, ParamSpec, plan_buckets
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .helpers import (DistributedSampler, get_logger, log0, metric_average, print0, rank_zero_only, scale_lr,
                      shard_indices, warmup_factor)
from .ops import (Adasum, Average, Handle, HpctrainNotInitialized, Max, Min, ProcessSet, Product, ReduceOp, Sum,
                  add_process_set, allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                  allreduce_async_, alltoall, alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
                  broadcast_async_, ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                  gloo_enabled, global_process_set, grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                  grouped_allreduce_async_, grouped_allgather, grouped_allgather_async, grouped_reducescatter,
                  grouped_reducescatter_async, HorovodInternalError, HostsUpdatedInterrupt, init, is_homogeneous, is_initialized, join, local_rank, local_size,
                  mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, poll, rank, reducescatter,
                  reducescatter_async, remove_process_set, sparse_allreduce_async, rocm_built, shutdown, size, start_timeline,
                  stop_timeline, synchronize)
from .optimizer import DistributedOptimizer
from .strategies import AllReduce, ModelAverage, ParameterServer
from .sync_batch_norm import SyncBatchNorm
from . import elastic  # hvd.elastic.run, TorchState, ElasticSampler (after the names it uses)
from . import mpi_ops  # horovod.torch.mpi_ops' names, for `from ...mpi_ops import ...`

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "mpi_threads_supported", "start_timeline", "stop_timeline",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "allgather", "allgather_async", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "sparse_allreduce_async", "HorovodInternalError", "HostsUpdatedInterrupt",
    "synchronize", "poll", "join", "barrier", "Handle",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "broadcast_object", "allgather_object", "broadcast_parameters", "broadcast_optimizer_state",
    "Compression", "DistributedOptimizer", "SyncBatchNorm", "elastic", "mpi_ops",
    "AllReduce", "ParameterServer", "ModelAverage",
    "metric_average", "DistributedSampler", "shard_indices", "scale_lr", "warmup_factor", "print0", "log0",
    "rank_zero_only", "get_logger", "HpctrainNotInitialized",
    "DEFAULT_FUSION_THRESHOLD", "ParamSpec", "BucketPlan", "plan_buckets",
]
