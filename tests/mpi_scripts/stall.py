"""Rank 1 never enters the all-reduce: the watchdog must abort the job, naming rank 1.
argv[1]: elements (default 4: the flag exchange; 1000000: the piped path on one node);
argv[2]: the algorithm (default auto; ring: the C ring, or the Python one with HPCTRAIN_RING_C=0,
after one ring all-reduce together; run it with HPCTRAIN_CHECK_COLLECTIVES=0 to stall in the ring);
argv[3] "after-one": one all-reduce together first, whatever the algorithm (the check's buffers are reused);
argv[4]: the rank that never comes (default 1)."""
import sys
import time

import numpy as np

from hpctrain import comm

comm.init()
algorithm = sys.argv[2] if len(sys.argv) > 2 else "auto"
if algorithm == "ring" or sys.argv[3:] == ["after-one"]:  # a first ring together: the stall then comes inside the ring itself
    comm.allreduce(np.ones(int(sys.argv[1]), dtype=np.float32), algorithm=algorithm)
if comm.rank() == (int(sys.argv[4]) if len(sys.argv) > 4 else 1):
    time.sleep(120)
comm.allreduce(np.ones(int(sys.argv[1]) if len(sys.argv) > 1 else 4, dtype=np.float32), algorithm=algorithm)
print("unreachable: the all-reduce completed", flush=True)
