"""Run a CLI verb so that an exception on any rank aborts the whole MPI job."""
from __future__ import annotations

import sys
from typing import Any, Callable


def run_or_abort(func: Callable[[Any], int], args: Any) -> int:
    try:
        return int(func(args) or 0)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        # by name: the package attribute ``world`` is the function world(), not the module
        from .world import is_initialized, report_and_abort, size

        if is_initialized() and size() > 1:
            report_and_abort(*sys.exc_info())
        raise
