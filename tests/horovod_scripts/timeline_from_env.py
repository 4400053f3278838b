"""HOROVOD_TIMELINE and HOROVOD_TIMELINE_MARK_CYCLES, read by hvd.init() as in Horovod's own
test_timeline: rank 0 writes a Chrome trace of the job's collectives from init on, with a
CYCLE_START marker (a global instant event) among them.

Runs against Horovod too (HVD_MODULE=horovod.torch)."""
import importlib
import json
import os
import tempfile
import time

import torch
from mpi4py import MPI

world = MPI.COMM_WORLD
folder = world.bcast(tempfile.mkdtemp(prefix="timeline-") if world.rank == 0 else None, root=0)
path = os.path.join(folder, "timeline.json")
os.environ["HOROVOD_TIMELINE"] = path
os.environ["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"

hvd = importlib.import_module(os.environ.get("HVD_MODULE", "hpctrain.torch"))
hvd.init()
total = hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]), op=hvd.Sum, name="test_allreduce")
assert total.tolist() == [float(hvd.size() * v) for v in (1, 2, 3)]
time.sleep(0.2)  # Horovod writes its timeline from a thread of its own
if hvd.rank() == 0:
    text = open(path).read()
    for needle in ("allreduce.test_allreduce", "NEGOTIATE_ALLREDUCE", "MPI_ALLREDUCE", "CYCLE_START"):
        assert needle in text, (needle, text[:2000])
    marker = next(e for e in json.loads(text) if e.get("name") == "CYCLE_START")
    assert marker["ph"] == "i" and marker["s"] == "g", marker
else:
    assert not os.path.exists(path) or os.path.getsize(path) > 0  # only rank 0 writes
hvd.shutdown()
world.Barrier()
if world.rank == 0:
    json.load(open(path))  # valid JSON once closed
print(f"rank {world.rank}: HOROVOD-SCRIPT-OK", flush=True)
