"""The pure agreement verdict behind collective argument checks: same list, same verdict."""
import torch

from hpctrain.torch.agreement import describe, verdict


def test_matching_calls_proceed():
    a = describe("broadcast", [torch.ones(2, 3)], root=1)
    assert verdict("broadcast", [(a, None), (a, None), (a, None)], me=1) is None


def test_allgather_ignores_dim0_but_not_the_rest():
    calls = [(describe("allgather", [torch.ones(r + 1, 2)]), None) for r in range(3)]
    assert verdict("allgather", calls, me=0) is None
    calls[2] = (describe("allgather", [torch.ones(1, 3)]), None)
    kind, msg = verdict("allgather", calls, me=0)
    assert kind == "internal" and "Mismatched allgather" in msg and "set rank 2" in msg


def test_dtype_root_and_shape_mismatches_are_internal_on_every_rank():
    base = describe("broadcast", [torch.ones(2)], root=0)
    for other in (describe("broadcast", [torch.ones(2, dtype=torch.float64)], root=0),
                  describe("broadcast", [torch.ones(2)], root=1),
                  describe("broadcast", [torch.ones(3)], root=0)):
        calls = [(base, None), (other, None)]
        assert [verdict("broadcast", calls, me=r)[0] for r in (0, 1)] == ["internal", "internal"]


def test_a_local_error_is_local_there_and_internal_elsewhere():
    d = describe("reducescatter", [torch.ones(2)], op=0)
    calls = [(d, None), (d, "ValueError: reducescatter does not support scalar inputs")]
    assert verdict("reducescatter", calls, me=1) == ("local", "ValueError: reducescatter does not support scalar inputs")
    kind, msg = verdict("reducescatter", calls, me=0)
    assert kind == "internal" and "rank 1" in msg and "scalar" in msg
