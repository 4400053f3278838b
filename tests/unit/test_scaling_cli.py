"""``hpctrain plan``: table, JSON and plot from a profile; one-line errors. Pure: no mpiexec."""
import json

import pytest

from hpctrain.cli.main import main
from hpctrain.scaling.published import HOROVOD_512


def test_plan_json_has_a_point_per_node_count_algorithm_and_threshold(tmp_path, capsys):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(HOROVOD_512["resnet101"]))
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(prof), "--nodes", "1,4,2", "--ranks-per-node", "4",
                 "--thresholds", "4MiB", "--algorithms", "ring,hierarchical", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "samples/s" in table and "effic." in table
    data = json.loads(out.read_text())
    assert [r["nodes"] for r in data["summary"]] == [1, 2, 4]
    assert len(data["points"]) == 3 * 2 * 2  # nodes × algorithms × (4 MiB and the profile's 64 MiB)
    assert data["summary"][0]["best"]["efficiency"] <= 1.0


def test_plan_fabric_override_and_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", "--profile", "published:vgg16", "--nodes", "1,8", "--ranks-per-node", "4",
                 "--fabric", "ib-ndr", "--thresholds", "64MiB", "--plot", str(png), "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out.split("\nwrote ")[0])
    slow = json.loads(json.dumps(data))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plan", "--profile", "published:vgg16", "--nodes", "1,8", "--ranks-per-node", "4",
                 "--fabric", "eth10", "--thresholds", "64MiB", "--json", "-"]) == 0
    eth = json.loads(capsys.readouterr().out)
    assert slow["summary"][1]["best"]["efficiency"] > eth["summary"][1]["best"]["efficiency"]


@pytest.mark.parametrize("argv, match", [
    (["--profile", "published:alexnet"], "no such published profile"),
    (["--profile", "published:vgg16", "--nodes", "1,two"], "comma list of integers"),
    (["--profile", "published:vgg16", "--fabric", "token-ring"], "unknown fabric"),
    (["--profile", "/nonexistent/p.json"], "hpctrain bench calibrate"),
])
def test_plan_errors_are_one_line(argv, match, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1
