"""Pure parts of the runner's new keys: data.weights (per rank / per node), sync.buffers,
callbacks (validation, paths relative to the config file), the merge weight."""
import math
from pathlib import Path

import pytest

from hpctrain.train.averaging import merge_weight
from hpctrain.train.callbacks import Callback, load_callbacks
from hpctrain.train.config import ConfigError, config_from_dict, load_config
from hpctrain.train.plan import make_plan, rank_weights


def cfg(**top):
    data = {"data": {"train": ["a.h5"]}, "steps": 10}
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **v}
        else:
            data[k] = v
    return config_from_dict(data)


def test_weights_one_per_rank():
    assert rank_weights([3, 1], 2) == [3.0, 1.0]


def test_weights_one_per_node_with_the_real_layout():
    # 4 ranks on 2 nodes, ranks placed round-robin: each rank gets its node's weight
    assert rank_weights([2, 1], 4, node_of_rank=[0, 1, 0, 1]) == [2.0, 1.0, 2.0, 1.0]
    # node indices need not start at 0
    assert rank_weights([2, 1], 4, node_of_rank=[5, 5, 9, 9]) == [2.0, 2.0, 1.0, 1.0]


def test_weights_per_node_without_a_layout_assume_blocks():
    assert rank_weights([2, 1], 4) == [2.0, 2.0, 1.0, 1.0]


@pytest.mark.parametrize("weights,world,layout,match", [
    ([1, 2, 3], 4, None, r"3 numbers for 4 ranks; expected 4 \(one per rank\) or a divisor of 4"),
    ([1, 2, 3], 4, [0, 0, 1, 1], r"expected 4 \(one per rank\) or 2 \(one per node\)"),
    ([1, 2], 4, [0, 0, 0, 0], r"or 1 \(one per node\)"),
])
def test_weights_count_that_fits_neither(weights, world, layout, match):
    with pytest.raises(ConfigError, match=match):
        rank_weights(weights, world, node_of_rank=layout)


def test_weights_of_a_pipeline_are_per_replica_only():
    assert rank_weights([1, 2], 2, per_node=False) == [1.0, 2.0]
    with pytest.raises(ConfigError, match="one per replica"):
        rank_weights([1, 2], 4, per_node=False)


def test_plan_takes_data_weights():
    c = cfg(data={"policy": "weighted", "weights": [3, 1]}, batch_size=10)
    p = make_plan(c, [1000], [], 2)
    assert p.rank_batch_sizes == (15, 5) and p.weights == (3.0, 1.0)
    with pytest.raises(ConfigError, match="data.weights: 2 numbers for 3 ranks"):
        make_plan(c, [1000], [], 3)


@pytest.mark.parametrize("data,match", [
    ({"policy": "weighted"}, "data.policy: weighted needs data.weights"),
    ({"policy": "weighted", "weights": [1, 0]}, r"data.weights\[1\]: 0.0 must be a positive number"),
    ({"policy": "weighted", "weights": [1, -2]}, r"data.weights\[1\]"),
    ({"policy": "weighted", "weights": [1, math.nan]}, r"data.weights\[1\]"),
    ({"weights": [1, 2]}, "data.weights is used only by data.policy: weighted"),
])
def test_bad_weights_are_config_errors(data, match):
    with pytest.raises(ConfigError, match=match):
        cfg(data=data)


def test_sync_buffers_choices():
    assert cfg().sync.buffers == "average"
    assert cfg(sync={"buffers": "broadcast"}).sync.buffers == "broadcast"
    with pytest.raises(ConfigError, match="sync.buffers: 'mean' is not one of 'average', 'broadcast', 'none'"):
        cfg(sync={"buffers": "mean"})


def test_merge_weight():
    assert merge_weight(30.0, 40.0, 2) == 0.75
    assert merge_weight(0.0, 0.0, 4) == 0.25  # nothing counted yet: equal shares


def test_callback_specs_are_checked_and_relative_to_the_config_file(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"callbacks\[0\]: 'nocolon' is not"):
        cfg(callbacks=["nocolon"])
    sub = tmp_path / "conf"
    sub.mkdir()
    (sub / "hooks.py").write_text(
        "from hpctrain.train.callbacks import Callback\n\n"
        "class Mine(Callback):\n    pass\n\n"
        "class NeedsArgs(Callback):\n    def __init__(self, x):\n        pass\n\n"
        "class NoHooks:\n    pass\n")
    (sub / "run.yaml").write_text("data: {train: [a.h5]}\nsteps: 3\n"
                                  "callbacks: [hooks.py:Mine, hpctrain.train.callbacks:Callback]\n")
    c = load_config(sub / "run.yaml")
    assert c.callbacks == [f"{sub / 'hooks.py'}:Mine", "hpctrain.train.callbacks:Callback"]
    got = load_callbacks(c.callbacks)
    assert len(got) == 2 and all(isinstance(cb, Callback) for cb in got)
    with pytest.raises(ConfigError, match=r"callbacks\[0\]: .* without arguments"):
        load_callbacks([f"{sub / 'hooks.py'}:NeedsArgs"])
    with pytest.raises(ConfigError, match="none of the hook methods"):
        load_callbacks([f"{sub / 'hooks.py'}:NoHooks"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_callbacks([f"{sub / 'nope.py'}:Mine"])
