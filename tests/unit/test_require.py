"""The skip-or-fail rule for tests that need something a machine may lack lives in one place
(tests/require.py): each need has its own HPCTRAIN_REQUIRE_<WHAT> variable, and every one
the tests use is documented."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from require import skip_or_fail

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def test_skips_unless_required_then_fails(monkeypatch):
    monkeypatch.delenv("HPCTRAIN_REQUIRE_WIDGET", raising=False)
    monkeypatch.setenv("HPCTRAIN_REQUIRE_GADGET", "1")  # another need's variable changes nothing
    with pytest.raises(pytest.skip.Exception, match="no widget here; set HPCTRAIN_REQUIRE_WIDGET=1"):
        skip_or_fail("widget", "no widget here")
    monkeypatch.setenv("HPCTRAIN_REQUIRE_WIDGET", "1")
    with pytest.raises(pytest.fail.Exception, match="HPCTRAIN_REQUIRE_WIDGET=1 but no widget here"):
        skip_or_fail("widget", "no widget here")


def uses():
    """(file, what) of every skip_or_fail("what", …) call in the tests."""
    for path in sorted(TESTS.rglob("*.py")):
        if path.name in ("require.py", "test_require.py"):
            continue
        for what in re.findall(r'skip_or_fail\(\s*"([a-z]+)"', path.read_text()):
            yield path.relative_to(ROOT).as_posix(), what


def test_only_the_helper_reads_the_require_variables():
    reads = re.compile(r"""(environ\.get\(|environ\[|getenv\()\s*["']HPCTRAIN_REQUIRE_""")
    readers = sorted(p.relative_to(ROOT).as_posix() for p in TESTS.rglob("*.py") if reads.search(p.read_text()))
    assert readers == [], f"read HPCTRAIN_REQUIRE_* through tests/require.py: {readers}"


def test_each_extension_test_checks_its_own_variable():
    found = set(uses())
    assert ("tests/unit/test_mpiring_ext.py", "mpiring") in found
    assert ("tests/unit/test_shmsync_ext.py", "shmsync") in found
    assert ("tests/unit/test_codecs.py", "codecs") in found


def test_every_require_variable_is_documented():
    text = (ROOT / "README.md").read_text()
    start = text.index("`HPCTRAIN_REQUIRE_<WHAT>`")
    paragraph = text[start:text.index("\n\n", start)]
    documented = set(re.findall(r"`([A-Z]+)`", paragraph))
    missing = sorted({what.upper() for _, what in uses()} - documented)
    assert missing == [], f"README.md's HPCTRAIN_REQUIRE_<WHAT> paragraph does not list {missing}"
