"""Rank 1 raises; the others wait in a collective. The job must end, naming rank 1."""
import sys

import numpy as np

from hpctrain import comm

comm.init()
if comm.rank() == int(sys.argv[1]):
    raise RuntimeError("injected failure")
comm.allreduce(np.ones(4))
comm.barrier()
print("unreachable", flush=True)
