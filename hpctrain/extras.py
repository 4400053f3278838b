"""Optional dependencies, installed with pip extras: import one, or fail with one line that
names the extra to install."""
from __future__ import annotations

import importlib
from types import ModuleType

# import name -> (pip extra, distribution)
EXTRAS = {
    "matplotlib": ("report", "matplotlib"),
    "sklearn": ("examples", "scikit-learn"),
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message says which extra brings it."""


def require(module: str, purpose: str) -> ModuleType:
    """``import module`` (a key of :data:`EXTRAS` or a submodule of one), or raise
    :class:`MissingExtraError` saying that ``purpose`` needs it and how to install it."""
    top = module.partition(".")[0]
    extra, dist = EXTRAS[top]
    try:
        importlib.import_module(top)
    except ModuleNotFoundError as exc:
        if exc.name != top:  # the package is there but broken: that error is the useful one
            raise
        raise MissingExtraError(
            f"{purpose} needs {dist}, which is not installed. "
            f"HINT: pip install 'hpctrain[{extra}]' (or: pip install {dist})",
            name=top,
        ) from None
    return importlib.import_module(module)
