"""loss: built-in names with options and user functions, per sample."""
import pytest
import torch
import torch.nn.functional as F

from hpctrain.train.losses import LossError, LossSpec, build_loss, parse_loss


def test_cross_entropy_options_match_torch():
    out, y = torch.randn(8, 3), torch.randint(0, 3, (8,))
    fn = build_loss(parse_loss({"name": "cross_entropy", "label_smoothing": 0.1, "class_weights": [1, 2, 0.5]}))
    ref = F.cross_entropy(out, y, weight=torch.tensor([1, 2, 0.5]), label_smoothing=0.1, reduction="none")
    assert torch.allclose(fn(out, y), ref)
    assert parse_loss("cross_entropy").classification and not parse_loss("huber").classification


@pytest.mark.parametrize("spec,ref", [
    ("mse", lambda o, t: ((o - t) ** 2).mean(1)),
    ({"name": "huber", "delta": 0.5}, lambda o, t: F.huber_loss(o, t, delta=0.5, reduction="none").mean(1)),
    ({"name": "bce_with_logits", "pos_weight": 2.0},
     lambda o, t: F.binary_cross_entropy_with_logits(o, t, pos_weight=torch.tensor(2.0), reduction="none").mean(1)),
])
def test_regression_losses_per_sample(spec, ref):
    out, y = torch.randn(6, 2), torch.rand(6, 2)
    got = build_loss(parse_loss(spec))(out, y)
    assert got.shape == (6,) and torch.allclose(got, ref(out, y))


def test_user_function_scalar_counts_as_batch_mean():
    out, y = torch.randn(5, 2), torch.randn(5, 2)
    spec = parse_loss("my_losses.py:l1")
    fn = build_loss(spec, importer=lambda s: (lambda o, t: (o - t).abs().mean()))
    assert spec.function == "my_losses.py:l1" and not spec.classification
    assert torch.allclose(fn(out, y).mean(), (out - y).abs().mean())


@pytest.mark.parametrize("value,says", [
    ("focal", "is not one of"), ({"name": "mse", "delta": 1}, "takes no option delta"),
    ({"name": "cross_entropy", "label_smoothing": 1.5}, r"in \[0, 1\)"),
    ({"name": "cross_entropy", "class_weights": [1, -1]}, "non-negative"), (3, "expected a name"),
    ("file.py:", "file.py:function")])
def test_bad_loss_values_are_named(value, says):
    with pytest.raises(LossError, match=says):
        parse_loss(value)


def test_user_function_wrong_arity_and_shape():
    with pytest.raises(LossError, match="must take"):
        build_loss(LossSpec(name="user", function="f.py:g"), importer=lambda s: (lambda o: o))
    fn = build_loss(LossSpec(name="user", function="f.py:g"), importer=lambda s: (lambda o, t: o))
    with pytest.raises(LossError, match="expected a number or one value per sample"):
        fn(torch.randn(4, 3), torch.randn(4, 3))


def test_class_weights_must_match_the_classes():
    fn = build_loss(parse_loss({"name": "cross_entropy", "class_weights": [1, 2]}))
    with pytest.raises(LossError, match="2 values but the model outputs 3 classes"):
        fn(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
