"""Each rank prints one line ``WHEREAMI {json}``: its MPI rank, size, hostname and how many
ranks MPI considers on its node (``Split_type(COMM_TYPE_SHARED)``), after a world all-reduce
that proves the ranks really talk to each other across nodes."""
import json
import os
import socket

from mpi4py import MPI

world = MPI.COMM_WORLD
node_comm = world.Split_type(MPI.COMM_TYPE_SHARED)
total = world.allreduce(world.rank + 1)  # 1 + 2 + … + size
line = {
    "rank": world.rank,
    "size": world.size,
    "hostname": socket.gethostname(),
    "node_size": node_comm.size,
    "node_rank": node_comm.rank,
    "processor_name": MPI.Get_processor_name(),
    "sum": total,
    "pid": os.getpid(),
}
print("WHEREAMI " + json.dumps(line), flush=True)
