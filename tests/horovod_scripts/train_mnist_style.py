"""A Horovod PyTorch training script in the style of Horovod's pytorch_mnist.py, with the
import swapped to hpctrain. Synthetic MNIST-shaped data so it runs anywhere."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import hpctrain.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST-style example")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--batches-per-allreduce", type=int, default=1)
parser.add_argument("--seed", type=int, default=42)
args = parser.parse_args()

hvd.init()
torch.manual_seed(args.seed)
torch.set_num_threads(1)

g = torch.Generator().manual_seed(0)
images = torch.randn(192, 1, 28, 28, generator=g)
labels = (images.mean(dim=(1, 2, 3)) > 0).long() + 2 * (images[:, 0, 0, 0] > 0).long()
train_dataset = torch.utils.data.TensorDataset(images, labels)
# Horovod scripts partition the data with torch's DistributedSampler and hvd.size()/hvd.rank().
train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(),
                                                                rank=hvd.rank())
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


model = Net()
lr_scaler = args.batches_per_allreduce * hvd.size() if not args.use_adasum else 1
optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     backward_passes_per_step=args.batches_per_allreduce,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average,
                                     gradient_predivide_factor=args.gradient_predivide_factor)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    total = 0.0
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        # Split the batch into sub-batches for gradient accumulation, as Horovod's example does.
        for i in range(0, len(data), args.batch_size // args.batches_per_allreduce):
            data_batch = data[i:i + args.batch_size // args.batches_per_allreduce]
            target_batch = target[i:i + args.batch_size // args.batches_per_allreduce]
            output = model(data_batch)
            loss = F.nll_loss(output, target_batch)
            total += loss.item()
            loss.div_(args.batches_per_allreduce)
            loss.backward()
        optimizer.step()
        if batch_idx % 5 == 0 and hvd.rank() == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]\tLoss: {loss.item():.6f}")
    return metric_average(total / max(1, len(train_loader)), "avg_loss")


losses = [train(epoch) for epoch in range(1, args.epochs + 1)]
if hvd.rank() == 0:
    print("epoch losses", losses)

# Every rank must end with the same weights.
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = hvd.allgather(flat.unsqueeze(0))
assert torch.allclose(gathered, flat.expand_as(gathered)), "ranks diverged"
assert all(l == l for l in losses), "NaN loss"
print(f"HOROVOD-SCRIPT-OK rank {hvd.rank()}", flush=True)
