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
        from . import world as _world

        if _world.is_initialized() and _world.size() > 1:
            _world.report_and_abort(*sys.exc_info())
        raise
