"""hpctrain.slurm.render and `hpctrain slurm render/list/submit --dry-run`: golden files of
the rendered templates, hostile values that must stay data (checked with `bash -n` and by
running the scripts with stand-ins for srun/mpirun), and the validation messages."""
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from hpctrain import __version__
from hpctrain.cli.main import main
from hpctrain.slurm.render import (ARRAY_PLACEHOLDERS, TEMPLATES, JobSpec, make_spec, parse_time_limit,
                                   quote_command, render, template_files)

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"


# ----------------------------------------------------------------------------- templates
def test_templates_are_read_from_the_slurm_folder_as_package_data():
    """One copy: slurm/ is installed as the package hpctrain.templates, and the renderer reads
    that package (here, an editable install, it is slurm/ itself)."""
    files = template_files()
    assert Path(str(files)).resolve() == (ROOT / "slurm").resolve()
    shipped = {p.name for p in (ROOT / "slurm").glob("*.sbatch")}
    assert {p.name for p in files.iterdir() if p.name.endswith(".sbatch")} == shipped
    assert {f"{n}.sbatch" for n in TEMPLATES} <= shipped
    assert not (ROOT / "hpctrain" / "templates").exists(), "a second copy of the templates"


def test_custom_template_may_include_the_shipped_parts(tmp_path):
    custom = tmp_path / "mine.sbatch"
    custom.write_text('#!/bin/bash\n{% include "_header.sbatch" %}\necho custom\n')
    text = render(str(custom), make_spec(str(custom), ["true"], nodes=1, tasks_per_node=1))
    assert "#SBATCH --job-name=hpctrain" in text and text.endswith("echo custom\n")


GOLDEN_SPECS = {
    "gpu-single-node": dict(gpus_per_node=8, cpus_per_task=12, time="1-00:00:00", partition="gpu",
                            account="proj42", qos="high", job_name="llm-pretrain", mem="480G",
                            modules=["cuda/12.4", "nccl/2.21"], venv="/scratch/u/venvs/hpc",
                            exports={"NCCL_SOCKET_IFNAME": "ib0"}, signal_seconds=300),
    "gpu-multi-node": dict(nodes=4, gpus_per_node=4, cpus_per_task=16, time="12:00:00", partition="gpu",
                           account="proj42", job_name="resnet 4x4", modules=["cuda/12.4"],
                           env_setup="/etc/site/ml-env.sh", venv="/scratch/u/venvs/hpc",
                           exports={"NCCL_IB_HCA": "mlx5_0,mlx5_1"}, constraint="a100",
                           output="logs/%x-%j.out", error="logs/%x-%j.err",
                           sbatch_args=["--exclusive", "--mail-type=END"]),
    "cpu-mpi": dict(nodes=2, tasks_per_node=4, cpus_per_task=2, launcher="mpirun", time="30",
                    partition="batch", venv="/opt/venv", job_name="cpu"),
    "data-shard-array": dict(array="0-15%4", cpus_per_task=4, venv="/opt/venv", job_name="shard"),
}
GOLDEN_COMMANDS = {
    "data-shard-array": ["hpctrain", "data", "shard", "raw/part{task}.h5", "--num-shards", "8",
                         "--out", "shards/part{task}", "--keys", "x,y"],
}


def golden_text(name: str) -> str:
    spec = make_spec(name, GOLDEN_COMMANDS.get(name, ["hpctrain", "train", "configs/run.yaml"]),
                     **GOLDEN_SPECS[name])
    return render(name, spec).replace(f"hpctrain {__version__},", "hpctrain VERSION,")


@pytest.mark.parametrize("name", sorted(GOLDEN_SPECS))
def test_golden(name):
    path = GOLDEN / f"{name}.sbatch"
    text = golden_text(name)
    if os.environ.get("HPCTRAIN_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"missing {path}; create it with HPCTRAIN_UPDATE_GOLDEN=1"
    assert text == path.read_text(), (
        f"rendered {name} differs from {path}; if the change is intended, review the diff and "
        "rerun with HPCTRAIN_UPDATE_GOLDEN=1"
    )


def test_golden_gpu_contents():
    """What the GPU templates promise, independent of the exact golden text."""
    multi = golden_text("gpu-multi-node")
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-task=1",
                 "#SBATCH --cpus-per-task=16", "#SBATCH --gpu-bind=closest", "#SBATCH --signal=B:USR1@120",
                 "#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --job-name='resnet 4x4'",
                 "#SBATCH --exclusive", "export NCCL_IB_HCA=mlx5_0,mlx5_1", "module load cuda/12.4",
                 "source /etc/site/ml-env.sh", "launch=(srun --mpi=pmix --kill-on-bad-exit=1)"):
        assert line + "\n" in multi, line
    single = golden_text("gpu-single-node")
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --account=proj42", "#SBATCH --qos=high", "#SBATCH --signal=B:USR1@300"):
        assert line + "\n" in single, line


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("launcher", ["srun", "mpirun", "none"])
def test_every_template_is_valid_bash(name, launcher):
    script = render(name, make_spec(name, ["python", "train.py"], launcher=launcher))
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    first_command = next(i for i, line in enumerate(script.splitlines()) if line and not line.startswith("#"))
    # sbatch stops reading #SBATCH lines at the first command: all must come before it.
    assert all(script.splitlines().index(d) < first_command for d in directives)


# ----------------------------------------------------------------------------- injection
def hostile(marker: Path) -> list:
    m = shlex.quote(str(marker))
    return [
        f"x; touch {m}",
        f"$(touch {m})",
        f"`touch {m}`",
        f"'; touch {m}; '",
        f"\"; touch {m}; \"",
        f"a\\'b$(touch {m})",
        f"${{IFS}}touch${{IFS}}{m}",
        f"{{task}}$(touch {m})",
        "--",
        "",
        "*",
        "~root",
    ]


def fake_launchers(bindir: Path, record: Path) -> None:
    """srun/mpirun stand-ins: record their arguments and the exported variables, run nothing."""
    bindir.mkdir()
    for name in ("srun", "mpirun"):
        exe = bindir / name
        exe.write_text(
            "#!/bin/bash\n"
            f"printf '%s\\0' {name} \"$@\" > {shlex.quote(str(record))}\n"
            f"printf '%s\\0' \"$EVIL\" \"$SOURCED\" > {shlex.quote(str(record))}.env\n"
        )
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    # `scontrol show hostnames` (the multi-node templates' MASTER_ADDR) where no SLURM is installed
    scontrol = bindir / "scontrol"
    scontrol.write_text("#!/bin/bash\nprintf '%s\\n' n1\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_hostile_values_never_execute(tmp_path, name, launcher):
    marker = tmp_path / "owned"
    values = hostile(marker)
    # A set-up file whose very name is hostile; sourcing it proves it was read, not executed.
    setup_file = tmp_path / "setup $(touch owned) `touch owned`.sh"  # cwd is tmp_path
    setup_file.write_text("export SOURCED=yes\n")
    evil = values[1]
    options = dict(job_name=values[0], partition=values[2], account=values[3], qos=values[4],
                   output=str(tmp_path / values[5]), error=str(tmp_path / "err $(x)"),
                   mem=values[6], constraint=values[0], env_setup=str(setup_file),
                   exports={"EVIL": evil}, modules=[], launcher=launcher)
    if name == "data-shard-array":
        options["array"] = "0-3"
    command = ["python", *values]
    script = render(name, make_spec(name, command, **options))
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)

    record = tmp_path / "argv"
    fake_launchers(tmp_path / "bin", record)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_NTASKS": "2",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1",
           "SLURM_ARRAY_TASK_ID": "3"}
    done = subprocess.run(["bash", "-c", script, "job.sbatch"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not marker.exists(), f"a hostile value was executed:\n{script}"
    argv = record.read_text().split("\0")[:-1]
    got_command = argv[argv.index("python"):]
    expected = [v.replace("{task}", "3") if name == "data-shard-array" else v for v in command]
    assert got_command == expected
    assert record.with_name("argv.env").read_text().split("\0")[:-1] == [evil, "yes"]


def test_hostile_job_name_stays_in_its_directive(tmp_path):
    script = render("cpu-mpi", make_spec("cpu-mpi", ["true"], job_name="x; touch /tmp/owned"))
    assert "#SBATCH --job-name='x; touch /tmp/owned'\n" in script
    script = render("cpu-mpi", make_spec("cpu-mpi", ["true"], job_name="it's"))
    assert "#SBATCH --job-name='it'\"'\"'s'\n" in script


@pytest.mark.parametrize("field", ["job_name", "partition", "account", "qos", "output", "error",
                                   "mem", "constraint", "chdir", "venv", "env_setup", "time"])
@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\x00b", "a\x1bb"])
def test_control_characters_rejected(field, bad):
    with pytest.raises(ValueError, match="control character"):
        make_spec("cpu-mpi", ["true"], **{field: bad})


@pytest.mark.parametrize("options", [dict(exports={"A": "1\n#SBATCH --x"}), dict(modules=["m\nrm -rf /"]),
                                     dict(sbatch_args=["--comment=a\nb"])])
def test_control_characters_rejected_in_lists(options):
    with pytest.raises(ValueError, match="control character"):
        make_spec("cpu-mpi", ["true"], **options)


def test_command_with_newline_is_quoted_not_rejected():
    script = render("cpu-mpi", make_spec("cpu-mpi", ["python", "-c", "import sys\nprint(1)"]))
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "cmd=(python -c 'import sys\nprint(1)')" in script


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "text,seconds",
    [("90", 5400), ("10:30", 630), ("02:00:00", 7200), ("1-0", 86400), ("1-02", 93600),
     ("1-02:03", 93780), ("1-02:03:04", 93784), ("UNLIMITED", None), ("infinite", None)],
)
def test_time_limits(text, seconds):
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(time="2h"), "not a SLURM time limit"),
        (dict(time="5", signal_seconds=300), "not shorter than the time limit"),
        (dict(signal_seconds=70000), "between 0 and 65535"),
        (dict(nodes=0), "--nodes must be at least 1"),
        (dict(tasks_per_node=0), "--tasks-per-node must be at least 1"),
        (dict(launcher="aprun"), "expected one of srun, mpirun, none"),
        (dict(exports={"1BAD": "x"}), "not a shell variable name"),
        (dict(exports={"A;B": "x"}), "not a shell variable name"),
        (dict(sbatch_args=["-N 2"]), "long sbatch option"),
        (dict(partition=" "), "--partition is empty"),
        (dict(array="0-3"), "does not apply to template 'cpu-mpi'"),
        (dict(gpus_per_node=2), "valid|does not apply"),
    ],
)
def test_validation_messages(options, message):
    with pytest.raises(ValueError, match=message):
        make_spec("cpu-mpi", ["true"], **options)


def test_gpu_templates_one_rank_per_gpu_and_array_specs():
    spec = make_spec("gpu-multi-node", ["x"], nodes=3, gpus_per_node=8)
    assert spec.tasks_per_node == 8 and spec.ntasks == 24
    with pytest.raises(ValueError, match="needs --gpus-per-node of at least 1"):
        make_spec("gpu-single-node", ["x"], gpus_per_node=0)
    for ok in ("0-15", "1,3,5", "0-31:2", "0-99%10", "7"):
        make_spec("data-shard-array", ["x"], array=ok)
    for bad in ("0-", "a", "1-3;x", "0-3%"):
        with pytest.raises(ValueError, match="not a SLURM array spec"):
            make_spec("data-shard-array", ["x"], array=bad)


def test_empty_command_is_refused():
    with pytest.raises(ValueError, match="no command to run"):
        JobSpec(command=())


def test_array_placeholders_expand_at_run_time():
    cmd = quote_command(["echo", "out{task}.h5", "{task}/{task_count}", "x'y"], ARRAY_PLACEHOLDERS)
    out = subprocess.run(["bash", "-c", f"echo_() {{ :; }}; {cmd}"], capture_output=True, text=True,
                         env={"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "16", "PATH": "/usr/bin:/bin"})
    assert out.stdout == "out5.h5 5/16 x'y\n"


def test_custom_template_file(tmp_path):
    custom = tmp_path / "mine.sbatch"
    custom.write_text("#!/bin/bash\n#SBATCH --job-name={{ job_name }}\n{% include '_launch.sbatch' %}")
    script = render(str(custom), make_spec(str(custom), ["echo", "hi"], job_name="a b"))
    assert "#SBATCH --job-name='a b'" in script and "cmd=(echo hi)" in script
    with pytest.raises(ValueError, match="unknown template 'nope'.*cpu-mpi"):
        render("nope", make_spec("cpu-mpi", ["x"]))


# ----------------------------------------------------------------------------- CLI
def test_cli_render(capsys):
    assert main(["slurm", "render", "cpu-mpi", "--nodes", "2", "--tasks-per-node", "3", "--time", "10",
                 "--job-name", "x; touch /tmp/owned", "--venv", "none", "--export", "A=$(id)",
                 "--", "python", "-m", "hpctrain.cli.main", "selfcheck"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=3\n" in out
    assert "#SBATCH --job-name='x; touch /tmp/owned'\n" in out and "export A='$(id)'\n" in out
    assert "cmd=(python -m hpctrain.cli.main selfcheck)" in out and "activate" not in out


def test_cli_unknown_option_lists_valid_ones(capsys):
    assert main(["slurm", "render", "cpu-mpi", "--nodse", "2", "--", "x"]) == 2
    err = capsys.readouterr().err
    assert "unknown option(s): --nodse" in err and "--nodes" in err and "--tasks-per-node" in err
    assert main(["slurm", "render", "gpu-single-node", "--nodes", "2", "--", "x"]) == 2
    err = capsys.readouterr().err
    assert "does not apply to template 'gpu-single-node'" in err and "--gpus-per-node" in err
    assert main(["slurm", "render", "cpu-mpi"]) == 2
    assert "no command" in capsys.readouterr().err


def test_cli_list_and_help(capsys):
    assert main(["slurm", "list"]) == 0
    out = capsys.readouterr().out
    for name in TEMPLATES:
        assert name in out
    assert "--gpus-per-node=4" in out and "--array=0-3" in out
    assert main(["slurm", "render", "cpu-mpi", "--help"]) == 0
    assert "--tasks-per-node" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["render", "--help"], ["render", "-h"], ["render", "cpu-mpi", "--help"],
                                  ["submit", "--help"], ["submit", "cpu-mpi", "--nodes", "2", "-h"]])
def test_cli_render_and_submit_help_is_one_help(capsys, argv):
    """One usage line and one options section: the options parser's help, not argparse's
    help of the sub-command with the options parser's help pasted into its description."""
    try:
        assert main(["slurm", *argv]) == 0
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    assert out.count("usage:") == 1 and out.count("\noptions:") == 1, out
    assert "--tasks-per-node" in out and "TEMPLATE" in out
    assert ("--job-dir JOB_DIR" in out) == (argv[0] == "submit") and "--run-dir" not in out


def test_cli_submit_dry_run(tmp_path, capsys):
    job_dir = tmp_path / "run 1"
    assert main(["slurm", "submit", "data-shard-array", "--job-dir", str(job_dir), "--dry-run",
                 "--job-name", "a/b c", "--", "echo", "{task}"]) == 0
    script = job_dir / "a_b_c.sbatch"
    assert capsys.readouterr().out.strip() == str(script)
    text = script.read_text()
    assert f"#SBATCH --output={shlex.quote(str(job_dir / 'slurm-%A_%a.out'))}\n" in text
    assert 'cmd=(echo "${SLURM_ARRAY_TASK_ID}")' in text


def test_cli_submit_runs_the_job_in_the_folder_submitted_from(tmp_path, monkeypatch, capsys):
    here = tmp_path / "project dir"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["slurm", "submit", "cpu-mpi", "--job-dir", "jobs", "--dry-run", "--", "true"]) == 0
    text = (here / "jobs" / "hpctrain.sbatch").read_text()
    assert f"#SBATCH --chdir={shlex.quote(str(here))}\n" in text
    assert main(["slurm", "submit", "cpu-mpi", "--job-dir", "jobs2", "--chdir", "/scratch/x", "--dry-run",
                 "--", "true"]) == 0
    assert "#SBATCH --chdir=/scratch/x\n" in (here / "jobs2" / "hpctrain.sbatch").read_text()


def test_cli_submit_run_dir_is_a_deprecated_alias_of_job_dir(tmp_path, capsys):
    job_dir = tmp_path / "jobs"
    assert main(["slurm", "submit", "cpu-mpi", "--run-dir", str(job_dir), "--dry-run", "--", "true"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(job_dir / "hpctrain.sbatch")
    assert "--run-dir is deprecated, use --job-dir" in captured.err
    assert main(["slurm", "submit", "cpu-mpi", "--run-dir", "a", "--job-dir", "b", "--dry-run", "--", "true"]) == 2
    assert "disagree" in capsys.readouterr().err


def test_cli_env(monkeypatch, capsys):
    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_COMM_WORLD"))]:
        monkeypatch.delenv(key)
    assert main(["slurm", "env"]) == 1
    assert "not inside a SLURM job" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "cn[3-4]")
    assert main(["slurm", "env"]) == 0
    out = capsys.readouterr().out
    assert '"master_addr": "cn3"' in out and '"launcher": "batch"' in out
