"""Training config: validation, YAML loading, --set overrides, unknown keys; the plan."""
import math

import pytest

from hpctrain.train.config import ConfigError, apply_overrides, load_config, parse_override, valid_keys
from hpctrain.train.plan import eval_batch_size, lr_factor, make_plan, scale_lr, schedule_points

BASE = {"data": {"train": ["a.h5"]}, "epochs": 2}


def cfg(**extra):
    data = {**BASE, **extra}
    return load_config(data=data)


def test_defaults_and_types():
    c = cfg()
    assert c.batch_size == 32 and c.optimizer.name == "sgd" and c.data.keys == {}
    assert c.checkpoint_dir.endswith("checkpoints")
    d = c.to_dict()
    assert d["optimizer"]["lr"] == 0.1 and d["data"]["train"] == ["a.h5"]
    assert load_config(data=d) == c  # round trip


def test_keys_from_recorded_roles_unless_given():
    c = cfg()
    c.data.resolve_keys({"x": "entry/data/data", "y": "entry/data/label"})
    assert c.data.keys == {"x": "entry/data/data", "y": "entry/data/label"} and c.data.x_key == "entry/data/data"
    c = cfg()
    c.data.resolve_keys({"x": "img"})  # a role not recorded: its own name
    assert c.data.keys == {"x": "img", "y": "y"}
    c = cfg(data={"train": ["a.h5"], "keys": {"x": "a", "y": "b"}})
    c.data.resolve_keys({"x": "img", "y": "label"})  # named in the config: kept
    assert c.data.keys == {"x": "a", "y": "b"}


def test_stratify_needs_the_stratified_policy():
    assert cfg(data={"train": ["a.h5"], "policy": "stratified", "stratify": "c"}).data.stratify == "c"
    with pytest.raises(ConfigError, match="data.stratify is used only by data.policy: stratified.*\nHINT:"):
        cfg(data={"train": ["a.h5"], "stratify": "c"})


def test_unknown_top_level_key_lists_valid_ones():
    with pytest.raises(ConfigError) as e:
        cfg(optimiser={"lr": 1})
    msg = str(e.value)
    assert "unknown key 'optimiser'" in msg and "optimizer" in msg and "batch_size" in msg


def test_unknown_nested_key_lists_section_keys():
    with pytest.raises(ConfigError) as e:
        cfg(optimizer={"learning_rate": 1})
    assert "'optimizer.learning_rate'" in str(e.value) and "lr" in str(e.value) and "momentum" in str(e.value)


@pytest.mark.parametrize("extra,needle", [
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": "big"}, "batch_size"),
    ({"optimizer": {"name": "lion"}}, "optimizer.name: 'lion'"),
    ({"optimizer": {"lr": -1}}, "optimizer.lr"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr: expected a number"),
    ({"optimizer": {"momentum": 1.5}}, "optimizer.momentum"),
    ({"schedule": {"kind": "linear"}}, "schedule.kind"),
    ({"sync": {"strategy": "gossip"}}, "sync.strategy"),
    ({"sync": {"compression": "int8"}}, "sync.compression"),
    ({"sync": {"backward_passes_per_step": 0}}, "backward_passes_per_step"),
    ({"eval": {"metrics": ["f2"]}}, "eval.metrics"),
    ({"checkpoint": {"keep": 0}}, "checkpoint.keep"),
    ({"lr_scaling": "cubic"}, "lr_scaling"),
    ({"on_nan": "ignore"}, "on_nan"),
    ({"balance": "yes"}, "balance"),
    ({"quiet": "yes"}, "quiet: expected true or false"),
    ({"epochs": 0}, "neither epochs nor steps"),
    ({"model": {"factory": "nocolon"}}, "model.factory"),
    ({"data": {"train": []}}, "data.train"),
    ({"data": {"train": ["a"], "keys": {"x": "x"}}}, "data.keys"),
    ({"data": {"train": ["a"], "policy": "strided"}, "balance": "auto"}, "balance: auto"),
    ({"loss": "mse"}, "accuracy"),
    ({"straggler_threshold": 0}, "straggler_threshold"),
])
def test_bad_values_are_rejected_with_the_key_named(extra, needle):
    with pytest.raises(ConfigError) as e:
        cfg(**extra)
    assert needle in str(e.value)


def test_missing_data_section():
    with pytest.raises(ConfigError, match="missing required key"):
        load_config(data={"epochs": 1})


def test_single_path_becomes_a_list_and_batch_auto_is_allowed():
    c = load_config(data={"data": {"train": "x.h5"}, "steps": 5, "batch_size": "auto"})
    assert c.data.train == ["x.h5"] and c.batch_size == "auto"


def test_parse_override_types():
    assert parse_override("optimizer.lr=0.05") == (["optimizer", "lr"], 0.05)
    assert parse_override("quiet=true") == (["quiet"], True)
    assert parse_override("model.kwargs.hidden=[64, 32]") == (["model", "kwargs", "hidden"], [64, 32])
    assert parse_override("run_dir=runs/a=b") == (["run_dir"], "runs/a=b")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("optimizer.lr")


def test_overrides_apply_with_precedence(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("data: {train: [d/a.h5]}\nepochs: 3\noptimizer: {name: adam, lr: 0.01}\n")
    c = load_config(y, ["optimizer.lr=0.5", "epochs=7", "model.kwargs.hidden=[8]", "sync.compression=fp16"])
    assert c.optimizer.lr == 0.5 and c.optimizer.name == "adam" and c.epochs == 7
    assert c.model.kwargs == {"hidden": [8]} and c.sync.compression == "fp16"
    # relative data paths are relative to the YAML file
    assert c.data.train == [str(tmp_path / "d" / "a.h5")]


def test_unknown_override_key_lists_valid_ones():
    with pytest.raises(ConfigError) as e:
        apply_overrides(dict(BASE), ["optimizer.lrr=1"])
    assert "unknown key 'optimizer.lrr'" in str(e.value) and "optimizer.lr" in str(e.value)
    with pytest.raises(ConfigError, match="is a section"):
        apply_overrides(dict(BASE), ["optimizer=1"])


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)


def test_valid_keys_cover_sections():
    keys = valid_keys()
    for k in ("optimizer.lr", "schedule.warmup_steps", "sync.backward_passes_per_step", "checkpoint.keep",
              "debug.fail_at_step", "eval.interval_steps", "batch_size", "balance", "straggler_threshold"):
        assert k in keys


def test_examples_are_valid():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "examples"
    for name in ("digits.yaml", "digits_cnn.yaml", "throughput_mlp.yaml"):
        load_config(root / name)


# ---------------------------------------------------------------------------- plan
def test_plan_contiguous_even_split():
    c = cfg(batch_size=16, epochs=3, optimizer={"lr": 0.1}, lr_scaling="linear")
    p = make_plan(c, [500, 400], [300], 3)
    assert p.world_size == 3 and p.global_batch == 48
    assert p.batches_per_epoch == 900 // 48 == p.steps_per_epoch
    assert p.rank_samples == (18 * 16,) * 3
    assert p.total_steps == 3 * 18 and p.lr == pytest.approx(0.3)
    assert "ranks: 3" in p.describe() and "global batch 48" in p.describe()


def test_plan_accumulation_steps_and_sqrt_scaling():
    c = cfg(batch_size=10, steps=7, epochs=100, lr_scaling="sqrt", sync={"backward_passes_per_step": 2})
    p = make_plan(c, [1000], [], 4)
    assert p.global_batch == 80 and p.batches_per_epoch == 25 and p.steps_per_epoch == 12
    assert p.total_steps == 7  # steps wins over epochs when smaller
    assert p.lr == pytest.approx(0.1 * math.sqrt(8))


def test_plan_weighted_shares():
    c = cfg(batch_size=10)
    p = make_plan(c, [1000], [], 2, weights=[3.0, 1.0])
    assert p.rank_batch_sizes == (15, 5) and p.policy == "weighted"
    assert p.rank_samples[0] == 3 * p.rank_samples[1]


def test_plan_too_few_batches_for_accumulation():
    c = cfg(batch_size=100, sync={"backward_passes_per_step": 8})
    with pytest.raises(ConfigError, match="backward_passes_per_step"):
        make_plan(c, [1000], [], 2)


def test_lr_schedule_shapes():
    from hpctrain.train.config import ScheduleConfig

    w = ScheduleConfig(kind="cosine", warmup_steps=4, min_factor=0.1)
    vals = [lr_factor(s, 20, w) for s in range(20)]
    assert vals[:4] == [0.25, 0.5, 0.75, 1.0]
    assert vals[4] == pytest.approx(1.0) and vals[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(vals[4:], vals[5:]))
    st = ScheduleConfig(kind="step", step_size=5, gamma=0.5)
    assert [lr_factor(s, 20, st) for s in (0, 4, 5, 10)] == [1.0, 1.0, 0.5, 0.25]
    assert lr_factor(3, 10, ScheduleConfig()) == 1.0
    assert scale_lr(0.1, 4, "none") == 0.1


def test_schedule_points_and_eval_batch():
    assert schedule_points(10, 0, 4) == [4, 8, 10]
    assert schedule_points(10, 5, 4) == [5, 10]
    assert schedule_points(3, 5, 4) == [3]
    assert eval_batch_size(256, 301, 2) == 150 and eval_batch_size(64, 301, 2) == 64
    assert eval_batch_size(64, 1, 4) == 1


def test_parallel_section_is_validated():
    assert cfg(parallel={"pipeline_stages": 1}).parallel == {"pipeline_stages": 1}
    with pytest.raises(ConfigError, match="unknown key"):
        cfg(parallel={"stages": 2})
    c = load_config(data=dict(BASE), overrides=["parallel.pipeline_stages=2", "parallel.micro_batches=4",
                                                "parallel.schedule=gpipe"])
    assert c.parallel == {"pipeline_stages": 2, "micro_batches": 4, "schedule": "gpipe"}
    with pytest.raises(ConfigError, match="micro_batches must be an integer"):
        cfg(parallel={"pipeline_stages": 2, "micro_batches": 0})
    with pytest.raises(ConfigError, match="schedule"):
        cfg(parallel={"pipeline_stages": 2, "schedule": "zigzag"})


@pytest.mark.parametrize("extra,needle", [
    ({"sync": {"strategy": "model_average"}}, "sync.strategy"),
    ({"sync": {"backend": "gloo"}}, "sync.backend"),
    ({"balance": "auto"}, "balance: auto"),
    ({"batch_size": "auto"}, "batch_size: auto"),
])
def test_pipeline_rejects_options_it_cannot_honour(extra, needle):
    with pytest.raises(ConfigError, match=needle):
        cfg(parallel={"pipeline_stages": 2}, **extra)
    cfg(parallel={"pipeline_stages": 1}, **extra)  # no pipeline: fine


def test_pipeline_world_model_and_batch_checks_are_pure():
    import torch

    from hpctrain.train import pipeline as pp

    pc = pp.parallel_config(cfg(parallel={"pipeline_stages": 2, "micro_batches": 4}))
    with pytest.raises(ConfigError, match="need at least 2 ranks"):
        pp.check_world(pc, 1)
    with pytest.raises(ConfigError, match="not divisible"):
        pp.check_world(pp.parallel_config(cfg(parallel={"pipeline_stages": 2})), 3)
    assert pp.check_world(pc, 4) == 2
    seq = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    pp.check_model(pc, seq, 2, "m:f")
    with pytest.raises(ConfigError, match="nn.Sequential or a list"):
        pp.check_model(pc, torch.nn.Linear(2, 2), 2, "m:f")
    with pytest.raises(ConfigError, match="cannot split a model of 1 layer"):
        pp.check_model(pc, torch.nn.Sequential(torch.nn.Linear(2, 2)), 2, "m:f")
    with pytest.raises(ConfigError, match="split points"):
        pp.check_model(pp.parallel_config(cfg(parallel={"pipeline_stages": 2, "split_points": [7]})), seq, 2, "m:f")
    pp.check_batch(pc, [4, 5])
    with pytest.raises(ConfigError, match="cannot be cut into parallel.micro_batches=4"):
        pp.check_batch(pc, [3, 4])
