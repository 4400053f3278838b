"""Every function of Horovod's PyTorch API that hpctrain.torch provides, used the way
Horovod documents it (docs/api.rst), with the import swapped."""
import torch

import hpctrain.torch as hvd

hvd.init()
torch.set_num_threads(1)
rank, size = hvd.rank(), hvd.size()
assert hvd.is_initialized()
assert 0 <= hvd.local_rank() < hvd.local_size() and 0 <= hvd.cross_rank() < hvd.cross_size()
assert hvd.mpi_enabled() and hvd.mpi_built()
for probe in (hvd.gloo_enabled, hvd.gloo_built, hvd.nccl_built, hvd.mpi_threads_supported):
    assert probe() in (True, False) or isinstance(probe(), int)

# allreduce family
t = torch.full((4,), float(rank))
assert torch.allclose(hvd.allreduce(t), torch.full((4,), (size - 1) / 2))
assert torch.allclose(hvd.allreduce(t, op=hvd.Sum, name="sum"), torch.full((4,), size * (size - 1) / 2))
assert float(hvd.allreduce(t, op=hvd.Min)[0]) == 0 and float(hvd.allreduce(t, op=hvd.Max)[0]) == size - 1
assert float(hvd.allreduce(t + 1, op=hvd.Product)[0]) == float(torch.arange(1, size + 1).prod())
u = t.clone()
hvd.allreduce_(u, op=hvd.Sum)
h = hvd.allreduce_async(t, name="async")
v = t.clone()
h_ = hvd.allreduce_async_(v, op=hvd.Sum)
while not hvd.poll(h):
    pass
assert torch.allclose(hvd.synchronize(h), hvd.allreduce(t))
hvd.synchronize(h_)
assert torch.equal(u, v)
a, b = hvd.grouped_allreduce([t, t * 2], op=hvd.Sum)
assert torch.allclose(b, 2 * a)
ga = [t.clone(), t.clone()]
hvd.grouped_allreduce_(ga)
assert torch.allclose(ga[0], hvd.allreduce(t))

# allgather / broadcast / alltoall / reducescatter
g = hvd.allgather(torch.full((rank + 1, 2), float(rank)))
assert g.shape == (size * (size + 1) // 2, 2)
assert torch.equal(hvd.synchronize(hvd.allgather_async(torch.ones(1, 3))), torch.ones(size, 3))
root = size - 1
assert torch.equal(hvd.broadcast(t, root_rank=root), torch.full((4,), float(root)))
w = t.clone()
hvd.broadcast_(w, root_rank=0)
assert torch.equal(w, torch.zeros(4))
assert torch.equal(hvd.synchronize(hvd.broadcast_async(t, 0)), torch.zeros(4))
w2 = t.clone()
hvd.synchronize(hvd.broadcast_async_(w2, root))
assert torch.equal(w2, torch.full((4,), float(root)))
out = hvd.alltoall(torch.arange(size, dtype=torch.float32) + 10 * rank)
assert torch.equal(out, torch.tensor([10.0 * r + rank for r in range(size)]))
out, splits = hvd.alltoall(torch.ones(size, 2), splits=[1] * size)
assert splits.tolist() == [1] * size
rs = hvd.reducescatter(torch.ones(size * 2, 3), op=hvd.Sum)
assert torch.equal(rs, torch.full((2, 3), float(size)))

# objects, join, barrier
assert hvd.broadcast_object({"cfg": rank}, root_rank=0) == {"cfg": 0}
assert hvd.allgather_object(rank) == list(range(size))
hvd.barrier()
assert 0 <= hvd.join() < size

# model, SyncBatchNorm, optimizer with skip_synchronize and bf16 compression
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), hvd.SyncBatchNorm(4), torch.nn.ReLU(),
                            torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=hvd.Compression.bf16)
hvd.broadcast_optimizer_state(opt, root_rank=0)
for step in range(3):
    opt.zero_grad()
    x = torch.randn(3, 2, 6, 6)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with opt.skip_synchronize():
        opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
assert torch.allclose(hvd.allgather(flat.unsqueeze(0)), flat.expand(size, -1)), "ranks diverged"

# Adasum needs a power-of-two number of ranks, as in Horovod (this tour runs at 3): a clear error
try:
    hvd.allreduce(t, op=hvd.Adasum)
except NotImplementedError as exc:
    assert "Adasum" in str(exc)
else:
    raise AssertionError("Adasum should raise")

print(f"HOROVOD-SCRIPT-OK rank {rank}", flush=True)
hvd.shutdown()
