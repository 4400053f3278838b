"""hpctrain.settings: the one reader of HPCTRAIN_* variables and the one size parser."""
import ast
import re
from pathlib import Path

import pytest

from hpctrain import settings
from hpctrain.settings import SettingError, parse_size

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hpctrain"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.fixture(autouse=True)
def fresh_cache():
    settings.reset()
    yield
    settings.reset()


# --------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("text,value", [
    ("4096", 4096), ("0", 0), ("512KiB", 512 * KiB), ("1MiB", MiB), ("64M", 64 * MiB), ("1G", GiB),
    ("1GB", GiB), ("2 gb", 2 * GiB), ("1kb", KiB), ("1k", KiB), ("3T", 3 << 40), ("1.5G", 3 * GiB // 2),
    ("0.5KiB", 512), (" 16 MiB ", 16 * MiB), ("100B", 100), ("1.0", 1),
])
def test_parse_size_reads_every_form_with_units_of_1024(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1", "-1G", "1.3", "1 XB", "1GiBs", "1e6", "1 G B", "0x10", "1..5K"])
def test_parse_size_rejects_what_it_cannot_read_and_says_the_form(text):
    with pytest.raises(ValueError, match="powers of 1024"):
        parse_size(text)


@pytest.mark.parametrize("value", [0, 1, 1000, KiB, 3 * KiB, MiB + 1, 64 * MiB, 5 * GiB])
def test_format_size_round_trips(value):
    assert parse_size(settings.format_size(value)) == value


def test_every_size_parser_of_hpctrain_agrees():
    """CLI flags (--sizes, --size, --max-memory, --fusion-threshold) and settings read "1G"
    the same way: they all are the settings parser."""
    from hpctrain.bench import data as bench_data
    from hpctrain.comm import plan
    from hpctrain.probe import parse_bytes as probe_parse
    from hpctrain.torch.buckets import parse_bytes as bucket_parse

    for text in ("1G", "1GB", "1GiB", "64M", "64MB", "512KiB", "512k", "4096", "1.5G"):
        expected = parse_size(text)
        assert {plan.parse_size(text), bucket_parse(text), probe_parse(text), bench_data.parse_size(text)} == {expected}


# --------------------------------------------------------------------------- values and errors
def env(name: str, raw: str) -> dict:
    return {settings.PREFIX + name.upper(): raw}


def test_ring_segment_in_the_readme_notation_is_read():
    assert settings.read("ring_segment_bytes", env("ring_segment_bytes", "1MiB")) == MiB
    assert settings.read("ring_segment_bytes", {}) is None  # each ring's own default


@pytest.mark.parametrize("name,raw,words", [
    ("stall_timeout", "abc", "a number of seconds >= 0 (0 switches the watchdog off)"),
    ("stall_timeout", "-5", "a number of seconds >= 0"),
    ("stall_timeout", "nan", "a number of seconds"),
    ("ring_segment_bytes", "0", "a size >= 1 KiB"),
    ("ring_segment_bytes", "512", "a size >= 1 KiB"),
    ("ring_segment_bytes", "garbage", "a size >= 1 KiB"),
    ("shm_slot_bytes", "0", "a size >= 4 KiB"),
    ("shm_small_bytes", "0", "a size >= 1 KiB"),
    ("fusion_threshold", "lots", "a size >= 0 (0 gives one bucket per parameter)"),
    ("backend", "bogus", "one of mpi, gloo, nccl, horovod"),
    ("allreduce", "fast", "one of auto, ring, native, shm, hierarchical"),
    ("check_collectives", "maybe", "1 or 0"),
])
def test_a_bad_value_is_one_line_naming_the_variable_the_value_and_the_form(name, raw, words):
    with pytest.raises(SettingError) as info:
        settings.read(name, env(name, raw))
    message = str(info.value)
    var = settings.PREFIX + name.upper()
    assert message.startswith(f"{var}={raw!r}: expected ")
    assert words in message and "HINT:" in message and "\n" not in message


@pytest.mark.parametrize("name,raw,value", [
    ("stall_timeout", "0", 0.0), ("stall_timeout", "2.5", 2.5), ("stall_timeout", "", 300.0),
    ("check_collectives", "0", False), ("check_collectives", "off", False), ("check_collectives", "YES", True),
    ("overlap", "", None), ("overlap", "1", True), ("backend", "GLOO", "gloo"), ("allreduce", "", "auto"),
    ("fusion_threshold", "0", 0), ("fusion_threshold", "4MiB", 4 * MiB), ("shm_slot_bytes", "4K", 4 * KiB),
    ("mpiexec", "/opt/mpi/bin/mpiexec", "/opt/mpi/bin/mpiexec"), ("checkpoint_dir", "", None),
])
def test_good_values(name, raw, value):
    assert settings.read(name, env(name, raw)) == value


def test_negative_stall_timeout_is_an_error_not_the_watchdog_switched_off(monkeypatch):
    from hpctrain.comm import watchdog

    monkeypatch.setenv("HPCTRAIN_STALL_TIMEOUT", "-5")
    with pytest.raises(SettingError, match="HPCTRAIN_STALL_TIMEOUT='-5'"):
        watchdog.stall_timeout()


def test_the_modules_read_their_values_through_settings(monkeypatch):
    from hpctrain.comm import algorithms, mpiring, shmsync, tuning
    from hpctrain.torch import backends, buckets

    for var, raw in (("RING_SEGMENT_BYTES", "64KiB"), ("SHM_SLOT_BYTES", "8K"), ("SHM_SMALL_BYTES", "2K"),
                     ("SHM_STREAMING_BYTES", "1M"), ("AUTOTUNE", "off"), ("FUSION_THRESHOLD", "1MiB")):
        monkeypatch.setenv("HPCTRAIN_" + var, raw)
    assert algorithms.ring_segment_bytes() == mpiring.segment_bytes() == 64 * KiB
    assert shmsync.slot_bytes_wanted() == 8 * KiB and shmsync.small_allreduce_bytes() == 2 * KiB
    assert shmsync.streaming_bytes() == MiB and tuning.enabled() is False
    assert buckets.fusion_threshold_from_env() == MiB
    monkeypatch.setenv("HPCTRAIN_BACKEND", "bogus")
    with pytest.raises(SettingError, match="HPCTRAIN_BACKEND='bogus': expected one of mpi, gloo"):
        backends.get_backend()


def test_defaults_match_the_modules_constants():
    from hpctrain.comm import algorithms, mpiring, plan, shmsync
    from hpctrain.torch import backends, buckets

    assert settings.read("fusion_threshold", {}) == buckets.DEFAULT_FUSION_THRESHOLD
    assert settings.read("shm_small_bytes", {}) == shmsync.SMALL_ALLREDUCE_BYTES
    assert settings.read("shm_slot_bytes", {}) == shmsync.SLOT_BYTES
    assert settings.read("shm_slot_bytes", {}) >= shmsync.PIPED_MIN_SLOT_BYTES
    assert algorithms.ring_segment_bytes() == algorithms.PY_RING_SEGMENT_BYTES
    assert mpiring.segment_bytes() == mpiring.SEGMENT_BYTES
    assert settings._BY_NAME["allreduce"].choices == plan.ALGORITHMS
    assert settings._BY_NAME["backend"].choices == backends.BACKENDS


# --------------------------------------------------------------------------- rc, cache, override
def test_rc_rejects_unknown_names_and_assignment():
    with pytest.raises(AttributeError, match="no setting 'stall_timout'; known: stall_timeout"):
        settings.rc.stall_timout
    with pytest.raises(AttributeError, match="HPCTRAIN_STALL_TIMEOUT"):
        settings.rc.stall_timeout = 5
    assert "ring_segment_bytes" in dir(settings.rc)


def test_values_are_parsed_once_until_reset(monkeypatch):
    monkeypatch.setenv("HPCTRAIN_STALL_TIMEOUT", "7")
    assert settings.rc.stall_timeout == 7.0
    monkeypatch.setenv("HPCTRAIN_STALL_TIMEOUT", "abc")
    assert settings.rc.stall_timeout == 7.0  # cached: a process sees one value
    settings.reset()
    with pytest.raises(SettingError):
        settings.rc.stall_timeout


def test_override_is_checked_and_undone(monkeypatch):
    monkeypatch.setenv("HPCTRAIN_RING_C", "1")
    with settings.override(ring_c=False, shm_slot_bytes="8KiB"):
        assert settings.rc.ring_c is False and settings.rc.shm_slot_bytes == 8 * KiB
    assert settings.rc.ring_c is True
    with pytest.raises(SettingError, match="shm_slot_bytes"):
        with settings.override(shm_slot_bytes=0):
            pass
    with pytest.raises(AttributeError):
        with settings.override(no_such_setting=1):
            pass


def test_check_all_finds_the_bad_variable():
    settings.check_all({})
    with pytest.raises(SettingError, match="HPCTRAIN_SHM_SLOT_BYTES='0'"):
        settings.check_all({"HPCTRAIN_SHM_SLOT_BYTES": "0", "HPCTRAIN_STALL_TIMEOUT": "60"})


# --------------------------------------------------------------------------- docs and the rule
def readme_table() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("keeps it equal -->\n\n") + len("keeps it equal -->\n\n")
    return text[start:text.index("\n<!-- end of the generated table -->", start)]


def test_readme_table_is_the_generated_one():
    assert readme_table() == settings.markdown_table(), (
        "README's table of variables differs from the declarations in hpctrain/settings.py; "
        "HINT: paste the output of `python -m hpctrain.settings` between the markers")


def test_every_declared_variable_is_in_the_readme_and_every_row_is_declared():
    rows = set(re.findall(r"^\| `(HPCTRAIN_\w+)`", readme_table(), flags=re.MULTILINE))
    assert rows == {s.env for s in settings.DECLARED}
    assert all(s.doc and "\n" not in s.doc for s in settings.DECLARED)


DIRECT_READ = re.compile(
    r"""(environ|getenv|env)\s*(\.get\(|\[|\.pop\(|\.setdefault\(|\()\s*f?["']HPCTRAIN_"""
    r"""|["']HPCTRAIN_\w*["']\s+(not\s+)?in\s+""")


def test_no_module_but_settings_reads_hpctrain_variables():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "settings.py" and path.parent == PACKAGE:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if DIRECT_READ.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, ("read HPCTRAIN_* through hpctrain.settings (declare the variable there):\n"
                           + "\n".join(offenders))


def test_the_grep_catches_direct_reads():
    for line in ('os.environ.get("HPCTRAIN_X", "1")', "env['HPCTRAIN_X']", 'os.getenv("HPCTRAIN_X")',
                 'if "HPCTRAIN_X" in os.environ:'):
        assert DIRECT_READ.search(line), line
    assert not DIRECT_READ.search('raise ValueError("set HPCTRAIN_X=1")')


def imports_of(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.module or ""
            else:  # resolve relative to the file's package
                base = list(path.relative_to(ROOT).with_suffix("").parts[:-node.level])
                yield ".".join(base + ([node.module] if node.module else []))
                if not node.module:
                    yield from (".".join(base + [alias.name]) for alias in node.names)


def test_settings_is_a_leaf_and_comm_imports_only_it_of_ours():
    assert not [m for m in imports_of(PACKAGE / "settings.py") if m.startswith("hpctrain")]
    for path in (PACKAGE / "comm").glob("*.py"):
        ours = {m for m in imports_of(path) if m.startswith("hpctrain") and not m.startswith("hpctrain.comm")}
        assert ours <= {"hpctrain", "hpctrain.settings"}, (path.name, ours)
