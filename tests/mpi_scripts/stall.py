"""Rank 1 never enters the all-reduce: the watchdog must abort the job, naming rank 1."""
import time

import numpy as np

from hpctrain import comm

comm.init()
if comm.rank() == 1:
    time.sleep(120)
comm.allreduce(np.ones(4))
print("unreachable: the all-reduce completed", flush=True)
