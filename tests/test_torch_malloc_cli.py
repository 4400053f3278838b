"""``hvd.init()`` raises glibc's malloc thresholds for scripts started by plain mpiexec/srun
(``hpctrain launch`` does it through the environment): a freed 64 MiB block is reused instead
of being unmapped and faulted in again on the next allocation."""
import re
import subprocess

import pytest

from mpirun import ROOT, mpi_env, mpiexec_argv, python_argv

pytestmark = pytest.mark.mpi

SCRIPT = r"""
import ctypes, resource
import hpctrain.torch as hvd
hvd.init()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
counts = []
for _ in range(3):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(64 << 20)
    libc.memset(p, 1, 64 << 20)
    libc.free(p)
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print("FAULTS", counts[1], counts[2])
hvd.shutdown()
"""


def faults(tuning: str):
    env = mpi_env({"HPCTRAIN_MALLOC_TUNING": tuning})
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        env.pop(key, None)
    out = subprocess.run(mpiexec_argv(1) + python_argv("-c", SCRIPT), env=env, cwd=str(ROOT), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120).stdout
    m = re.search(r"FAULTS (\d+) (\d+)", out)
    assert m, out[-3000:]
    return int(m.group(1)), int(m.group(2))


def test_init_keeps_freed_blocks_in_the_heap():
    assert faults("1") == (0, 0)
    untuned = faults("0")
    assert min(untuned) > 10_000, untuned  # 64 MiB = 16,384 pages, faulted in again each time
