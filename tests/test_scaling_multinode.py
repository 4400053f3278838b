"""``hpctrain bench calibrate`` across two nodes of the local cluster (tests/cluster/)
measures the inter-node link by ping-pong, and ``hpctrain plan`` runs on that profile
without a named fabric. A smoke test of the path: the veth link's numbers are not a network's."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cluster import multinode_cluster, python_argv, run_mpi_on_cluster  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]


def test_calibrate_on_two_nodes_measures_the_network(multinode_cluster, tmp_path):
    from hpctrain.cli.main import main
    from hpctrain.data.pack import pack

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "train.npz", x=rng.random((128, 32), dtype=np.float32), y=rng.integers(0, 4, 128))
    pack([str(tmp_path / "train.npz")], str(tmp_path / "train.h5"), quiet=True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
model: {{factory: "hpctrain.train.models:mlp", kwargs: {{hidden: [64]}}}}
data: {{train: ["{tmp_path / 'train.h5'}"]}}
optimizer: {{name: sgd, lr: 0.01}}
batch_size: 16
steps: 4
threads: 1
""")
    prof = tmp_path / "profile.json"
    argv = [str(Path(python_argv()[0]).parent / "hpctrain"), "bench", "calibrate", str(cfg), "--out", str(prof),
            "--steps", "4", "--warmup", "1"]
    proc = run_mpi_on_cluster("node1,node2", argv, timeout=240)
    assert proc.returncode == 0, proc.stdout[-6000:]
    data = json.loads(prof.read_text())
    assert data["measured"]["nodes"] == 2 and data["measured"]["inter_measured"] is True
    inter = data["links"]["inter"]
    assert inter["alpha_s"] > 0 and inter["bandwidth_Bps"] > 1e6
    assert main(["plan", "--profile", str(prof), "--nodes", "1,2,16", "--ranks-per-node", "1",
                 "--json", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [r["nodes"] for r in plan["summary"]] == [1, 2, 16]
