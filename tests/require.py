"""The rule for tests that need something this machine may lack (a scheduler, a GPU, a C
extension, the multi-node cluster): skip with the reason printed, or fail when
``HPCTRAIN_REQUIRE_<WHAT>=1`` says that it must be there (CI sets these; see README)."""
from __future__ import annotations

import os
from typing import NoReturn, Optional

import pytest

from mpirun import report_past_capture


def required(what: str) -> bool:
    """Whether ``HPCTRAIN_REQUIRE_<WHAT>=1`` is set."""
    return os.environ.get(require_var(what)) == "1"


def require_var(what: str) -> str:
    return f"HPCTRAIN_REQUIRE_{what.upper()}"


def skip_or_fail(what: str, reason: str, request: Optional[pytest.FixtureRequest] = None,
                 module_level: bool = False) -> NoReturn:
    """Skip the calling test (or module: ``module_level``) because ``reason``; fail it instead
    when ``HPCTRAIN_REQUIRE_<WHAT>=1``. With a fixture's ``request`` the skip reason is also
    printed past pytest's capture, so that a skipped service is seen without ``-rs``."""
    var = require_var(what)
    if required(what):
        pytest.fail(f"{var}=1 but {reason}", pytrace=False)
    report_past_capture(request, f"\nSKIP {what} tests: {reason}")
    pytest.skip(f"{reason}; set {var}=1 to make this a failure", allow_module_level=module_level)
