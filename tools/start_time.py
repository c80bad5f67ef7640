"""How long a start takes to its first trained step, cold and with the compilation cache warm.

    PYTHONPATH=. python tools/start_time.py [--config=gpt_1b] [--data_dir=FAKE] \
        [--workdir=/tmp/start_time] [--config_override=PATH=VALUE ...]

Runs the launcher (`axlearn.common.launch_trainer_main`) three times with the same flags
and a compilation cache of its own (`--workdir`/cache, emptied first):
1. cold: a new run (`--workdir`/run), with the cache empty;
2. warm, restart: the same run again, resuming from the step the first start saved;
3. warm, new run: another trainer directory (`--workdir`/new_run), the same config.
Each start's whole output is kept in `--workdir`/logs (cold.log, restart.log, new_run.log).
Each start is timed from its launch to its first progress line (the first trained step,
its loss read back), then stopped with SIGTERM (it saves that step and exits 75; its grace
period is long enough for a slow host). Printed:
the three times, each warm one as a share of the cold, and each start's compile line for
the train step (whether it came from the cache; the restart loads it whole from the run
directory, `executable_store`) and the trainer's own account of where its
start went ("Started in ...": process to trainer, state, trackers and first batch, train
step ready, first step; `perf.StartTimes`). Every start trains with `--max_step` steps
planned, so that all three compile the same program. `--config_override=compile_ahead=False`
times the starts that compile the train step at the first step instead of ahead.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Optional

from absl import flags

from axlearn.common.command_flags import parse_command_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The trainer's progress line of a step ("step   1/1000 | loss ..."): that step has trained.
_PROGRESS = re.compile(r"\] step +\d+/\d+ \|")
# Its compile (from the cache or not), or its load as an earlier start stored it.
_COMPILED = re.compile(r"(Compiled the train step in|Loaded the train step as) .*")
_STARTED = re.compile(r"Started in .*")


def define_flags(flag_values: flags.FlagValues) -> None:
    """The tool's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string("config", "gpt_1b", "The named config to start.", **fv)
    flags.DEFINE_string("data_dir", "FAKE", "The launcher's --data_dir.", **fv)
    flags.DEFINE_string(
        "workdir", None, "Holds the cache and both runs (emptied first); default: a new "
        "temporary directory, removed after.", **fv
    )
    flags.DEFINE_integer("max_step", 1000, "The runs' max_step (they stop long before).", **fv)
    flags.DEFINE_multi_string(
        "config_override", [], "Passed to every start (repeatable).", **fv
    )
    flags.DEFINE_multi_string(
        "launcher_flag", [], "Another launcher flag for every start, e.g. "
        "--launcher_flag=--jax_config=jax_persistent_cache_min_compile_time_secs=0.", **fv
    )
    flags.DEFINE_integer("timeout_s", 1800, "Seconds a start may take to its first step.", **fv)


def time_start(
    command: Sequence[str], timeout_s: float, log_path: str
) -> tuple[float, Optional[str], Optional[str]]:
    """Seconds from launching `command` to its first progress line, its compile line for
    the train step and its start's account; the start is then stopped (SIGTERM) and waited
    for. Its output goes to `log_path`."""
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    start = time.monotonic()
    process = subprocess.Popen(
        list(command), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, bufsize=1,
    )
    seconds, compiled, started, tail = None, None, None, []
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            for line in process.stdout:
                log.write(line)
                tail = (tail + [line.rstrip()])[-30:]
                found = _COMPILED.search(line)
                if found:
                    compiled = found.group(0)
                found = _STARTED.search(line)
                if found:
                    started = found.group(0)
                if _PROGRESS.search(line):
                    seconds = time.monotonic() - start
                    break
                if time.monotonic() - start > timeout_s:
                    break
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            for line in process.stdout:  # Until it has saved and exited.
                log.write(line)
                tail = (tail + [line.rstrip()])[-30:]
            process.wait()
    if seconds is None:
        sys.stderr.write("\n".join(tail) + "\n")
        raise SystemExit(f"start_time: {' '.join(command[2:4])}... reached no trained step")
    return seconds, compiled, started


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line `argv` (None: sys.argv's) run."""
    args, _ = parse_command_flags(
        define_flags, argv, program="tools/start_time.py",
        doc=f"usage: start_time.py [flags]\n\n{__doc__}",
    )
    workdir = args.workdir or tempfile.mkdtemp(prefix="start_time-")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    cache = os.path.join(workdir, "cache")
    os.makedirs(os.path.join(workdir, "logs"))

    def command(trainer_dir: str) -> list[str]:
        return [
            sys.executable, "-m", "axlearn.common.launch_trainer_main",
            f"--config={args.config}", f"--data_dir={args.data_dir}",
            f"--trainer_dir={trainer_dir}", f"--jax_compilation_cache_dir={cache}",
            f"--config_override=max_step={args.max_step}",
            "--config_override=log_every_n_steps=1",
            # Time enough to save the step on a slow host, so that the restart restores.
            "--config_override=preemption_grace_period_s=900",
            *(f"--config_override={o}" for o in args.config_override),
            *args.launcher_flag,
        ]

    starts = (
        ("cold (empty cache)", "run", "cold"),
        ("warm: restart of the run", "run", "restart"),
        ("warm: new run, same config", "new_run", "new_run"),
    )
    rows = []
    try:
        for name, trainer_dir, log in starts:
            log_path = os.path.join(workdir, "logs", f"{log}.log")
            command_line = command(os.path.join(workdir, trainer_dir))
            rows.append((name, *time_start(command_line, args.timeout_s, log_path)))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    cold = rows[0][1]
    print(f"{args.config}: seconds from launch to the first trained step")
    for name, seconds, compiled, started in rows:
        share = "" if seconds is cold else f"{100 * seconds / cold:.0f}% of cold"
        print(f"{name:<28} {seconds:8.1f} s  {share:<12}  {compiled or '(no compile line)'}")
        print(f"{'':<28} {started or '(no start line)'}")


if __name__ == "__main__":
    main()
