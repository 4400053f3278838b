"""The C ring (extension ``_mpiring``) in one process: binding to the MPI library mpi4py
loaded, the size-1 and empty cases, and the arguments it refuses. The ring itself runs
under mpiexec (tests/mpi/test_comm_collectives.py, both rings, 1–4 ranks)."""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm import mpiring
from hpctrain.comm.buffers import DTYPE_CODES
from require import skip_or_fail

try:
    from hpctrain.comm import _mpiring
except ImportError as exc:  # optional extension: pip install succeeds without a compiler
    skip_or_fail("mpiring", f"hpctrain.comm._mpiring not built (no C compiler or Python headers at install): {exc}",
                 module_level=True)

F32 = DTYPE_CODES["float32"]


def call(buf, scratch, dtype=F32, op=0, rank=0, size=1, seg=1024):
    return _mpiring.allreduce(MPI.COMM_SELF.handle, MPI.BYTE.handle, rank, size, buf, scratch, dtype, op, size, seg)


def test_binds_to_the_mpi_library_mpi4py_loaded():
    assert mpiring.available()
    assert mpiring.usable(MPI.COMM_SELF) and mpiring.usable(MPI.COMM_SELF)  # agreed once, then cached


def test_one_rank_and_empty_buffers_are_left_alone():
    x = np.arange(10, dtype=np.float32)
    assert call(x, np.empty(64, np.uint8)) == 0
    np.testing.assert_array_equal(x, np.arange(10, dtype=np.float32))
    assert call(np.empty(0, np.float32), np.empty(64, np.uint8), size=2, rank=1) == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": DTYPE_CODES["float16"]}, "unsupported dtype"),
    ({"dtype": DTYPE_CODES["bfloat16"]}, "unsupported dtype"),
    ({"op": 7}, "unsupported dtype"),
    ({"rank": 2, "size": 2}, "rank 2 of 2"),
    ({"size": 0}, "rank 0 of 0"),
    ({"seg": 2}, "segments of 2 bytes"),
])
def test_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        call(np.zeros(8, np.float32), np.empty(64, np.uint8), **kwargs)


def test_refuses_a_scratch_without_room_for_one_segment():
    with pytest.raises(ValueError, match="holds no"):
        call(np.zeros(1000, np.float32), np.empty(16, np.uint8), size=2, seg=256)


def test_refuses_read_only_buffers():
    x = np.zeros(8, np.float32)
    x.flags.writeable = False
    with pytest.raises((TypeError, BufferError, ValueError)):
        call(x, np.empty(64, np.uint8))


def test_scratch_holds_the_slots_of_one_chunk_at_most():
    seg = mpiring.SEGMENT_BYTES // 4
    assert mpiring.scratch_elements(10, 2, 4) == mpiring.SLOTS * 5
    assert mpiring.scratch_elements(10 * seg, 2, 4) == mpiring.SLOTS * seg
    assert mpiring.scratch_elements(0, 2, 4) == mpiring.SLOTS
    assert mpiring.kernel_dtype_code("float16") is None and mpiring.kernel_dtype_code("int64") is not None


def test_known_after_the_agreement_only():
    comm = MPI.COMM_SELF.Dup()
    try:
        assert mpiring.known(comm) is None  # not agreed yet: the ring must ask (a collective)
        assert mpiring.usable(comm) is True and mpiring.known(comm) is True
    finally:
        comm.Free()


def test_an_mpi_error_names_the_way_out(monkeypatch):
    monkeypatch.setattr(_mpiring, "allreduce", lambda *args: MPI.ERR_TRUNCATE)
    from hpctrain.comm.errors import CommError

    with pytest.raises(CommError, match="HPCTRAIN_RING_C=0"):
        mpiring.allreduce_(MPI.COMM_SELF, np.zeros(4, np.float32), F32, "sum", 1, np.empty(64, np.uint8))
