"""``hpctrain slurm``: render and submit sbatch scripts from the shipped templates.

  hpctrain slurm list                                  templates, their options and defaults
  hpctrain slurm render TEMPLATE [OPTIONS] -- COMMAND…  print the script
  hpctrain slurm submit TEMPLATE [OPTIONS] -- COMMAND…  write it into the job directory, sbatch it,
                                                       print the job id
  hpctrain slurm env                                   this process's view of its SLURM job
  hpctrain slurm status [JOB] | logs JOB [-f] | cancel JOB   a submitted job's state, output, end

Every value is shell-quoted in the script: a job name such as 'x; touch /tmp/owned' stays a
name. The command after `--` is quoted word by word (use `-- bash -c '…'` for shell syntax).
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple

EXAMPLES = """examples:
  hpctrain slurm list
  hpctrain slurm render cpu-mpi --nodes 2 --tasks-per-node 4 --time 02:00:00 \\
      --partition batch --account proj42 -- hpctrain train examples/digits.yaml
  hpctrain slurm render gpu-multi-node --nodes 4 --gpus-per-node 8 --cpus-per-task 12 \\
      --module cuda/12.4 --venv ~/venvs/hpc -- hpctrain train config.yaml
  hpctrain slurm submit cpu-mpi --launcher mpirun --job-dir runs/try1 -- hpctrain selfcheck
  hpctrain slurm render data-shard-array --array 0-15 -- hpctrain data shard raw/part{task}.h5 --num-shards 8 --out shards/part{task}
"""


class UsageError(ValueError):
    """A bad command line for render/submit; the message lists the valid options."""


class _OptionParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse would print usage and exit(2)
        valid = " ".join(sorted(_long_options(self)))
        raise UsageError(f"{message}\nvalid options: {valid}\nHINT: hpctrain slurm {self.prog.split()[-1]} --help")


def _long_options(parser: argparse.ArgumentParser) -> List[str]:
    """The documented --options (hidden aliases left out)."""
    return [s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings if s.startswith("--")]


def _export(text: str) -> Tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def option_parser(action: str) -> argparse.ArgumentParser:
    """The TEMPLATE options shared by render and submit (defaults None: template's own)."""
    p = _OptionParser(
        prog=f"hpctrain slurm {action}",
        usage=f"hpctrain slurm {action} TEMPLATE [OPTIONS] -- COMMAND…",
        description="TEMPLATE is a template name (see `hpctrain slurm list`) or the path of a template "
                    "file. Options left out take the template's defaults.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("resources")
    g.add_argument("--nodes", type=int, help="number of nodes")
    g.add_argument("--tasks-per-node", "--ntasks-per-node", dest="tasks_per_node", type=int,
                   help="MPI ranks per node (GPU templates: one per GPU)")
    g.add_argument("--gpus-per-node", type=int, help="GPUs per node (GPU templates)")
    g.add_argument("--cpus-per-task", type=int, help="CPU cores per rank (sets OMP_NUM_THREADS)")
    g.add_argument("--mem", help="memory per node, e.g. 64G")
    g.add_argument("--constraint", help="node features, e.g. a100")
    g.add_argument("--array", help="job array indices (data-shard-array), e.g. 0-15 or 0-99%%10")
    g = p.add_argument_group("scheduling")
    g.add_argument("--time", help="time limit, e.g. 02:00:00 or 1-00:00:00")
    g.add_argument("--partition", help="partition (queue)")
    g.add_argument("--account", help="account to charge")
    g.add_argument("--qos", help="quality of service")
    g.add_argument("--job-name", help="job name")
    g.add_argument("--signal-seconds", type=int,
                   help="send SIGUSR1 this many seconds before the time limit (checkpoint + requeue)")
    g.add_argument("--sbatch-arg", dest="sbatch_args", action="append",
                   help="extra #SBATCH option, e.g. --sbatch-arg=--exclusive (repeatable)")
    g = p.add_argument_group("files")
    g.add_argument("--output", help="stdout file (%%j = job id, %%x = job name)")
    g.add_argument("--error", help="stderr file")
    g.add_argument("--chdir", help="working directory of the job (submit: default the current folder)")
    g = p.add_argument_group("environment and launch")
    g.add_argument("--module", dest="modules", action="append", help="module to load (repeatable)")
    g.add_argument("--venv", default="auto",
                   help="virtual environment to activate: a path, 'auto' (the one running this; default) or 'none'")
    g.add_argument("--env-setup", help="a shell file to source before the run (site set-up, conda …)")
    g.add_argument("--export", dest="exports", action="append", type=_export, metavar="NAME=VALUE",
                   help="environment variable for the run (repeatable)")
    g.add_argument("--launcher", choices=("srun", "mpirun", "none"),
                   help="srun --mpi=pmix (default), Open MPI's mpirun, or none (one process)")
    g.add_argument("--elastic-min-ranks", type=int, metavar="M",
                   help="elastic job: ranks that die do not end it, down to M survivors (needs --launcher "
                        "mpirun; runs `hpctrain launch --elastic`; docs/elastic.md)")
    if action == "render":
        p.add_argument("-o", "--out", help="write the script to this file instead of stdout")
    if action == "submit":
        p.add_argument("--job-dir", help="where the script and the job's logs go (default runs/<job name>)")
        # The old name, easily mistaken for the training config's run_dir.
        p.add_argument("--run-dir", dest="legacy_run_dir", help=argparse.SUPPRESS)
        p.add_argument("--dry-run", action="store_true", help="write the script, do not call sbatch")
    return p


def split_command(words: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Options before the first `--`, the command after it."""
    words = list(words)
    if "--" in words:
        i = words.index("--")
        return words[:i], words[i + 1:]
    return words, []


def build_spec(template: str, options: argparse.Namespace, command: Sequence[str], overrides: Optional[Dict[str, Any]] = None):
    from hpctrain.slurm.render import current_venv, make_spec

    values = {k: v for k, v in vars(options).items() if k not in ("out", "job_dir", "legacy_run_dir", "dry_run")}
    venv = values.pop("venv")
    values["venv"] = current_venv() if venv == "auto" else (None if venv in ("none", "") else str(Path(venv).expanduser()))
    values.update(overrides or {})
    return make_spec(template, command, **values)


def _parse(action: str, argv: Sequence[str]) -> Tuple[argparse.Namespace, List[str]]:
    parser = option_parser(action)
    parser.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    opts, command = split_command(argv)
    # argparse drops a `--` that directly follows TEMPLATE, so without one the command
    # starts at the first word that is not an option or an option's value.
    ns, extra = parser.parse_known_args(opts)
    stray = [w for w in extra if w.startswith("-")]
    if stray:
        close = difflib.get_close_matches(stray[0].split("=")[0], _long_options(parser), n=1)
        parser.error(f"unknown option(s): {' '.join(stray)}" + (f" (did you mean {close[0]}?)" if close else ""))
    if extra:
        parser.error(f"unexpected {' '.join(extra)!r}; put the command after `--`")
    command = list(ns.command) + command
    del ns.command
    if not command:
        parser.error("no command; put it after `--`, e.g. -- python train.py")
    return ns, command


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "job"


def cmd_list(args: argparse.Namespace) -> int:
    from hpctrain.slurm.render import TEMPLATES, JobSpec, option_name

    base = JobSpec(command=("x",))
    for info in TEMPLATES.values():
        print(f"{info.name}\n    {info.summary}")
        opts = []
        for name in info.options:
            default = info.fixed.get(name, info.defaults.get(name, getattr(base, name)))
            shown = "" if default in (None, ()) else f"={default}"
            opts.append(f"{option_name(name)}{shown}")
        print("    options: " + " ".join(opts))
        print(f"    file: {info.file()}")
    print("\nrender one: hpctrain slurm render TEMPLATE [OPTIONS] -- COMMAND…")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from hpctrain.slurm.render import render

    ns, command = _parse("render", args.args)
    text = render(args.template, build_spec(args.template, ns, command))
    if ns.out:
        Path(ns.out).write_text(text)
        print(f"hpctrain slurm: wrote {ns.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _job_dir_option(ns: argparse.Namespace) -> Optional[str]:
    """--job-dir, or the deprecated --run-dir with a warning."""
    if ns.legacy_run_dir is None:
        return ns.job_dir
    if ns.job_dir is not None and ns.job_dir != ns.legacy_run_dir:
        raise UsageError(f"--job-dir {ns.job_dir!r} and --run-dir {ns.legacy_run_dir!r} disagree; "
                         "HINT: give only --job-dir (--run-dir is its old name)")
    print("hpctrain slurm submit: warning: --run-dir is deprecated, use --job-dir (the folder of the "
          "script and the job's logs, not the training config's run_dir)", file=sys.stderr)
    return ns.legacy_run_dir


def cmd_submit(args: argparse.Namespace) -> int:
    from hpctrain.slurm.render import TEMPLATES, render
    from hpctrain.slurm.submit import sbatch

    ns, command = _parse("submit", args.args)
    spec = build_spec(args.template, ns, command)
    job_dir = Path(_job_dir_option(ns) or Path("runs") / _safe_name(spec.job_name)).expanduser().resolve()
    info = TEMPLATES.get(args.template)
    pattern = "%A_%a" if info and info.array_placeholders else "%j"
    overrides = {}
    if ns.output is None:
        overrides["output"] = str(job_dir / f"slurm-{pattern}.out")
    if ns.error is None:
        overrides["error"] = str(job_dir / f"slurm-{pattern}.err")
    if ns.chdir is None:
        # the folder submitted from, written into the script: a config's relative run_dir and
        # the command's relative paths mean the same when the script is resubmitted from elsewhere
        overrides["chdir"] = os.getcwd()
    spec = build_spec(args.template, ns, command, overrides)
    job_dir.mkdir(parents=True, exist_ok=True)
    script = job_dir / f"{_safe_name(spec.job_name)}.sbatch"
    script.write_text(render(args.template, spec))
    if ns.dry_run:
        print(f"hpctrain slurm: wrote {script} (dry run, not submitted)", file=sys.stderr)
        print(script)
        return 0
    job_id = sbatch(script)
    print(f"hpctrain slurm: submitted job {job_id}: script {script}, log {spec.output}", file=sys.stderr)
    print(job_id)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from hpctrain.slurm.env import from_environ

    env = from_environ()
    if env is None:
        print("not inside a SLURM job (no SLURM_JOB_ID)", file=sys.stderr)
        return 1
    print(json.dumps(asdict(env), indent=2))
    return 0


class _OptionsHelp(argparse.Action):
    """-h/--help of render and submit: option_parser's help, then exit."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[override]
        option_parser(parser.prog.split()[-1]).print_help()
        parser.exit()


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser(
        "slurm", help=help_text, description=__doc__, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ssub = p.add_subparsers(dest="slurm_command", metavar="COMMAND")
    q = ssub.add_parser("list", help="list the templates, their options and defaults")
    q.set_defaults(slurm_func=cmd_list)
    for name, func, what in (("render", cmd_render, "print the sbatch script"),
                             ("submit", cmd_submit, "write the script into the job directory and sbatch it")):
        # The options are parsed by option_parser (after TEMPLATE, up to `--`), so its help is
        # the help of this command: argparse's own would only show TEMPLATE and ARGS.
        q = ssub.add_parser(name, help=what, add_help=False, usage=f"hpctrain slurm {name} TEMPLATE [OPTIONS] -- COMMAND…")
        q.add_argument("-h", "--help", action=_OptionsHelp, help=argparse.SUPPRESS)
        q.add_argument("template", help="template name (hpctrain slurm list) or path to a template file")
        q.add_argument("args", nargs=argparse.REMAINDER, help="options, then -- COMMAND…")
        q.set_defaults(slurm_func=func)
    q = ssub.add_parser("env", help="show this process's SLURM view (rank, size, nodes, master address)")
    q.set_defaults(slurm_func=cmd_env)
    # Day-2 verbs (status, cancel, logs) live in their own module.
    from hpctrain.cli import slurm_jobs

    slurm_jobs.register(ssub)
    p.set_defaults(func=run, no_mpi=True, slurm_parser=p)


def run(args: argparse.Namespace) -> int:
    from hpctrain.slurm.submit import SubmitError

    func = getattr(args, "slurm_func", None)
    if func is None:
        args.slurm_parser.print_help()
        return 2
    if getattr(args, "template", None) in ("-h", "--help") or "-h" in getattr(args, "args", [])[:1] or \
            "--help" in split_command(getattr(args, "args", []))[0]:
        option_parser(args.slurm_command).print_help()
        return 0
    try:
        return func(args)
    except (ValueError, SubmitError) as exc:
        print(f"hpctrain slurm {args.slurm_command}: {exc}", file=sys.stderr)
        return 2
