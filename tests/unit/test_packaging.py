"""Packaging: the metadata lives in pyproject.toml only, the declared Python is one the code
runs on, py.typed ships, and a built wheel carries the templates from slurm/ (one copy)."""
from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_metadata_in_pyproject_only():
    project = PYPROJECT["project"]
    # dataclass(kw_only=True, slots=True) in the typed configs needs 3.10
    assert project["requires-python"] == ">=3.10"
    assert set(project["optional-dependencies"]) >= {"report", "examples", "mpi", "dev"}
    assert not any(d.startswith(("matplotlib", "scikit-learn")) for d in project["dependencies"])
    call = next(n for n in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    assert {k.arg for k in call.keywords} == {"packages", "package_dir", "ext_modules"}


def test_py_typed_is_there_and_declared():
    assert (ROOT / "hpctrain" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["hpctrain"]


def test_makefile_reinstalls_when_a_build_input_changes():
    makefile = (ROOT / "Makefile").read_text()
    stamp_rule = makefile[makefile.index("$(STAMP):"):].split("\n\t", 1)[0]
    for source in ("pyproject.toml", "setup.py", "_shmsync.c", "_mpiring.c", "_kernels.h", "_codecs.c"):
        assert source in stamp_rule, f"the install stamp does not depend on {source}"
    phony = next(line for line in makefile.splitlines() if line.startswith(".PHONY:")).split()[1:]
    for target in phony:
        assert f"\n{target}:" in makefile, f".PHONY names {target}, which has no rule"


@pytest.mark.slow
def test_wheel_carries_the_templates_from_slurm(tmp_path):
    """Built as pip builds it (from a copy of the tracked tree): hpctrain/templates/ in the
    wheel holds exactly slurm/*.sbatch, and py.typed is in."""
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    src = tmp_path / "src"
    for name in tracked:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel, = (tmp_path / "dist").glob("hpctrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(f"hpctrain/templates/{p.name}" for p in (ROOT / "slurm").glob("*.sbatch"))
    assert sorted(n for n in names if n.endswith(".sbatch")) == shipped
    assert "hpctrain/py.typed" in names and "hpctrain/templates/__init__.py" in names
    assert not any(n.startswith("hpctrain/templates/") and n.endswith(".sh") for n in names)
