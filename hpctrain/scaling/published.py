"""Profiles of published runs, written from published numbers: the validation of the model.

Horovod's README: 128 servers × 4 Pascal GPUs, RoCE-capable 25 Gbit/s network,
tf_cnn_benchmarks with ``--batch_size 64`` per GPU (Horovod's docs/benchmarks), scaling
efficiency 90% for Inception V3 and ResNet-101 and 68% for VGG-16.

Inputs and where they come from:

- single-GPU throughput, P100, synthetic ImageNet data, batch 64: TensorFlow's published
  benchmarks (tensorflow.org "Benchmarks", NVIDIA DGX-1 P100 table): Inception V3 142
  images/s, VGG16 154 images/s. ResNet-101 is not in that table; it is interpolated
  linearly in FLOPs per image between ResNet-50 (219 images/s, 3.8 GFLOPs) and ResNet-152
  (91.8 images/s, 11.3 GFLOPs), at 7.6 GFLOPs (He et al. 2016, Table 1): 129 images/s;
- parameters: Inception V3 23.8 M (Szegedy et al. 2016), ResNet-101 44.5 M, VGG-16 138.4 M
  (torchvision's layer shapes, listed below);
- backward is 2/3 of the step (the usual 1:2 forward:backward FLOP ratio), the optimizer's
  update is neglected;
- when each gradient is ready: VGG-16 in proportion to each layer's FLOPs (backward of a
  layer costs ~2× its forward FLOPs); Inception V3 and ResNet-101 as many equal tensors with
  equal backward time each (their layers are uniform enough);
- links: intra-node PCIe 3.0 ×16 between the GPUs (~10 GB/s, 5 µs per message), the named
  fabric ``roce25`` across nodes, GPU reduction at 200 GB/s;
- Horovod then: tensor fusion at 64 MiB, NCCL's ring over all GPUs (``ring``).

No parameter is fitted to the published efficiencies.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

__all__ = ["HOROVOD_512", "PUBLISHED_EFFICIENCY", "horovod_profile", "vgg16_layers"]

BATCH = 64
HOROVOD_NODES, HOROVOD_GPUS_PER_NODE = 128, 4
HOROVOD_FUSION = 64 * 1024 * 1024
HOROVOD_ALGORITHM = "ring"
PUBLISHED_EFFICIENCY = {"inception_v3": 0.90, "resnet101": 0.90, "vgg16": 0.68}
P100_IMAGES_PER_S = {"inception_v3": 142.0, "resnet101": 1 / (1 / 219 + (7.6 - 3.8) / (11.3 - 3.8) * (1 / 91.8 - 1 / 219)),
                     "vgg16": 154.0}
# (parameter count, number of gradient tensors as torchvision registers them)
SIZES = {"inception_v3": (23_834_568, 292), "resnet101": (44_549_160, 314)}
LINKS = {"intra": {"alpha_s": 5e-6, "bandwidth_Bps": 10e9}, "inter": {"fabric": "roce25"}, "gamma_Bps": 200e9}


def vgg16_layers() -> List[Tuple[str, Tuple[int, ...], Tuple[int, ...], float]]:
    """VGG-16's layers in registration order: (name, weight shape, bias shape, forward FLOPs
    per image: 2·MACs)."""
    convs = [(64, 3, 224), (64, 64, 224), (128, 64, 112), (128, 128, 112), (256, 128, 56), (256, 256, 56),
             (256, 256, 56), (512, 256, 28), (512, 512, 28), (512, 512, 28), (512, 512, 14), (512, 512, 14),
             (512, 512, 14)]
    out = [(f"conv{i}", (co, ci, 3, 3), (co,), 2.0 * side * side * co * ci * 9) for i, (co, ci, side) in enumerate(convs)]
    for name, (o, i) in (("fc6", (4096, 25088)), ("fc7", (4096, 4096)), ("fc8", (1000, 4096))):
        out.append((name, (o, i), (o,), 2.0 * o * i))
    return out


def _vgg16_parameters(backward_s: float) -> List[Dict[str, Any]]:
    layers = vgg16_layers()
    total = sum(f for *_, f in layers)
    params, done = [], 0.0
    for name, w, b, flops in reversed(layers):  # backward runs the last layer first
        done += flops / total * backward_s
        params.append({"name": f"{name}.bias", "shape": list(b), "ready_s": done})
        params.append({"name": f"{name}.weight", "shape": list(w), "ready_s": done})
    return list(reversed(params))


def horovod_profile(model: str) -> Dict[str, Any]:
    """The profile (JSON form) of one GPU of Horovod's published 512-GPU run."""
    if model not in PUBLISHED_EFFICIENCY:
        raise ValueError(f"unknown published model {model!r}; valid: {', '.join(PUBLISHED_EFFICIENCY)}")
    step = BATCH / P100_IMAGES_PER_S[model]
    backward = step * 2 / 3
    data: Dict[str, Any] = {
        "name": f"horovod-{model}", "batch_per_rank": BATCH,
        "compute": {"forward_s": step - backward, "backward_s": backward, "optimizer_s": 0.0},
        "links": LINKS, "fusion_threshold": HOROVOD_FUSION,
        "source": "Horovod README (512 GPUs, 25 Gbit/s RoCE); TensorFlow benchmarks (P100, batch 64)",
    }
    if model == "vgg16":
        data["parameters"] = _vgg16_parameters(backward)
    else:
        numel, tensors = SIZES[model]
        data["gradients"] = {"numel": numel, "tensors": tensors, "dtype": "float32"}
    return data


HOROVOD_512 = {m: horovod_profile(m) for m in PUBLISHED_EFFICIENCY}
