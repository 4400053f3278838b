"""Evaluation metrics summed across ranks equal scikit-learn's on the pooled samples."""
import numpy as np
import pytest
import torch
from sklearn import metrics as skm

from hpctrain.train import losses, scoring

CLASSIFY = ["loss", "accuracy", "top2_accuracy", "precision", "recall", "f1", "precision_per_class",
            "recall_per_class", "f1_per_class", "confusion_matrix"]


def pooled(specs, out, y, classification, splits, masks=None, loss="cross_entropy", user=None):
    """Every 'rank' folds its slice; the totals are summed as the all-reduce would."""
    fn = losses.build_loss(losses.parse_loss(loss))
    width = out.reshape(out.shape[0], -1).shape[1]
    total = 0
    for i, (lo, hi) in enumerate(zip(splits[:-1], splits[1:])):
        acc = scoring.Accumulator(specs, fn, classification, user)
        mask = masks[lo:hi] if masks is not None else torch.ones(hi - lo, dtype=torch.bool)
        for s in range(lo, hi, 7):          # batches of 7
            e = min(hi, s + 7)
            acc.update(out[s:e], y[s:e], mask[s - lo:e - lo])
        total = total + acc.state(width)
    return scoring.compute(specs, total, classification, width)


@pytest.mark.parametrize("seed,splits", [(0, [0, 50, 100]), (1, [0, 3, 97, 100]), (2, [0, 0, 100]),
                                         (3, [0, 33, 66, 100])])
def test_classification_matches_sklearn_on_pooled_samples(seed, splits):
    g = torch.Generator().manual_seed(seed)
    out, y = torch.randn(100, 5, generator=g), torch.randint(0, 4, (100,), generator=g)
    mask = torch.rand(100, generator=g) > 0.1
    specs = scoring.parse_metrics(CLASSIFY, classification=True)
    r = pooled(specs, out, y, True, splits, mask)
    p, t = out[mask].argmax(1).numpy(), y[mask].numpy()
    assert r["test_samples"] == int(mask.sum())
    assert r["test_accuracy"] == pytest.approx(skm.accuracy_score(t, p))
    assert r["test_top2_accuracy"] == pytest.approx(skm.top_k_accuracy_score(t, out[mask].numpy(), k=2,
                                                                             labels=range(5)))
    for name, fn in [("precision", skm.precision_score), ("recall", skm.recall_score), ("f1", skm.f1_score)]:
        assert r[f"test_{name}"] == pytest.approx(fn(t, p, average="macro", zero_division=0)), name
        per = fn(t, p, average=None, labels=range(5), zero_division=0)
        assert r[f"test_{name}_per_class"] == pytest.approx(list(per)), name
    assert r["test_confusion_matrix"] == skm.confusion_matrix(t, p, labels=range(5)).tolist()
    assert r["test_loss"] == pytest.approx(torch.nn.functional.cross_entropy(out[mask], y[mask]).item(), rel=1e-6)


def test_averaging_per_rank_scores_would_differ():
    """The reason to sum counts: a rank with a few hard samples moves a per-rank average."""
    out = torch.tensor([[5.0, 0.0]] * 90 + [[0.0, 5.0]] * 10)
    y = torch.tensor([0] * 90 + [0] * 5 + [1] * 5)
    specs = scoring.parse_metrics(["f1"], classification=True)
    exact = pooled(specs, out, y, True, [0, 90, 100])["test_f1"]
    assert exact == pytest.approx(skm.f1_score(y.numpy(), out.argmax(1).numpy(), average="macro"))
    rank = [pooled(specs, out[a:b], y[a:b], True, [0, b - a])["test_f1"] for a, b in [(0, 90), (90, 100)]]
    assert abs(np.mean(rank) - exact) > 0.05


@pytest.mark.parametrize("width", [1, 3])
def test_regression_matches_sklearn(width):
    g = torch.Generator().manual_seed(width)
    y = torch.randn(80, width, generator=g)
    out = y + 0.3 * torch.randn(80, width, generator=g)
    specs = scoring.parse_metrics(["loss", "mse", "mae", "r2"], classification=False)
    r = pooled(specs, out, y, False, [0, 11, 80], loss="mse")
    assert r["test_mse"] == pytest.approx(skm.mean_squared_error(y.numpy(), out.numpy()))
    assert r["test_mae"] == pytest.approx(skm.mean_absolute_error(y.numpy(), out.numpy()))
    assert r["test_r2"] == pytest.approx(skm.r2_score(y.numpy(), out.numpy()))


def test_user_metric_per_sample_and_batch_mean():
    out, y = torch.randn(30, 3), torch.randint(0, 3, (30,))
    fns = {"m.py:per": lambda o, t: (o.argmax(1) == t).float(), "m.py:mean": lambda o, t: (o.argmax(1) == t).float().mean()}
    specs = scoring.parse_metrics(["accuracy", "m.py:per", "m.py:mean"], classification=True)
    r = pooled(specs, out, y, True, [0, 13, 30], user=fns)
    assert r["test_per"] == pytest.approx(r["test_accuracy"])
    assert r["test_mean"] == pytest.approx(r["test_accuracy"])


def test_rank_without_batches_contributes_zeros_of_the_agreed_width():
    specs = scoring.parse_metrics(["accuracy"], classification=True)
    empty = scoring.Accumulator(specs, losses.build_loss(losses.LossSpec()), True)
    assert empty.state(4).shape == (2 + 16,) and not empty.state(4).any()


@pytest.mark.parametrize("bad,classification,says", [
    ("f2", True, "is not one of"), ("r2", True, "regression metric"), ("f1", False, "classification loss"),
    ("top0_accuracy", True, "is not one of"), ("x.py:", True, "file.py:function")])
def test_bad_metrics_are_named(bad, classification, says):
    with pytest.raises(scoring.MetricError, match=says):
        scoring.parse_metrics([bad], classification)


def test_labels_outside_the_classes_are_named():
    acc = scoring.Accumulator(scoring.parse_metrics(["accuracy"], True), losses.build_loss(losses.LossSpec()), True)
    with pytest.raises(scoring.MetricError, match=r"labels 0\.\.7 outside the model's 3 classes"):
        acc.update(torch.randn(4, 3), torch.tensor([0, 1, 7, 2]), torch.ones(4, dtype=torch.bool))
