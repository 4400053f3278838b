"""Pipeline execution: one stage of an ``nn.Sequential`` per rank, micro-batches flowing
through ``hpctrain.comm`` point-to-point messages, GPipe or 1F1B.

Walk of one :meth:`PipelineModule.train_step`:

1. The batch is cut into M micro-batches (rows split as evenly as possible).
2. The stage walks its program from :mod:`hpctrain.parallel.schedule` (a pure plan, the same
   on every rank): receive an activation from the previous stage, forward, send the output on;
   receive the output's gradient from the next stage, backward, send the input's gradient
   back. The last stage computes the loss of each micro-batch, scaled by its share of the
   batch (1/M for equal micro-batches), so the accumulated gradient is the full batch's.
3. Shapes and dtypes of activations are sent once (``send_object``) the first time a
   micro-batch size is seen; afterwards only raw tensors travel, into reused buffers.
4. The loss goes from the last stage to every stage (one tiny broadcast), so rank 0 can log it.

Gradients are left in ``.grad`` (summed over micro-batches); the optimizer steps them. In a
DP × PP job, :func:`hpctrain.parallel.hybrid.distributed_optimizer` averages them over the
stage's data-parallel group.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from hpctrain import comm

from . import hybrid
from .partition import BALANCE_MODES, PartitionPlan, plan_partition, split_rows
from .schedule import (BWD, FWD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, Program, make_program,
                       normalize_schedule, bubble_fraction)

log = logging.getLogger("hpctrain.parallel")

TAG_ACT, TAG_GRAD, TAG_META = 11, 12, 13

LossFn = Callable[[torch.Tensor, Any], torch.Tensor]


# --------------------------------------------------------------------------- model → layers
def sequence_layers(model: Union[nn.Sequential, Sequence[nn.Module]]) -> List[Tuple[str, nn.Module]]:
    """The (name, layer) list a model is split along: an nn.Sequential's children (names as
    in its state_dict), or a list of modules named '0', '1', … (as ``nn.Sequential(*list)``)."""
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    if isinstance(model, (list, tuple, nn.ModuleList)) and all(isinstance(m, nn.Module) for m in model):
        return [(str(i), m) for i, m in enumerate(model)]
    raise TypeError(f"a pipeline splits an nn.Sequential or a list of nn.Module stages, got {type(model).__name__}.\n"
                    "HINT: wrap your layers in nn.Sequential(...) in forward order")


def parameter_costs(layers: Sequence[Tuple[str, nn.Module]]) -> List[float]:
    """Parameter count per layer (a parameter shared by two layers counts in the first)."""
    seen = set()
    costs = []
    for _, layer in layers:
        n = 0
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        costs.append(float(n))
    return costs


def measure_layer_times(layers: Sequence[Tuple[str, nn.Module]], sample: torch.Tensor, repeats: int = 3) -> List[float]:
    """Seconds of forward + backward per layer on ``sample`` (median of ``repeats``), feeding
    each layer the previous one's output. Runs locally; no communication."""
    times: List[List[float]] = [[] for _ in layers]
    for _ in range(max(1, repeats)):
        x = sample
        for i, (_, layer) in enumerate(layers):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = layer(inp)
            if y.requires_grad:
                y.backward(torch.ones_like(y))
            times[i].append(time.perf_counter() - t0)
            x = y.detach()
        for _, layer in layers:
            layer.zero_grad(set_to_none=True)
    return [sorted(t)[len(t) // 2] for t in times]


def _starts_in_place(module: nn.Module) -> bool:
    """Whether the first layer ``module`` runs (following first children) works in place."""
    while True:
        if getattr(module, "inplace", False):
            return True
        children = list(module.children())
        if not isinstance(module, nn.Sequential) or not children:
            return False
        module = children[0]


# --------------------------------------------------------------------------- statistics
@dataclass
class StepStats:
    """What one train_step measured on this stage."""

    step_seconds: float = 0.0  # wall time of the schedule on this stage
    compute_seconds: float = 0.0  # forward + backward (+ loss) time
    comm_seconds: float = 0.0  # time inside send/recv (waiting included)
    peak_in_flight: int = 0  # most micro-batches holding activations at once
    peak_activation_bytes: int = 0  # most bytes held for backward (saved tensors, inputs, outputs)
    loss: Optional[float] = None

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step on this stage: 1 − compute / wall."""
        if self.step_seconds <= 0:
            return 0.0
        return max(0.0, 1.0 - self.compute_seconds / self.step_seconds)


class _ActivationMeter:
    """Counts bytes autograd saves for backward per micro-batch (tensors deduplicated by
    storage, parameters excluded) plus the stage's input and output tensors."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.param_ptrs = {p.data_ptr() for p in params}
        self.held: Dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self._seen: set = set()
        self._bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.param_ptrs and ptr not in self._seen:
                self._seen.add(ptr)
                self._bytes += t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # e.g. tensors without storage
            pass
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def begin(self, extra: Sequence[Optional[torch.Tensor]]) -> None:
        self._seen = set()
        self._bytes = 0
        for t in extra:
            if t is not None:
                self.pack(t)

    def end(self, m: int, extra: Sequence[Optional[torch.Tensor]]) -> None:
        for t in extra:
            if t is not None:
                self.pack(t)
        self.held[m] = self._bytes
        self.current += self._bytes
        self.peak = max(self.peak, self.current)

    def release(self, m: int) -> None:
        self.current -= self.held.pop(m, 0)


@dataclass
class _StepRun:
    """One ``train_step``'s state on this stage while it walks its program, micro-batch ``m``
    keyed: received inputs (leaves that require grad), outputs kept for backward, last-stage
    losses, tensors waiting to be sent, received output gradients; and the step's counters."""

    rows: int
    ranges: List[Tuple[int, int]]
    loss_fn: LossFn
    rows_weighted: bool
    meter: Optional[_ActivationMeter]
    chunks: List[torch.Tensor] = field(default_factory=list)  # the first stage's micro-batches
    targets: List[Any] = field(default_factory=list)  # the last stage's
    inputs: Dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: Dict[int, torch.Tensor] = field(default_factory=dict)
    losses: Dict[int, torch.Tensor] = field(default_factory=dict)
    to_send: Dict[int, torch.Tensor] = field(default_factory=dict)
    grads_out: Dict[int, torch.Tensor] = field(default_factory=dict)
    pending_grad: Dict[int, torch.Tensor] = field(default_factory=dict)
    total_loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    compute: float = 0.0
    comm_time: float = 0.0
    in_flight: int = 0
    peak_in_flight: int = 0

    def micro_rows(self, m: int) -> int:
        a, b = self.ranges[m]
        return b - a


# --------------------------------------------------------------------------- the module
class PipelineModule:
    """One pipeline stage of ``model`` on this rank, and the schedule that trains it.

    ``PipelineModule(model, stages=S, micro_batches=M, schedule="1f1b")`` under a world of
    ``DP × S`` ranks: rank ``r`` holds stage ``r // DP`` of replica ``r % DP`` (see
    :mod:`hpctrain.parallel.hybrid`). With ``group=`` the pipeline runs on that group instead
    (its size must be S, its rank is the stage) and no data-parallel group is made.

    Splitting: ``split_points=[i, j, …]`` (first layer of stages 1…S−1), ``sizes=[n0, n1, …]``
    (layers per stage) or ``balance="params"`` (default: equal parameter counts) or
    ``balance="time"`` (equal measured forward+backward time on ``sample_input``; measured on
    rank 0 and broadcast so every rank plans the same split).

    Bad input (more stages than ranks, a world size not divisible by S, fewer layers than
    stages, split points out of range, unknown schedule) raises ValueError before any
    communication — every rank sees the same arguments, so every rank raises.
    """

    def __init__(self, model: Union[nn.Sequential, Sequence[nn.Module]], stages: int, micro_batches: int = 1,
                 schedule: str = "1f1b", *, balance: str = "params", split_points: Optional[Sequence[int]] = None,
                 sizes: Optional[Sequence[int]] = None, sample_input: Optional[torch.Tensor] = None,
                 group: Any = None, device: Union[str, torch.device, None] = None, broadcast_loss: bool = True,
                 track_memory: bool = True) -> None:
        # ---- validation: pure, identical on every rank, before any message
        layers = sequence_layers(model)
        self.schedule = normalize_schedule(schedule)
        if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an integer ≥ 1, got {micro_batches!r}")
        if balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES}, got {balance!r}")
        if not comm.is_initialized():
            comm.init()
        if group is None:
            layout = hybrid.HybridLayout.build(comm.size(), stages)
        else:
            if group.size != stages:
                raise ValueError(f"the pipeline group has {group.size} ranks but stages={stages}; a pipeline group "
                                 "holds exactly one rank per stage.\nHINT: pass group=None to split the world into "
                                 "DP × PP automatically")
            layout = None
        costs = parameter_costs(layers)
        if balance == "time" and split_points is None and sizes is None:
            if sample_input is None:
                raise ValueError("balance='time' needs sample_input= (one micro-batch) to time the layers")
            plan_partition(costs, stages)  # validate the layer count before measuring or talking
        else:
            plan = plan_partition(costs, stages, split_points=split_points, sizes=sizes)
        # ---- communication starts here
        self.layout: Optional[hybrid.HybridLayout] = layout
        if group is None:
            groups = hybrid.make_groups(stages, layout)
            self.pipeline_group = groups.pipeline_group
            self.data_parallel_group = groups.data_parallel_group
            self.replica = groups.replica
        else:
            self.pipeline_group = group
            self.data_parallel_group = None
            self.replica = 0
        if balance == "time" and split_points is None and sizes is None:
            # measured once (world rank 0, or rank 0 of an explicit group) and broadcast: every
            # stage and every replica must plan the same split
            measuring = comm.rank() == 0 if group is None else group.rank == 0
            times = measure_layer_times(layers, sample_input) if measuring else None
            costs = comm.broadcast_object(times, root=0, group=group)
            plan = plan_partition(costs, stages)
        self.plan: PartitionPlan = plan
        self.stages = stages
        self.stage: int = self.pipeline_group.rank
        self.micro_batches = micro_batches
        self.balance = balance
        self.broadcast_loss = broadcast_loss
        self.device = torch.device(device) if device is not None else None
        mine = [layers[i] for i in plan.layers(self.stage)]
        self.layer_names: List[str] = [name for name, _ in mine]
        self.module = nn.Sequential(collections.OrderedDict(mine))
        if self.device is not None:
            self.module.to(self.device)
        self.program: Program = make_program(self.schedule, stages, micro_batches)
        self._ops = self.program.for_stage(self.stage)
        self.is_first = self.stage == 0
        # a received activation is a leaf that requires grad; an in-place first layer
        # (ReLU(inplace=True), …) may not modify it, so such a stage works on a copy
        self._clone_input = not self.is_first and _starts_in_place(self.module)
        self.is_last = self.stage == stages - 1
        self.track_memory = track_memory
        # shapes agreed with the neighbours, keyed by micro-batch row count
        self._sent_meta: Dict[int, Tuple[Tuple[int, ...], torch.dtype]] = {}
        self._recv_meta: Dict[int, Tuple[Tuple[int, ...], torch.dtype]] = {}
        self._pool: Dict[Tuple[Tuple[int, ...], torch.dtype], List[torch.Tensor]] = {}
        self._grad_bufs: Dict[Tuple[Tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._pooled_out: set = set()  # ids of pooled CPU buffers holding a device tensor to send
        self.last_stats = StepStats()
        self.steps = 0
        if comm.rank() == 0:
            log.info("pipeline: %d stages × %d replicas, %s, M=%d, theoretical bubble %.3f; %s", stages,
                     comm.size() // stages if group is None else 1, self.schedule, micro_batches,
                     self.theoretical_bubble, plan.describe())

    # ------------------------------------------------------------------ nn.Module-like surface
    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        """Names as in the original model's state_dict (e.g. '3.weight')."""
        return self.module.named_parameters()

    def state_dict(self) -> Dict[str, Any]:
        """This stage's tensors under the original model's keys."""
        return self.module.state_dict()

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> Any:
        """Load this stage's part; ``state`` may be the full model's state_dict when strict=False."""
        if not strict:
            return self.module.load_state_dict(state, strict=False)
        return self.module.load_state_dict(state)

    def train(self, mode: bool = True) -> "PipelineModule":
        self.module.train(mode)
        return self

    def eval(self) -> "PipelineModule":
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)

    @property
    def theoretical_bubble(self) -> float:
        """(S−1)/(M+S−1)."""
        return bubble_fraction(self.stages, self.micro_batches)

    def __repr__(self) -> str:
        return (f"PipelineModule(stage {self.stage}/{self.stages}, layers {self.layer_names}, "
                f"{self.schedule}, M={self.micro_batches})")

    # ------------------------------------------------------------------ wire helpers
    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU tensor to send: the tensor itself on CPU (no copy when contiguous), else a
        pooled CPU buffer holding a copy (give it back with :meth:`_sent`)."""
        t = t.detach()
        if self.device is None:
            return t.contiguous()
        buf = self._take_buffer(tuple(t.shape), t.dtype)
        buf.copy_(t)
        self._pooled_out.add(id(buf))
        return buf

    def _sent(self, t: torch.Tensor) -> None:
        if id(t) in self._pooled_out:
            self._pooled_out.discard(id(t))
            self._give_buffer(t)

    def _take_buffer(self, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        free = self._pool.setdefault((shape, dtype), [])
        return free.pop() if free else torch.empty(shape, dtype=dtype)

    def _give_buffer(self, buf: torch.Tensor) -> None:
        buf.grad = None
        self._pool.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)

    def _send_activation(self, y: torch.Tensor, rows: int) -> None:
        meta = (tuple(y.shape), y.dtype)
        known = self._sent_meta.get(rows)
        if known is None:
            comm.send_object(meta, self.stage + 1, tag=TAG_META, group=self.pipeline_group)
            self._sent_meta[rows] = meta
        elif known != meta:
            raise ValueError(
                f"stage {self.stage}: output of a {rows}-row micro-batch is {meta[0]} {meta[1]}, but an earlier "
                f"{rows}-row micro-batch gave {known[0]} {known[1]}. Activation shapes between stages must depend "
                "only on the micro-batch size.\nHINT: pad variable-length inputs to a fixed shape")
        comm.send(y, self.stage + 1, tag=TAG_ACT, group=self.pipeline_group)

    def _recv_activation(self, rows: int) -> torch.Tensor:
        meta = self._recv_meta.get(rows)
        if meta is None:
            meta = comm.recv_object(self.stage - 1, tag=TAG_META, group=self.pipeline_group)
            shape, dtype = meta
            if not dtype.is_floating_point:
                raise ValueError(f"stage {self.stage} receives a {dtype} activation from stage {self.stage - 1}; "
                                 "activations between stages must be floating point (gradients flow back).\n"
                                 "HINT: move the embedding/int-producing layer into the same stage as its consumer")
            self._recv_meta[rows] = meta
        buf = self._take_buffer(*meta)
        comm.recv(buf, self.stage - 1, tag=TAG_ACT, group=self.pipeline_group)
        return buf

    def _recv_gradient(self, rows: int) -> torch.Tensor:
        shape, dtype = self._sent_meta[rows]
        buf = self._grad_bufs.get((shape, dtype))
        if buf is None:
            buf = self._grad_bufs[(shape, dtype)] = torch.empty(shape, dtype=dtype)
        comm.recv(buf, self.stage + 1, tag=TAG_GRAD, group=self.pipeline_group)
        return buf

    # ------------------------------------------------------------------ one step
    def _rows(self, batch: Optional[torch.Tensor], targets: Any) -> int:
        if self.is_first and batch is None:
            raise ValueError("stage 0 needs the batch: train_step(batch, targets, loss_fn)")
        if self.is_last and targets is None:
            raise ValueError(f"the last stage ({self.stage}) needs the targets: train_step(batch, targets, loss_fn)")
        ref = batch if batch is not None else targets
        if ref is None:
            raise ValueError(f"stage {self.stage} got neither batch nor targets; pass them on every stage (the "
                             "micro-batch sizes are taken from their first dimension)")
        rows = len(ref)
        if batch is not None and targets is not None and len(targets) != len(batch):
            raise ValueError(f"batch has {len(batch)} rows but targets {len(targets)}")
        return rows

    def train_step(self, batch: Optional[torch.Tensor], targets: Any, loss_fn: LossFn, *,
                   rows_weighted: bool = True) -> torch.Tensor:
        """Forward and backward of one batch through the whole pipeline; gradients accumulate
        in this stage's ``.grad``. Returns the batch's mean loss (on every stage when
        ``broadcast_loss``, else on the last stage and NaN elsewhere).

        ``loss_fn(output, targets)`` must return the mean over the micro-batch. Pass the same
        ``batch`` and ``targets`` on every stage of a pipeline (stage 0 uses the batch, the last
        stage the targets; the others only their length). ``targets`` may be any object with
        ``len()``, row slicing and (with ``device``) ``.to(device)``.

        ``rows_weighted=False``: ``loss_fn``'s value is used as it is, not weighted by the
        micro-batch's share of rows (for a loss that carries its own normalisation, such as a
        masked sum divided by a global batch size); the returned loss is then the sum of the
        micro-batches' values.
        """
        rows = self._rows(batch, targets)
        ranges = split_rows(rows, self.micro_batches)
        dev = self.device
        run = _StepRun(rows=rows, ranges=ranges, loss_fn=loss_fn, rows_weighted=rows_weighted,
                       meter=_ActivationMeter(list(self.module.parameters())) if self.track_memory else None)
        if batch is not None and self.is_first:
            run.chunks = [batch[a:b] if dev is None else batch[a:b].to(dev) for a, b in ranges]
        if targets is not None and self.is_last:
            run.targets = [targets[a:b] if dev is None else targets[a:b].to(dev) for a, b in ranges]
        handlers = {RECV_ACT: self._op_recv_activation, FWD: self._op_forward, SEND_ACT: self._op_send_activation,
                    RECV_GRAD: self._op_recv_gradient, BWD: self._op_backward, SEND_GRAD: self._op_send_gradient}
        t_start = time.perf_counter()
        for op in self._ops:
            t0 = time.perf_counter()
            handlers[op.kind](run, op.micro_batch)
            if op.kind in (FWD, BWD):
                run.compute += time.perf_counter() - t0
            else:
                run.comm_time += time.perf_counter() - t0
        step = time.perf_counter() - t_start
        assert not run.outputs and not run.losses and not run.to_send and not run.grads_out, \
            "pipeline program left work behind"
        loss_value = run.total_loss
        if self.broadcast_loss and self.stages > 1:
            loss_value = comm.broadcast(run.total_loss.reshape(1), root=self.stages - 1, group=self.pipeline_group)[0]
        elif not self.is_last:
            loss_value = torch.tensor(float("nan"), dtype=torch.float64)
        self.steps += 1
        self.last_stats = StepStats(step, run.compute, run.comm_time, run.peak_in_flight,
                                    run.meter.peak if run.meter else 0, float(loss_value))
        return loss_value

    # One method per kind of op of the stage's program (schedule.py), each on the step's state.
    def _op_recv_activation(self, run: "_StepRun", m: int) -> None:
        buf = self._recv_activation(run.micro_rows(m))
        if self.device is None:
            run.inputs[m] = buf.requires_grad_(True)  # the pooled buffer is the stage's input leaf
        else:
            run.inputs[m] = buf.to(self.device, copy=True).requires_grad_(True)
            self._give_buffer(buf)

    def _op_forward(self, run: "_StepRun", m: int) -> None:
        if self.is_first:
            x = run.chunks[m]
        else:
            x = run.inputs[m].clone() if self._clone_input else run.inputs[m]
        y, loss = self._forward_micro(x, run.targets[m] if self.is_last else None, run.loss_fn, run.meter)
        if self.is_last:
            scaled = loss * (run.micro_rows(m) / run.rows) if run.rows_weighted else loss
            run.losses[m] = scaled
            run.total_loss += scaled.detach().double().cpu()
        else:
            run.outputs[m] = y
            run.to_send[m] = self._wire(y)
        if run.meter is not None:
            run.meter.end(m, [x if not self.is_first else None, y])
        run.in_flight += 1
        run.peak_in_flight = max(run.peak_in_flight, run.in_flight)

    def _op_send_activation(self, run: "_StepRun", m: int) -> None:
        t = run.to_send.pop(m)
        self._send_activation(t, run.micro_rows(m))
        self._sent(t)

    def _op_recv_gradient(self, run: "_StepRun", m: int) -> None:
        # the gradient buffer is reused: the program never receives another gradient before
        # this micro-batch's backward
        run.pending_grad[m] = self._recv_gradient(run.micro_rows(m))

    def _op_backward(self, run: "_StepRun", m: int) -> None:
        if self.is_last:
            run.losses.pop(m).backward()
        else:
            g = run.pending_grad.pop(m)
            out = run.outputs.pop(m)
            # A first stage without parameters (Flatten, scaling, …) has an output that needs
            # no gradient: nothing to do, but the gradient was still received.
            if out.requires_grad:
                out.backward(g if self.device is None else g.to(self.device))
        self._after_backward(m, run.inputs, run.grads_out, run.meter)
        run.in_flight -= 1

    def _op_send_gradient(self, run: "_StepRun", m: int) -> None:
        t = run.grads_out.pop(m)
        comm.send(t, self.stage - 1, tag=TAG_GRAD, group=self.pipeline_group)
        self._sent(t)
        buf = run.inputs.pop(m)
        if self.device is None:
            self._give_buffer(buf)

    def _forward_micro(self, x: torch.Tensor, target: Any, loss_fn: LossFn,
                       meter: Optional["_ActivationMeter"]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """This stage's forward of one micro-batch (and the loss on the last stage), under the
        activation meter when memory is tracked."""
        hooks = (torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack) if meter is not None
                 else contextlib.nullcontext())
        if meter is not None:
            meter.begin([])
        loss = None
        with hooks:
            y = self.module(x)
            if self.is_last:
                loss = loss_fn(y, target)
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"stage {self.stage} returned {type(y).__name__}; a pipeline stage must return "
                            "one tensor")
        if loss is not None and loss.dim() != 0:
            raise ValueError(f"loss_fn returned shape {tuple(loss.shape)}; it must return a scalar "
                             "(the mean over the micro-batch)")
        return y, loss

    @torch.no_grad()
    def evaluate(self, batch: Optional[torch.Tensor], targets: Any, loss_fn: LossFn, *,
                 rows_weighted: bool = True, micro_batches: Optional[int] = None) -> torch.Tensor:
        """Forward-only pass of one batch (validation): micro-batches flow forward, no
        gradients, no activations kept. Returns the batch's mean loss like :meth:`train_step`
        (``rows_weighted`` as there). ``micro_batches``: how many to cut this batch into
        (default: the training M; every stage must pass the same value).

        Forward-only traffic goes one way (stage s → s+1, micro-batches in order), so the plain
        receive-compute-send loop cannot deadlock."""
        rows = self._rows(batch, targets)
        ranges = split_rows(rows, self.micro_batches if micro_batches is None else micro_batches)
        dev = self.device
        total = torch.zeros((), dtype=torch.float64)
        for m, (a, b) in enumerate(ranges):
            if self.is_first:
                x = batch[a:b] if dev is None else batch[a:b].to(dev)
            else:
                buf = self._recv_activation(b - a)
                x = buf.detach() if dev is None else buf.to(dev, copy=True)
            y = self.module(x)
            if not self.is_first:
                self._give_buffer(buf)
            if self.is_last:
                t = targets[a:b] if dev is None else targets[a:b].to(dev)
                value = loss_fn(y, t).detach().double().cpu()
                total += value * ((b - a) / rows) if rows_weighted else value
            else:
                t = self._wire(y)
                self._send_activation(t, b - a)
                self._sent(t)
        if self.broadcast_loss and self.stages > 1:
            return comm.broadcast(total.reshape(1), root=self.stages - 1, group=self.pipeline_group)[0]
        return total if self.is_last else torch.tensor(float("nan"), dtype=torch.float64)

    def _after_backward(self, m: int, inputs: Dict[int, torch.Tensor], grads_out: Dict[int, torch.Tensor],
                        meter: Optional[_ActivationMeter]) -> None:
        if meter is not None:
            meter.release(m)
        if self.is_first:
            return
        x = inputs[m]
        g = x.grad
        if g is None:  # the stage ignored its input; the previous stage still expects a gradient
            g = torch.zeros_like(x)
        grads_out[m] = self._wire(g)
