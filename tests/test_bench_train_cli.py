"""``hpctrain bench train`` runs end to end under mpiexec and prints its table."""
import json

from mpirun import python_argv, run_mpi


def test_bench_train_two_ranks(tmp_path):
    out = tmp_path / "train.json"
    result = run_mpi(2, python_argv("-m", "hpctrain.cli.main", "bench", "train", "--models", "cnn", "--batch", "8",
                                    "--steps", "2", "--warmup", "1",
                                    "--competitors", "plain,hpctrain,hpctrain-sync,ddp-gloo",
                                    "--json", str(out)), timeout=300)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "hpctrain/DDP-Gloo step ratio" in result.stdout and "hpctrain/plain step ratio" in result.stdout
    records = json.loads(out.read_text())
    assert {r["competitor"] for r in records} == {"plain", "hpctrain", "hpctrain-sync", "ddp-gloo"}
    hp = next(r for r in records if r["competitor"] == "hpctrain")
    assert hp["ranks"] == 2 and hp["step_s"] > 0 and hp["comm_s"] > 0 and "wait_s" in hp


def test_print_table_ratios():
    from io import StringIO

    from hpctrain.bench.train import print_table

    buf = StringIO()
    print_table([{"model": "mlp", "competitor": "hpctrain", "step_s": 0.08, "samples_per_s": 1600, "compute_s": 0.07,
                  "wait_s": 0.01, "comm_s": 0.03},
                 {"model": "mlp", "competitor": "ddp-gloo", "step_s": 0.1, "samples_per_s": 1280}], 2, out=buf)
    text = buf.getvalue()
    assert "hpctrain/DDP-Gloo step ratio 0.800" in text and "80.0" in text
