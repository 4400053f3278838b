"""The batch-size tuner: run real training steps at the batch sizes the pure search
(``search.py``) proposes, measure their peak memory, agree across ranks, scale the
learning rate.

A trial at batch ``b`` builds a fresh model and optimizer, runs **two** steps (forward,
backward, optimizer step, zero_grad): the first step creates the optimizer's state
(Adam's moments), the second is the steady state where that state, the activations and the
gradients are alive together. Out-of-memory (``torch.cuda.OutOfMemoryError``, a
``RuntimeError`` saying "out of memory" / "can't allocate memory", ``MemoryError``) ends
the trial as "does not fit"; everything is freed before the next one.

Peak memory of a trial:

* GPU: ``torch.cuda.max_memory_reserved`` (what the caching allocator took from the
  device, fragmentation included) after ``reset_peak_memory_stats``, minus what was
  reserved before the trial.
* CPU: the kernel's resident-set high-water mark. Before a trial we collect garbage, call
  ``malloc_trim(0)`` so freed heap pages go back to the kernel, read VmRSS as the
  baseline, and reset the high-water mark by writing ``5`` to ``/proc/self/clear_refs``;
  afterwards VmHWM − baseline is the trial's peak. It counts everything the step touched
  (tensors, oneDNN scratch, the allocator's slack) and the kernel tracks it exactly, so
  no sampling thread can miss a short peak. Where clear_refs is not writable a 1 ms RSS
  sampling thread is the fallback (less exact; the explanation says so). As a guard the
  trial runs under ``RLIMIT_DATA`` = current data size + budget: a trial that would
  exceed the budget gets an allocation failure (caught) instead of the kernel's OOM killer.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import resource
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Tuple

from .decide import (BindingPlan, Budget, RankChoice, agree_batch, format_bytes, global_batch_size, plan_binding,
                     rank_budget, scale_learning_rate)
from .search import OOM, SearchConfig, SearchResult, Trial, classify, run_search

log = logging.getLogger("hpctrain.probe")

DEFAULT_MARGIN = 0.10


@dataclass(frozen=True)
class TuneTarget:
    """What ``--tune-batch MODULE:FACTORY`` must return (see docs/probe.md).

    * ``model_factory() -> torch.nn.Module`` — a fresh model (on CPU; the tuner moves it).
    * ``make_batch(batch_size) -> (inputs, targets)`` — a sample batch of that size; inputs
      a tensor, a tuple of tensors (``model(*inputs)``) or a dict (``model(**inputs)``).
    * ``optimizer_factory(params) -> torch.optim.Optimizer``.
    * ``loss_fn(outputs, targets) -> scalar tensor`` (default: ``outputs.float().mean()``).
    * ``base_lr``/``base_batch``: the learning rate known to work at that global batch;
      scaled to the tuned global batch by ``lr_rule`` ("linear", "sqrt", "none").
    """

    model_factory: Callable[[], Any]
    make_batch: Callable[[int], Tuple[Any, Any]]
    optimizer_factory: Callable[[Iterable[Any]], Any]
    loss_fn: Optional[Callable[[Any, Any], Any]] = None
    base_lr: float = 0.1
    base_batch: int = 256
    lr_rule: str = "linear"
    accumulation_steps: int = 1
    steps_per_epoch: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("model_factory", "make_batch", "optimizer_factory"):
            if not callable(getattr(self, name)):
                raise ValueError(f"TuneTarget.{name} must be callable, got {getattr(self, name)!r}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ValueError(f"TuneTarget.loss_fn must be callable or None, got {self.loss_fn!r}")
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be ≥ 1, got {self.accumulation_steps}")


@dataclass(frozen=True)
class TuneResult:
    """What the tuner chose. ``explanation`` is a few lines for humans."""

    per_device_batch: int
    global_batch: int
    lr: float
    explanation: str
    world_size: int = 1
    accumulation_steps: int = 1
    lr_rule: str = "linear"
    warmup_epochs: float = 0.0
    warmup_steps: Optional[int] = None
    device: str = "cpu"
    budget: int = 0
    limit: int = 0
    margin: float = DEFAULT_MARGIN
    trials: Tuple[Trial, ...] = ()
    per_rank: Tuple[RankChoice, ...] = ()
    measurement: str = ""

    def to_dict(self) -> dict:
        from dataclasses import asdict

        from .facts import _to_jsonable

        return _to_jsonable(asdict(self))


# --------------------------------------------------------------------------- measuring
def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA OOM, CPU allocation failure, or Python's MemoryError."""
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch

        if isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())):
            return True
    except ImportError:
        pass
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(s in text for s in ("out of memory", "can't allocate memory", "not enough memory",
                                       "cublas_status_alloc_failed", "failed to allocate"))
    return False


def _proc_status(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class CpuMeter:
    """Peak resident memory of a block of code, in bytes above the RSS before it."""

    def __init__(self) -> None:
        self.exact = self._can_reset()
        self.method = ("kernel RSS high-water mark (VmHWM reset via /proc/self/clear_refs)" if self.exact
                       else "RSS sampled every 1 ms (clear_refs not available)")
        self._baseline = 0
        self._peak = 0
        self._stop: Optional[threading.Event] = None
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def _can_reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _proc_status("VmHWM") is not None
        except OSError:
            return False

    def start(self) -> None:
        gc.collect()
        _malloc_trim()
        self._baseline = _proc_status("VmRSS") or self._rss()
        if self.exact:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        else:
            self._peak = self._baseline
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _rss(self) -> int:
        import psutil

        return int(psutil.Process().memory_info().rss)

    def _sample(self) -> None:
        assert self._stop is not None
        while not self._stop.is_set():
            self._peak = max(self._peak, self._rss())
            self._stop.wait(0.001)

    def stop(self) -> int:
        if self.exact:
            peak = _proc_status("VmHWM") or self._baseline
        else:
            assert self._stop is not None and self._thread is not None
            self._stop.set()
            self._thread.join()
            peak = max(self._peak, self._rss())
        return max(0, peak - self._baseline)


class _DataLimit:
    """RLIMIT_DATA = current data segment + ``allowance`` while inside (Linux only)."""

    def __init__(self, allowance: int) -> None:
        self.allowance = allowance
        self.old: Optional[Tuple[int, int]] = None

    def __enter__(self) -> "_DataLimit":
        vm_data = _proc_status("VmData")
        if vm_data is None:
            return self
        self.old = resource.getrlimit(resource.RLIMIT_DATA)
        soft = vm_data + self.allowance
        hard = self.old[1]
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        try:
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        except (ValueError, OSError):
            self.old = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.old is not None:
            resource.setrlimit(resource.RLIMIT_DATA, self.old)


class PinnedMallocThreshold:
    """Fix glibc's mmap threshold while measuring: large blocks are then always mmap'd and
    returned to the kernel when freed, so one trial's leftovers do not change the next
    one's resident-memory growth (glibc's *dynamic* threshold otherwise makes trial peaks
    depend on which trials ran before). Afterwards the threshold is set to
    $MALLOC_MMAP_THRESHOLD_ if the launcher set one, else 32 MiB (where the dynamic
    threshold ends up for large tensors). glibc only; a no-op elsewhere."""

    M_MMAP_THRESHOLD = -3

    def __init__(self, during: int = 128 << 10) -> None:
        self.during = during

    def _set(self, value: int) -> None:
        try:
            ctypes.CDLL("libc.so.6").mallopt(self.M_MMAP_THRESHOLD, int(value))
        except (OSError, AttributeError):
            pass

    def __enter__(self) -> "PinnedMallocThreshold":
        self._set(self.during)
        return self

    def __exit__(self, *exc: Any) -> None:
        env = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
        self._set(int(env) if env.isdigit() else 32 << 20)


def _to_device(obj: Any, device: Any) -> Any:
    if hasattr(obj, "to") and callable(obj.to):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


class TrialRunner:
    """Runs the training-step trial at a batch size and measures it. ``__call__(b)``
    returns a ``search.Trial``."""

    def __init__(self, target: TuneTarget, device: str, budget: int, limit: int, steps: int = 2) -> None:
        import torch

        self.target = target
        self.device = torch.device(device)
        self.budget = int(budget)
        self.limit = int(limit)
        self.steps = steps
        self.is_cuda = self.device.type == "cuda"
        self.cpu_meter = None if self.is_cuda else CpuMeter()
        self.method = ("torch.cuda.max_memory_reserved (caching allocator peak)" if self.is_cuda
                       else self.cpu_meter.method)  # type: ignore[union-attr]

    def _step_loop(self, batch: int) -> None:
        t = self.target
        model = t.model_factory()
        model = model.to(self.device)
        model.train()
        optimizer = t.optimizer_factory(model.parameters())
        try:
            for _ in range(self.steps):
                inputs, targets = t.make_batch(batch)
                inputs, targets = _to_device(inputs, self.device), _to_device(targets, self.device)
                if isinstance(inputs, dict):
                    out = model(**inputs)
                elif isinstance(inputs, (tuple, list)):
                    out = model(*inputs)
                else:
                    out = model(inputs)
                loss = t.loss_fn(out, targets) if t.loss_fn is not None else out.float().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del inputs, targets, out, loss
            if self.is_cuda:
                import torch

                torch.cuda.synchronize(self.device)
        finally:
            del model, optimizer

    def _free(self) -> None:
        if self.is_cuda:
            import torch

            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        # On CPU the meter collects garbage and trims the heap before the next trial.

    def warm_up(self) -> None:
        """One unmeasured run at batch 1: lazy initialization (thread pools, kernels, the
        CUDA context) would otherwise inflate the first measurement."""
        # Not under the RLIMIT_DATA guard: lazy initialisation (imports, thread pools) can
        # need more than a small budget once, and must complete here, not in trial 1.
        try:
            self._step_loop(1)
        except Exception as exc:  # noqa: BLE001 - batch 1 not fitting is the search's to report
            if not is_out_of_memory(exc):
                raise
        finally:
            self._free()

    def _run(self, batch: int) -> Tuple[Optional[int], Optional[str]]:
        import torch

        if self.is_cuda:
            self._free()
            before = torch.cuda.memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            err = None
            try:
                self._step_loop(batch)
            except Exception as exc:  # noqa: BLE001 - classified below
                if not is_out_of_memory(exc):
                    raise
                # Keep only the text: the traceback's frames would keep the trial's tensors alive.
                err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            peak = torch.cuda.max_memory_reserved(self.device) - before
            return max(0, peak), err
        meter = self.cpu_meter
        assert meter is not None
        meter.start()
        err = None
        try:
            with _DataLimit(self.budget + (16 << 20)):
                self._step_loop(batch)
        except Exception as exc:  # noqa: BLE001 - classified below
            if not is_out_of_memory(exc):
                raise
            err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        peak = meter.stop()
        return peak, err

    def __call__(self, batch: int) -> Trial:
        started = time.perf_counter()
        try:
            peak, err = self._run(batch)
        finally:
            self._free()
        took = time.perf_counter() - started
        if err is not None:
            trial = Trial(batch, OOM, None, err)
        else:
            trial = classify(batch, peak, self.limit, oom=False, detail=f"{took:.2f} s")
        log.debug("trial batch=%d: %s peak=%s", batch, trial.outcome, format_bytes(trial.peak))
        return trial


# --------------------------------------------------------------------------- the tuner

def _describe_search(result: SearchResult, budget: Budget, margin: float, method: str) -> str:
    trials = ", ".join(f"{t.batch}{'✓' if t.fits else '✗'}" for t in result.trials)
    fit = result.peak
    lines = [
        f"budget {format_bytes(budget.bytes)} on {budget.device} ({budget.source}); "
        f"trials must peak ≤ {format_bytes(result.limit)} ({margin:.0%} safety margin)",
        f"search: {len(result.trials)} trials (+1 warm-up): {trials}; stopped: {result.stopped}",
    ]
    if fit is not None:
        lines.append(f"batch {result.batch} peaked at {format_bytes(fit)} (measured by {method})")
    return "\n".join(lines)


def tune_batch_size(model_factory: Callable[[], Any], make_batch: Callable[[int], Tuple[Any, Any]],
                    optimizer_factory: Callable[[Iterable[Any]], Any], loss_fn: Optional[Callable[[Any, Any], Any]] = None,
                    *, base_lr: float = 0.1, base_batch: int = 256, lr_rule: str = "linear",
                    accumulation_steps: int = 1, steps_per_epoch: Optional[int] = None,
                    max_memory: Optional[int] = None, margin: float = DEFAULT_MARGIN,
                    max_batch: int = 1 << 16, start: int = 1, tolerance: float = 0.05,
                    device: str = "auto", facts: Any = None, comm_module: Any = None) -> TuneResult:
    """Find the largest per-device batch whose training step fits in memory on every rank.

    Every rank searches on its own device with its own budget (its GPU's free memory, or
    its share of available RAM, capped by ``max_memory``), keeping ``margin`` of it free.
    The ranks then agree on the minimum (``comm.allreduce(op="min")``). Global batch =
    per-device × world size × ``accumulation_steps``; the learning rate is ``base_lr``
    scaled from ``base_batch`` by ``lr_rule``. Collective: every rank must call it.
    """
    import numpy as np

    target = TuneTarget(model_factory, make_batch, optimizer_factory, loss_fn, base_lr, base_batch, lr_rule,
                        accumulation_steps, steps_per_epoch)
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"safety margin must be in [0, 1), got {margin}")
    if comm_module is None:
        from hpctrain import comm as comm_module
    comm_module.init()
    if facts is None:
        from .collect import collect_facts

        facts = collect_facts(comm_module=comm_module)
    plan: BindingPlan = plan_binding(facts, device=device, env=os.environ)
    config = SearchConfig(start=start, max_batch=max_batch, tolerance=tolerance,
                          noise_floor=(2 << 20) if plan.device == "cpu" else (4 << 20))
    result, budget, method, error = _search_on_this_rank(target, facts, plan, max_memory, margin, config,
                                                         raise_errors=comm_module.size() == 1)
    mine = result.batch if (result is not None and error is None) else -1
    agreed = int(comm_module.allreduce(np.array([mine], dtype=np.int64), op="min")[0])
    reports = comm_module.allgather_object(
        {"rank": facts.rank, "host": facts.hostname, "device": plan.device, "budget": budget.bytes if budget else 0,
         "batch": mine, "error": error})
    errors = [r["error"] for r in reports if r["error"]]
    if agreed < 1 or errors:
        raise RuntimeError("batch-size tuning failed:\n" + "\n".join(errors or ["a rank found no batch that fits"]))
    assert result is not None and budget is not None
    choices = tuple(RankChoice(r["rank"], r["host"], r["device"], r["budget"], r["batch"]) for r in reports)
    per_device, agreement = agree_batch(choices)
    assert per_device == agreed, (per_device, agreed)
    world = comm_module.size()
    global_batch = global_batch_size(per_device, world, accumulation_steps)
    lr = scale_learning_rate(base_lr, base_batch, global_batch, lr_rule, steps_per_epoch=steps_per_epoch)
    explanation = "\n".join([
        f"per-device batch {per_device}: the largest training step (forward + backward + "
        "optimizer step) that fits on every rank",
        _describe_search(result, budget, margin, method),
        agreement,
        f"global batch {global_batch} = {per_device} per device × {world} rank(s) × {accumulation_steps} "
        f"accumulation step(s)",
        f"learning rate {lr.lr:.6g}: {lr.explanation}",
    ])
    return TuneResult(per_device, global_batch, lr.lr, explanation, world, accumulation_steps, lr_rule,
                      lr.warmup_epochs, lr.warmup_steps, plan.device, budget.bytes, result.limit, margin,
                      result.trials, choices, method)


def _search_on_this_rank(target: TuneTarget, facts: Any, plan: BindingPlan, max_memory: Optional[int], margin: float,
                         config: SearchConfig, raise_errors: bool
                         ) -> Tuple[Optional[SearchResult], Optional[Budget], str, Optional[str]]:
    """``tune_batch_size``'s search on this rank's device: (result, budget, trial method,
    error). A failure is returned as the error text (``raise_errors``: raised, with one
    rank), since every rank must still reach the agreement or the others hang."""
    result: Optional[SearchResult] = None
    budget: Optional[Budget] = None
    method = ""
    try:
        budget = rank_budget(facts, plan, max_memory)
        limit = int(budget.bytes * (1.0 - margin))
        runner = TrialRunner(target, plan.device, budget.bytes, limit)
        method = runner.method
        with PinnedMallocThreshold() if plan.device == "cpu" else contextlib.nullcontext():
            runner.warm_up()
            result = run_search(runner, limit, config)
        if result.batch == 0:
            first = result.trials[0] if result.trials else None
            seen = (f"peak {format_bytes(first.peak)}" if first and first.peak is not None
                    else (first.detail if first else "no trial"))
            return result, budget, method, (
                f"rank {facts.rank} on {facts.hostname}: batch {config.start} does not fit in "
                f"{format_bytes(limit)} on {plan.device} ({seen}).\n"
                "HINT: raise --max-memory, use a smaller model, activation checkpointing or model parallelism")
    except Exception as exc:  # noqa: BLE001 - every rank must learn about it, or the others hang
        if raise_errors:
            raise
        return result, budget, method, f"rank {facts.rank} on {facts.hostname}: {type(exc).__name__}: {exc}"
    return result, budget, method, None


def tune_target(target: TuneTarget, **kwargs: Any) -> TuneResult:
    """``tune_batch_size`` with the fields of a TuneTarget (what the CLI uses)."""
    return tune_batch_size(target.model_factory, target.make_batch, target.optimizer_factory, target.loss_fn,
                           base_lr=target.base_lr, base_batch=target.base_batch, lr_rule=target.lr_rule,
                           accumulation_steps=target.accumulation_steps, steps_per_epoch=target.steps_per_epoch,
                           **kwargs)
