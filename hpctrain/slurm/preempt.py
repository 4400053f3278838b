"""Preemption: stop cleanly at a step boundary, checkpoint, and requeue the SLURM job.

SLURM warns a job before it ends: ``#SBATCH --signal=B:USR1@120`` (our templates forward
the batch shell's SIGUSR1 to the job step), ``scancel -b --signal=USR1``, or SIGTERM at the
time limit / on preemption (then SIGKILL after the cluster's ``KillWait``). A handler must
not checkpoint inside the signal handler (it may interrupt a collective half-way); it only
sets a flag, and the training loop polls it after each step::

    from hpctrain.slurm import preempt

    guard = preempt.install()                 # SIGUSR1 and SIGTERM set a flag
    start = load_checkpoint_if_any()          # on a requeued run SLURM_RESTART_COUNT >= 1
    for step in range(start, total):
        train_step(step)
        if guard.should_stop(agree=comm_any):  # every rank stops at the same step
            save_checkpoint(step + 1)         # atomically, all ranks, then a barrier
            guard.requeue()                   # rank 0 only: scontrol requeue $SLURM_JOB_ID
            break

``agree`` combines the local flag across ranks (any rank signalled -> all stop); without
it, ranks that received the signal between two different steps would leave the others
waiting in a collective. :func:`any_rank` builds one from ``hpctrain.comm``.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from types import FrameType
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence

from . import env as slurm_env

__all__ = ["PreemptionGuard", "install", "any_rank", "requeue_job", "requeue_taken"]

log = logging.getLogger("hpctrain.slurm")

DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionGuard:
    """Signal handlers that record a stop request; poll :meth:`should_stop` between steps.

    Handlers chain nothing and do no I/O: they set a flag (async-signal-safe in Python's
    sense). Use as a context manager, or call :meth:`uninstall` to restore the previous
    handlers.
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise ValueError("PreemptionGuard needs at least one signal, e.g. (signal.SIGUSR1,)")
        self._received: Optional[signal.Signals] = None
        self._previous: Dict[signal.Signals, object] = {}

    # -- handlers -------------------------------------------------------------------------
    def install(self) -> "PreemptionGuard":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "signal handlers can only be installed from the main thread; "
                "HINT: call preempt.install() at the start of your training script"
            )
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self._received is None:
            self._received = signal.Signals(signum)

    def __enter__(self) -> "PreemptionGuard":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- polling --------------------------------------------------------------------------
    @property
    def received(self) -> Optional[signal.Signals]:
        """The first stop signal this process received, or None."""
        return self._received

    def request_stop(self, signum: int = signal.SIGUSR1) -> None:
        """Record a stop request as if ``signum`` had arrived (tests, custom triggers)."""
        self._handle(signum, None)

    def should_stop(self, agree: Optional[Callable[[bool], bool]] = None) -> bool:
        """True once a stop signal arrived here (or, with ``agree``, on any rank).

        Every rank must call it at the same step when ``agree`` is a collective.
        """
        local = self._received is not None
        return bool(agree(local)) if agree is not None else local

    # -- requeue --------------------------------------------------------------------------
    def requeue(
        self,
        rank: int = 0,
        env: Optional[Mapping[str, str]] = None,
        run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    ) -> bool:
        """Rank 0 asks SLURM to requeue this job; other ranks do nothing. See :func:`requeue_job`."""
        if rank != 0:
            return False
        return requeue_job(env=env, run=run)


def install(signals: Sequence[int] = DEFAULT_SIGNALS) -> PreemptionGuard:
    """Install handlers for ``signals`` (default SIGUSR1 and SIGTERM); return the guard."""
    return PreemptionGuard(signals).install()


def any_rank() -> Callable[[bool], bool]:
    """An ``agree`` function for :meth:`PreemptionGuard.should_stop` over ``hpctrain.comm``:
    True on every rank when any rank's flag is set (one tiny all-reduce)."""
    from hpctrain import comm
    import numpy as np

    def agree(flag: bool) -> bool:
        if not comm.is_initialized() or comm.size() == 1:
            return flag
        return bool(comm.allreduce(np.array([1.0 if flag else 0.0]), op="max")[0] > 0)

    return agree


def requeue_job(
    env: Optional[Mapping[str, str]] = None,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    scontrol: str = "scontrol",
    confirm_timeout: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """``scontrol requeue $SLURM_JOB_ID``, then wait until SLURM shows the requeue. True
    when it does.

    SLURM then ends this run (every process of the job gets SIGTERM) and starts the job
    again with ``SLURM_RESTART_COUNT`` one higher: call it only after the checkpoint is
    safely written on every rank. Outside SLURM, or when SLURM refuses (a job submitted with
    ``--no-requeue``, or one already ending), it logs why and returns False.

    An accepted requeue shows at once in ``scontrol show job`` (``Restarts`` one higher, the
    job completing or pending). This process waits for that (at most ``confirm_timeout``
    seconds) before returning, so the job never ends on its own before SLURM has taken it
    back; if SLURM still shows this run as the current one after the wait, it logs an error
    and returns False (the caller then exits non-zero instead of ending the job as
    COMPLETED with no rerun coming).
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")  # an array task has its own job id too
    if not job_id:
        log.warning("preempt: not inside a SLURM job (no SLURM_JOB_ID); nothing to requeue")
        return False
    try:
        done = run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.error("preempt: could not run `%s requeue %s`: %s", scontrol, job_id, exc)
        return False
    if done.returncode != 0:
        log.error(
            "preempt: `%s requeue %s` failed (exit %s): %s\nHINT: submit with --requeue (our "
            "templates do) and make sure the cluster allows requeue (JobRequeue)",
            scontrol, job_id, done.returncode, (done.stderr or done.stdout or "").strip(),
        )
        return False
    restarts = slurm_env.restart_count(env)
    if not _requeue_shows(job_id, restarts, run, scontrol, confirm_timeout, sleep):
        return False
    log.info("preempt: job %s requeued; it will resume from the checkpoint", job_id)
    return True


def requeue_taken(info: Mapping[str, str], restarts_before: int) -> bool:
    """Whether ``scontrol show job``'s record shows a requeue of the run that had
    ``restarts_before`` restarts (pure)."""
    try:
        restarts = int(info.get("Restarts", ""))
    except ValueError:
        restarts = -1
    state = info.get("JobState", "")
    return restarts > restarts_before or state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")


def _requeue_shows(
    job_id: str,
    restarts_before: int,
    run: Callable[..., subprocess.CompletedProcess],
    scontrol: str,
    timeout: float,
    sleep: Callable[[float], None],
) -> bool:
    """Poll ``scontrol show job`` until it shows the requeue; False only when it answered
    and kept showing this run for ``timeout`` seconds."""
    from .submit import parse_scontrol_show_job

    last: Dict[str, str] = {}
    waited, step = 0.0, 0.1
    while True:
        try:
            done = run([scontrol, "show", "job", job_id], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            done = None
        # SLURM's kill for the requeue may take scontrol itself down (SIGTERM): keep asking.
        if done is not None and done.returncode == 0:
            last = parse_scontrol_show_job(done.stdout)
            if requeue_taken(last, restarts_before):
                return True
        if waited >= timeout:
            break
        sleep(step)
        waited += step
    if not last:
        log.warning("preempt: `%s show job %s` did not answer; cannot confirm the requeue", scontrol, job_id)
        return True
    log.error(
        "preempt: SLURM accepted `%s requeue %s` but after %.0f s still shows JobState=%s "
        "Restarts=%s; the job may end without a rerun.\nHINT: resubmit it; the rerun "
        "resumes from the checkpoint just written",
        scontrol, job_id, timeout, last.get("JobState", "?"), last.get("Restarts", "?"),
    )
    return False
