"""The pure bucket planner: reverse order, thresholds, dtypes, groups, determinism."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.torch.buckets import (DEFAULT_FUSION_THRESHOLD, ParamSpec, describe_spec_mismatch,
                                    fusion_threshold_from_env, parse_bytes, plan_buckets, specs_digest,
                                    split_into_groups)


def specs_of(sizes, dtype="torch.float32"):
    return [ParamSpec(f"p{i}", (n,), dtype) for i, n in enumerate(sizes)]


def test_reverse_registration_order_and_threshold():
    plan = plan_buckets(specs_of([10, 10, 10, 10]), threshold=80)  # 2 params of 40 bytes per bucket
    assert [[s.index for s in b.slots] for b in plan.buckets] == [[3, 2], [1, 0]]
    assert [s.offset for s in plan.buckets[0].slots] == [0, 10]
    assert plan.locate(1) == (1, 0)


def test_zero_threshold_is_one_bucket_per_parameter():
    plan = plan_buckets(specs_of([3, 4, 5]), threshold=0)
    assert [[s.index for s in b.slots] for b in plan.buckets] == [[2], [1], [0]]


def test_parameter_larger_than_threshold_gets_own_bucket():
    plan = plan_buckets(specs_of([1, 1000, 1]), threshold=16)
    assert [[s.index for s in b.slots] for b in plan.buckets] == [[2], [1], [0]]


def test_one_dtype_per_bucket():
    specs = [ParamSpec("a", (4,), "torch.float32"), ParamSpec("b", (4,), "torch.float16"),
             ParamSpec("c", (4,), "torch.float32")]
    plan = plan_buckets(specs, threshold=1 << 20)
    assert sorted((b.dtype, tuple(s.index for s in b.slots)) for b in plan.buckets) == [
        ("torch.float16", (1,)), ("torch.float32", (2, 0))]
    # the float16 bucket is complete (ready) before the float32 one, whose last member is "a"
    assert plan.buckets[0].dtype == "torch.float16"


def test_groups_are_buckets_regardless_of_size():
    plan = plan_buckets(specs_of([100, 100, 100, 100]), threshold=1, groups=[[0, 3]])
    layout = [[s.index for s in b.slots] for b in plan.buckets]
    assert [3, 0] in layout and [2] in layout and [1] in layout


def test_bad_input():
    with pytest.raises(ValueError, match="unique"):
        plan_buckets([ParamSpec("a", (1,), "torch.float32")] * 2, threshold=0)
    with pytest.raises(ValueError, match="threshold"):
        plan_buckets(specs_of([1]), threshold=-1)
    with pytest.raises(ValueError, match="more than one group"):
        plan_buckets(specs_of([1, 1]), threshold=0, groups=[[0], [0, 1]])
    with pytest.raises(ValueError, match="outside"):
        plan_buckets(specs_of([1, 1]), threshold=0, groups=[[5]])
    with pytest.raises(ValueError, match="dtype"):
        ParamSpec("x", (1,), "torch.float8")


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=0, max_size=40),
       dtypes=st.lists(st.sampled_from(["torch.float32", "torch.float16", "torch.float64"]), min_size=40, max_size=40),
       threshold=st.integers(0, 40000))
def test_plan_properties(sizes, dtypes, threshold):
    specs = [ParamSpec(f"p{i}", (n,), dtypes[i]) for i, n in enumerate(sizes)]
    plan = plan_buckets(specs, threshold)
    # every parameter exactly once (BucketPlan validates), contiguous offsets, one dtype per bucket
    seen = sorted(s.index for b in plan.buckets for s in b.slots)
    assert seen == list(range(len(sizes)))
    for b in plan.buckets:
        assert all(specs[s.index].dtype == b.dtype for s in b.slots)
        # within a bucket: reverse registration order
        idx = [s.index for s in b.slots]
        assert idx == sorted(idx, reverse=True)
        # a bucket of more than one parameter respects the threshold
        if len(b.slots) > 1:
            assert b.nbytes <= threshold
    # deterministic: the same input gives the same plan (what makes all ranks agree)
    assert plan_buckets(specs, threshold) == plan


def test_fusion_threshold_env():
    assert fusion_threshold_from_env({}) == DEFAULT_FUSION_THRESHOLD
    assert fusion_threshold_from_env({"HPCTRAIN_FUSION_THRESHOLD": "1048576"}) == 1 << 20
    assert fusion_threshold_from_env({"HPCTRAIN_FUSION_THRESHOLD": "64MiB"}) == 64 << 20
    assert fusion_threshold_from_env({"HPCTRAIN_FUSION_THRESHOLD": "0"}) == 0
    with pytest.raises(ValueError, match="HINT"):
        fusion_threshold_from_env({"HPCTRAIN_FUSION_THRESHOLD": "lots"})
    assert parse_bytes("2 MB") == 2 << 20  # every unit a power of 1024


def test_split_into_groups():
    assert [list(r) for r in split_into_groups(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in split_into_groups(2, 4)] == [[0], [1]]
    with pytest.raises(ValueError):
        split_into_groups(3, 0)


def test_mismatch_description():
    a = specs_of([3, 4])
    b = [ParamSpec("p0", (3,), "torch.float32"), ParamSpec("p1", (5,), "torch.float32")]
    assert describe_spec_mismatch([a, a]) is None
    msg = describe_spec_mismatch([a, a, b])
    assert "parameter #1" in msg and "rank 2" in msg and "(5,)" in msg
    assert "rank 1 has 1" in describe_spec_mismatch([a, a[:1]])
    assert specs_digest(a) != specs_digest(b) and specs_digest(a) == specs_digest(specs_of([3, 4]))
