"""Models, data and reference training shared by the DistributedOptimizer MPI tests."""
import copy

import torch

import hpctrain.torch as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(False)

B = 4  # samples per rank per step
STEPS = 4


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Conv2d(4, 6, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(6 * 2 * 2, 3)).double()


def data(kind, step, batch):
    """The global batch of a step: identical on every rank; rank r takes rows r*B..(r+1)*B."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch, 10, generator=g) if kind == "mlp" else torch.randn(batch, 2, 8, 8, generator=g)
    y = torch.randint(0, 3, (batch,), generator=g)
    return x.double(), y


def reference(kind, steps, make_opt, passes=1, loss_scale=1.0):
    """1 process, full batch N*B*passes per step."""
    model = mlp() if kind == "mlp" else cnn()
    opt = make_opt(model.parameters())
    for s in range(steps):
        x, y = data(kind, s, N * B * passes)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def distributed(kind, steps, make_opt, passes=1, **kw):
    model = mlp() if kind == "mlp" else cnn()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kw)
    for s in range(steps):
        x, y = data(kind, s, N * B * passes)
        opt.zero_grad()
        for p in range(passes):
            # pass p of rank R: a B-row slice; all passes of all ranks cover the global batch
            lo = (p * N + R) * B
            loss = torch.nn.functional.cross_entropy(model(x[lo:lo + B]), y[lo:lo + B]) / passes
            loss.backward()
        opt.step()
    return model, opt


def max_rel(a, b):
    worst = 0.0
    with torch.no_grad():
        for p, q in zip(a.parameters(), b.parameters()):
            worst = max(worst, float((p - q).abs().max() / q.abs().max().clamp_min(1e-12)))
    return worst


def local_grads(model, x, y):
    """This rank's own gradient, from a twin of ``model`` (the optimizer's buffers are being
    all-reduced in place as soon as backward fills them)."""
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    torch.nn.functional.cross_entropy(twin(x), y).backward()
    return [p.grad.clone() for p in twin.parameters()]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)
