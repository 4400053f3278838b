"""Validation against published results: Horovod's README reports 90% scaling efficiency for
Inception V3 and ResNet-101 and 68% for VGG-16 on 128 servers × 4 Pascal GPUs over 25 Gbit/s
RoCE. Fed those models' sizes and published single-GPU throughputs (hpctrain.scaling.published
says which and from where), the model must land within 10 points of each, with nothing
fitted to them."""
import pytest

from hpctrain.scaling import published
from hpctrain.scaling.predict import machine_for, predict
from hpctrain.scaling.profile import profile_from_dict


@pytest.mark.parametrize("model", sorted(published.PUBLISHED_EFFICIENCY))
def test_horovod_512_gpu_efficiency_within_ten_points(model):
    prof = profile_from_dict(published.HOROVOD_512[model])
    m = machine_for(prof, published.HOROVOD_NODES, published.HOROVOD_GPUS_PER_NODE)
    got = predict(prof, m, published.HOROVOD_ALGORITHM, published.HOROVOD_FUSION).efficiency
    assert abs(got - published.PUBLISHED_EFFICIENCY[model]) <= 0.10, (model, got)


def test_published_inputs_are_the_documented_ones():
    assert published.P100_IMAGES_PER_S["inception_v3"] == 142.0 and published.P100_IMAGES_PER_S["vgg16"] == 154.0
    assert 125 < published.P100_IMAGES_PER_S["resnet101"] < 132
    vgg = profile_from_dict(published.HOROVOD_512["vgg16"])
    assert sum(p.numel for p in vgg.params) == 138_357_544  # torchvision's VGG-16
    # the fully connected layers, registered last, are ready first in backward
    ready = {p.name: p.ready_s for p in vgg.params}
    assert ready["fc8.weight"] < ready["fc6.weight"] < ready["conv12.weight"] < ready["conv0.weight"]
    assert ready["conv0.weight"] == pytest.approx(vgg.backward_s)


def test_vgg16_is_predicted_to_scale_worst():
    effs = {}
    for model in published.PUBLISHED_EFFICIENCY:
        prof = profile_from_dict(published.HOROVOD_512[model])
        m = machine_for(prof, published.HOROVOD_NODES, published.HOROVOD_GPUS_PER_NODE)
        effs[model] = predict(prof, m, "ring", published.HOROVOD_FUSION).efficiency
    assert effs["vgg16"] < min(effs["inception_v3"], effs["resnet101"]) - 0.1
