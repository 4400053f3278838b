"""hpctrain.serialization: what hpctrain writes loads with weights_only=True, and what does not
load that way is refused with one line, without running anything."""
import dataclasses
import enum
import os
import pickle
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.serialization import NotPlainFile, load_plain, to_plain


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Colour(enum.IntEnum):
    RED = 3


@dataclasses.dataclass
class Point:
    x: int
    y: object


def test_to_plain_converts_numpy_dataclasses_and_subclasses(tmp_path):
    obj = OrderedDict(a=np.float64(0.5), b=np.arange(3, dtype=np.int32), c=[Colour.RED, (np.int64(4), None)],
                      d=Point(1, np.ones(2)), e=torch.ones(2), f=b"raw", g=torch.float16)
    plain = to_plain(obj)
    assert isinstance(plain, OrderedDict) and list(plain) == list(obj)
    assert type(plain["a"]) is float and torch.equal(plain["b"], torch.arange(3, dtype=torch.int32))
    assert plain["c"] == [3, (4, None)] and type(plain["c"][0]) is int
    assert plain["d"]["x"] == 1 and torch.equal(plain["d"]["y"], torch.ones(2, dtype=torch.float64))
    torch.save(plain, tmp_path / "x.pt")
    back = load_plain(tmp_path / "x.pt")
    assert back["c"] == [3, (4, None)] and back["f"] == b"raw" and back["g"] is torch.float16


def test_to_plain_names_what_cannot_be_stored():
    with pytest.raises(TypeError, match=r"state\['opt'\]\[1\] is a builtins.object"):
        to_plain({"opt": [1, object()]})


@pytest.mark.parametrize("mmap", [False, True])
def test_load_plain_refuses_pickled_objects_in_one_line_and_runs_nothing(tmp_path, mmap):
    marker = tmp_path / "payload-ran"
    for name, write in (("zip.pt", lambda p: torch.save({"x": Payload(marker)}, p)),
                        ("raw.pt", lambda p: p.write_bytes(pickle.dumps({"x": Payload(marker)}))),
                        ("legacy.pt", lambda p: torch.save({"x": Payload(marker)}, p,
                                                           _use_new_zipfile_serialization=False))):
        path = tmp_path / name
        write(path)
        with pytest.raises(NotPlainFile) as info:
            load_plain(path, mmap=mmap)
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith(f"{path}: not a valid hpctrain checkpoint: "), msg
    assert not marker.exists()


@pytest.mark.parametrize("mmap", [False, True])
def test_load_plain_truncated_garbage_and_unreadable(tmp_path, mmap):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(1000)}, good)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:500])
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    for path in (cut, junk, tmp_path):
        with pytest.raises(NotPlainFile) as info:
            load_plain(path, mmap=mmap)
        assert "\n" not in str(info.value) and str(info.value).startswith(f"{path}: "), str(info.value)
    assert "truncated or corrupt" in str(pytest.raises(NotPlainFile, load_plain, cut, mmap=mmap).value)
    with pytest.raises(FileNotFoundError):
        load_plain(tmp_path / "missing.pt", mmap=mmap)
    assert torch.equal(load_plain(good, mmap=mmap)["w"], torch.ones(1000))
