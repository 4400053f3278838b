"""Tests are selected by kind (pytest.ini's markers): a test outside tests/unit/ without a kind
is refused at collection, and the kinds select what they say."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def collect(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_a_test_outside_unit_without_a_kind_is_refused(tmp_path):
    shutil.copy(ROOT / "pytest.ini", tmp_path)
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "tests")
    (tmp_path / "tests" / "unit" / "test_pure.py").write_text("def test_pure():\n    pass\n")
    (tmp_path / "tests" / "test_marked.py").write_text(
        "import pytest\n\npytestmark = pytest.mark.mpi\n\ndef test_marked():\n    pass\n")
    assert collect(tmp_path).returncode == 0
    (tmp_path / "tests" / "test_launch.py").write_text("def test_launches_mpiexec():\n    pass\n")
    done = collect(tmp_path)
    assert done.returncode != 0 and "tests/test_launch.py: a test outside tests/unit/ needs one of" in done.stderr
    (tmp_path / "tests" / "test_launch.py").write_text(
        "import pytest\n\n@pytest.mark.mpl\ndef test_typo():\n    pass\n")
    done = collect(tmp_path)
    assert done.returncode != 0 and "'mpl' not found in `markers`" in done.stdout + done.stderr


def test_kinds_select_by_fixture_and_module_mark():
    files = ["tests/unit/test_slurm_conf.py", "tests/test_multinode_suites.py"]
    unit = collect(ROOT, "-m", "not (mpi or slurm or cluster or gpu)", *files).stdout
    assert "tests/unit/test_slurm_conf.py::" in unit and "test_multinode_suites" not in unit
    cluster = collect(ROOT, "-m", "cluster and slow", *files).stdout
    assert "test_multinode_suites.py::test_mpi_suite_at_2x2" in cluster and "test_slurm_conf" not in cluster
