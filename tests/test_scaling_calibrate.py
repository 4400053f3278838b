"""``hpctrain bench calibrate`` at 2 ranks on a tiny config writes a profile; ``hpctrain plan``
on it predicts the 1-node step within a generous factor of the step calibrate measured (the
machine is shared and noisy: the factor checks the model is in the right range, not tight)."""
import json

import numpy as np
import pytest

from mpirun import python_argv, run_mpi

pytestmark = pytest.mark.mpi


def test_calibrate_then_plan_predicts_the_measured_step(tmp_path):
    from hpctrain.data.pack import pack

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "train.npz", x=rng.random((256, 64), dtype=np.float32), y=rng.integers(0, 10, 256))
    pack([str(tmp_path / "train.npz")], str(tmp_path / "train.h5"), quiet=True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
model: {{factory: "hpctrain.train.models:mlp", kwargs: {{hidden: [512, 512]}}}}
data: {{train: ["{tmp_path / 'train.h5'}"]}}
optimizer: {{name: sgd, lr: 0.01}}
batch_size: 32
steps: 10
threads: 1
sync: {{fusion_threshold: 262144}}
""")
    prof = tmp_path / "profile.json"
    res = run_mpi(2, python_argv("-m", "hpctrain.cli.main", "bench", "calibrate", str(cfg), "--out", str(prof),
                                 "--steps", "8", "--warmup", "2", "--fabric", "eth10"), timeout=300)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "wrote" in res.stdout
    data = json.loads(prof.read_text())
    assert data["measured"]["ranks"] == 2 and data["measured"]["ranks_per_node"] == 2
    assert data["fusion_threshold"] == 262144 and data["links"]["inter"]["bandwidth_Bps"] > 0
    params = data["parameters"]
    assert sum(np.prod(p["shape"]) for p in params) == 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    # the last layer's gradients are ready first in backward, all within it
    assert params[-1]["ready_s"] <= params[0]["ready_s"]
    assert all(0 <= p["ready_s"] <= data["compute"]["backward_s"] * 1.5 + 1e-3 for p in params)

    out = tmp_path / "plan.json"
    from hpctrain.cli.main import main

    assert main(["plan", "--profile", str(prof), "--nodes", "1,2,8", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["ranks_per_node"] == 2
    one_node = next(p for p in plan["points"] if p["nodes"] == 1 and p["algorithm"] == "hierarchical"
                    and p["fusion_threshold"] == 262144)
    measured = data["measured"]["step_s"]
    # A factor of 6: on a 2-core machine running the rest of the suite, the links calibrate
    # measures and the step it times can be slowed by different amounts (4.0x apart seen).
    assert measured / 6 < one_node["step_s"] < measured * 6, (  # what the prediction was built from
        one_node, measured, data["links"], data["compute"], res.stdout[-800:])
    # (no ordering across node counts: the intra-node link measured on a loaded 2-core machine
    # can come out slower than the named fabric)
    assert all(0 < r["best"]["efficiency"] <= 1 for r in plan["summary"])
