"""hpctrain extensions used from a Horovod-style script: the sync strategies, the sampler,
learning-rate scaling, metric_average and rank-0 printing."""
import sys

import torch

import hpctrain.torch as hvd

hvd.init()
torch.set_num_threads(1)
syncs = (sys.argv[1] if len(sys.argv) > 1 else "allreduce").split(",")


def train(sync):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    sampler = hvd.DistributedSampler(len(x), shuffle=True, seed=1)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    lr = hvd.scale_lr(0.01, rule="sqrt")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                   named_parameters=model.named_parameters(), sync=sync)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    first = None
    for epoch in range(4):
        sampler.set_epoch(epoch)
        idx = list(sampler)
        total = 0.0
        for i in range(0, len(idx), 10):
            b = idx[i:i + 10]
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[b]), y[b])
            loss.backward()
            if sync.startswith("model_average"):
                opt.step(num_samples=len(b))
            else:
                opt.step()
            total += loss.item()
        avg = hvd.metric_average(total, "loss")
        first = avg if first is None else first
        hvd.print0(f"[{sync}] epoch {epoch} loss {avg:.4f}")
    if sync.startswith("model_average"):
        opt.merge()
    assert avg < first, (first, avg)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.allclose(hvd.allgather(flat.unsqueeze(0)), flat.expand(hvd.size(), -1)), "ranks diverged"


for sync in syncs:
    train(sync)
print(f"HOROVOD-SCRIPT-OK rank {hvd.rank()}", flush=True)
