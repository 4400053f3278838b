"""Rank 1 never enters the all-reduce: the watchdog must abort the job, naming rank 1.
argv[1]: elements (default 4: the flag exchange; 1000000: the piped path on one node)."""
import sys
import time

import numpy as np

from hpctrain import comm

comm.init()
if comm.rank() == 1:
    time.sleep(120)
comm.allreduce(np.ones(int(sys.argv[1]) if len(sys.argv) > 1 else 4, dtype=np.float32))
print("unreachable: the all-reduce completed", flush=True)
