"""A rank ends while the others still call collectives; argv[1]: how it ends ("exit": the
script returns; "shutdown": hvd.shutdown(), then it idles; "in-time": every rank makes the
same calls, the ranks end seconds apart), argv[2]: elements (4: the flag exchange; 1000000:
the piped path), argv[3]: the algorithm (auto, ring, native), argv[4]: the rank that ends."""
import sys
import time

import numpy as np

from hpctrain import comm

how, elements, algorithm = sys.argv[1], int(sys.argv[2]), sys.argv[3]
early = int(sys.argv[4]) if len(sys.argv) > 4 else 1
comm.init()
x = np.ones(elements, dtype=np.float32)
comm.allreduce(x, algorithm=algorithm)
if how == "in-time":
    comm.allreduce(x, algorithm=algorithm)
    time.sleep(3 if comm.rank() == early else 0)  # a late rank; then work after the last call
    if comm.rank() != early:
        time.sleep(3)
    print(f"rank {comm.rank()} ended in time", flush=True)
    sys.exit(0)
if comm.rank() == early:
    if how == "shutdown":
        comm.shutdown()
        time.sleep(120)
    print(f"rank {comm.rank()} ends after one all-reduce", flush=True)
    sys.exit(0)
comm.allreduce(x, algorithm=algorithm)
print("unreachable: the all-reduce completed", flush=True)
