"""``hpctrain ARGV`` run inside the test process, for commands that start no MPI (``train
--dry-run`` with ``--ranks``, configs refused before any rank talks to another): the same exit
code, stdout and stderr as the subprocess, without its ~3 s of interpreter and torch start-up.
Commands that start MPI, need their own environment or must be seen from outside (a
traceback, a signal) run as subprocesses (``mpirun.run_command``)."""
from __future__ import annotations

import contextlib
import io
import subprocess
from typing import Sequence


def hpctrain(argv: Sequence[str]) -> subprocess.CompletedProcess:
    from hpctrain.cli.main import main
    from hpctrain.comm import is_initialized

    before = is_initialized()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's refusals
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    # a command that started MPI here would tie this test process to it: run that one outside
    assert before or not is_initialized(), f"hpctrain {' '.join(argv)} started MPI: run it as a subprocess"
    return subprocess.CompletedProcess(["hpctrain", *argv], code, out.getvalue(), err.getvalue())
