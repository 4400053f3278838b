"""`hpctrain --help`, `--version` and every verb's `--help` load none of the heavy libraries
(torch, mpi4py, h5py, numpy): the parser imports only the module of the verb asked for, and
a verb module imports its libraries when it runs. Checked on the modules a fresh interpreter
has loaded, not on a timing."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpctrain.cli.main import VERBS

HEAVY = ("torch", "mpi4py", "h5py", "numpy", "matplotlib", "sklearn", "jinja2", "yaml")

PROBE = """
import io, json, sys
from contextlib import redirect_stdout
from hpctrain.cli.main import main
out = io.StringIO()
try:
    with redirect_stdout(out):
        main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
else:
    code = None
print(json.dumps({"code": code, "out": out.getvalue(),
                  "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in %r)}))
""" % (HEAVY,)


def loaded_by(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []] + [[verb, "--help"] for verb in VERBS],
                         ids=lambda a: " ".join(a) or "no-args")
def test_help_and_version_import_no_heavy_library(argv):
    result = loaded_by(*argv)
    assert result["loaded"] == [], f"hpctrain {' '.join(argv)} imported {result['loaded']}"
    assert result["code"] in (0, None) or argv == []
    assert "usage: hpctrain" in result["out"] or result["out"].startswith("hpctrain ")


def test_top_level_help_lists_every_verb():
    out = loaded_by("--help")["out"]
    for verb, (_, help_text) in VERBS.items():
        assert verb in out and help_text in out


def test_a_benchmark_parser_loads_its_module_only_when_used():
    result = loaded_by("bench", "allreduce", "--help")
    assert result["code"] == 0 and "--sizes" in result["out"]  # the module's own arguments
    assert "numpy" in result["loaded"]
