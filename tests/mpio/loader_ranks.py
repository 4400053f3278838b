"""Run under the mpio environment's mpiexec (tests/mpio/setup-env.sh): the loader's
parallel-HDF5 path (driver="mpio") at every rank, checked like the serial MPI tests.

Each rank reads its share of three files opened with ``driver="mpio"`` on the world
communicator; rank 0 gathers every rank's sample ids and checks that the real ones cover
every sample exactly once, that the steps are equal, and that each rank got exactly the ids
its plan names. The same epoch read with ``driver="serial"`` must give identical batches.
Prints ``MPIO-LOADER-OK <ranks>`` on rank 0 when all checks pass; any failure aborts the job.

  DIR/bin/mpiexec -n 2 DIR/bin/python tests/mpio/loader_ranks.py WORKDIR
"""
import os
import sys
import traceback

import h5py
import numpy as np


def main(workdir: str) -> None:
    from hpctrain import comm
    from hpctrain.data import HDF5Dataset, plan_epoch

    comm.init()
    n_ranks, rank = comm.size(), comm.rank()
    assert h5py.get_config().mpi, "this h5py has no MPI: not the mpio environment"
    sizes = [101, 37, 250]
    paths = [os.path.join(workdir, f"part{i}.h5") for i in range(len(sizes))]
    if rank == 0:
        start = 0
        for p, n in zip(paths, sizes):
            g = np.arange(start, start + n)
            with h5py.File(p, "w") as f:
                f.create_dataset("x", data=(g[:, None] * 10 + np.arange(3)).astype(np.float32), chunks=(16, 3))
                f.create_dataset("y", data=g, chunks=(16,))
            start += n
    comm.barrier()

    for policy in ("contiguous", "strided", "weighted"):
        for drop_last in (False, True):
            kw = dict(seed=3, policy=policy, drop_last=drop_last,
                      weights=[1.0 + r for r in range(n_ranks)] if policy == "weighted" else None)
            ds = HDF5Dataset(paths, ["x", "y"], 4, driver="mpio", window_bytes=1024, **kw)
            ds.set_epoch(1)
            ids, mask, steps, batches = [], [], 0, []
            for b in ds:
                assert np.array_equal(b["y"].numpy(), b["index"].numpy()), "y must be the global id"
                assert np.array_equal(b["x"][:, 0].numpy(), b["index"].numpy() * 10.0)
                ids.append(b["index"].numpy())
                mask.append(b["mask"].numpy())
                batches.append({k: v.clone() for k, v in b.items()})
                steps += 1
            drivers = set(ds._drivers.values())
            assert drivers == {"mpio"} and len(ds._drivers) == len(paths), f"files opened with {drivers}, expected mpio"
            assert all(m[k] is None for m in ds._maps.values() for k in m), "mpio reads must go through HDF5"
            ds.close()
            ids_a, mask_a = np.concatenate(ids), np.concatenate(mask)
            plan = plan_epoch(sizes, n_ranks, rank, 4, epoch=1, block_rows=ds.block_rows,
                              window_steps=ds.window_steps, **kw)
            assert np.array_equal(plan.indices, ids_a) and np.array_equal(plan.mask, mask_a), \
                f"rank {rank}: ids differ from its plan ({policy}, drop_last={drop_last})"
            serial = HDF5Dataset(paths, ["x", "y"], 4, driver="serial", window_bytes=1024, **kw)
            serial.set_epoch(1)
            for a, b in zip(batches, serial):
                for k in a:
                    assert np.array_equal(a[k].numpy(), b[k].numpy()), f"mpio and serial differ in {k!r}"
            serial.close()

            every = comm.allgather_object((ids_a[mask_a].tolist(), steps))
            if rank == 0:
                assert len({s for _, s in every}) == 1, f"unequal steps {[s for _, s in every]}"
                real = sorted(i for got, _ in every for i in got)
                if drop_last:
                    assert len(real) == len(set(real)) and len(real) > sum(sizes) - n_ranks * 4 * 2
                else:
                    assert real == list(range(sum(sizes))), f"{policy}: union is not every sample once"
            comm.barrier()
    if rank == 0:
        print(f"MPIO-LOADER-OK {n_ranks}", flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:  # noqa: BLE001 - any failure on any rank ends the whole job
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
