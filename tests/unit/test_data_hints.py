"""Every error hpctrain.data raises for bad input says what to do: each DataError (or
subclass) raised in the package's source passes a ``hint``."""
from __future__ import annotations

import ast
from pathlib import Path

import hpctrain.data as data_pkg
from hpctrain.data import errors

ERRORS = {name for name in dir(errors) if name.endswith("Error") and issubclass(getattr(errors, name), errors.DataError)}


def test_every_data_error_has_a_hint():
    missing = []
    for path in sorted(Path(data_pkg.__file__).parent.glob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) \
                    and getattr(node.exc.func, "id", None) in ERRORS \
                    and not any(k.arg == "hint" for k in node.exc.keywords):
                missing.append(f"{path.name}:{node.lineno}")
    assert not missing, f"errors without a HINT: {missing}"


def test_hint_is_the_second_line():
    exc = errors.MissingKeyError("no such key", path="a.h5", key="x", hint="pass keys that exist")
    assert str(exc).split("\n") == ["a.h5 [key 'x']: no such key", "HINT: pass keys that exist"]
