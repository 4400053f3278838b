"""Keep glibc malloc from returning large blocks to the OS between training steps.

Each step frees and re-allocates tens of MB of activations and gradients. With glibc's
defaults, blocks above the (dynamic) mmap threshold are unmapped on free and faulted in again
on the next step: ~2 µs per 4 KiB page, ~20 ms per step for 10,000 faults.
Raising MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ keeps them in the heap.

hpctrain sets both (to 4 GiB) for its own commands and for what `hpctrain launch` starts —
unless the user set either one. Set HPCTRAIN_MALLOC_TUNING=0 to leave malloc alone.
"""
from __future__ import annotations

import ctypes
import os
from typing import Dict, MutableMapping

from hpctrain import settings

THRESHOLD_BYTES = 4 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
ENV_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def wanted(env: MutableMapping[str, str]) -> bool:
    return settings.read("malloc_tuning", env) and not any(k in env for k in ENV_KEYS)


def child_env(env: MutableMapping[str, str]) -> Dict[str, str]:
    """``env`` plus the malloc thresholds, for processes we start (they read them at start)."""
    out = dict(env)
    if wanted(env):
        for key in ENV_KEYS:
            out[key] = str(THRESHOLD_BYTES)
    return out


def tune_this_process() -> bool:
    """Apply the thresholds to this (already running) process with mallopt; True if applied."""
    if not wanted(os.environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(min(THRESHOLD_BYTES, 2**31 - 1)))
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(min(THRESHOLD_BYTES, 2**31 - 1)))
        return bool(ok)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return False
