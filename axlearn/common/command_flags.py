"""absl flags for the project's commands that are also called in-process (tests, other
tools): each call parses into a fresh `flags.FlagValues`, `--help` prints the command's
description and flags and exits 0, and a wrong flag is one line on stderr and exit 2.

    def define_flags(flag_values: flags.FlagValues) -> None:
        flags.DEFINE_integer("steps", 20, "Timed steps.", flag_values=flag_values)

    def main(argv: Optional[Sequence[str]] = None) -> int:
        flag_values, _ = parse_command_flags(define_flags, argv, program="axlearn.bench", doc=__doc__)
"""

import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, Optional

from absl import flags

from axlearn.common.config import trust_packages

HELP_ARGS = ("-h", "--help", "--helpshort", "--helpfull")
TRUSTED_PACKAGES_HELP = (
    "Packages (comma-separated) whose classes and functions config text may name, besides "
    "axlearn, experiments, jax, numpy and optax; $AXLEARN_TRUSTED_PACKAGES adds more."
)


def define_trusted_packages(flag_values: flags.FlagValues) -> None:
    """`--trusted_packages`, for commands that read config text (a run's config.txt)."""
    flags.DEFINE_list("trusted_packages", [], TRUSTED_PACKAGES_HELP, flag_values=flag_values)


def usage_error(program: str, message: str) -> NoReturn:
    """Stops the command with `program: error: message` on stderr and exit status 2."""
    print(f"{program}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_command_flags(
    define_flags: Callable[[flags.FlagValues], None],
    argv: Optional[Sequence[str]],
    *,
    program: str,
    doc: Optional[str],
    positional: Sequence[str] = (),
    free_positional: bool = False,
    reads_config_text: bool = False,
) -> tuple[flags.FlagValues, list[str]]:
    """Defines the command's flags on a fresh FlagValues and parses `argv` (the arguments
    after the program name; None: sys.argv[1:]) into it.

    Returns (the flags, the positional arguments). A positional argument that is not in
    `positional` is a usage error (unless `free_positional`: any follow, e.g. input
    files), as is a flag absl refuses (unknown, ill-typed, a required one missing). Any of
    HELP_ARGS prints `doc` and the flags and exits 0. A command that `reads_config_text`
    also takes `--trusted_packages`, applied (`config.trust_packages`) before it returns.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    flag_values = flags.FlagValues()
    define_flags(flag_values)
    if reads_config_text:
        define_trusted_packages(flag_values)
    if any(arg in HELP_ARGS for arg in argv):
        print((doc or "").strip())
        # A script (tools/x.py) runs as `python tools/x.py`, a module as `python -m module`.
        runner = "python" if program.endswith(".py") else "python -m"
        print(f"\nflags of {runner} {program}:")
        # absl heads each defining module's flags with its file name: left out.
        help_text = flag_values.get_help(include_special_flags=False)
        print("\n".join(line for line in help_text.splitlines() if line.startswith(" ")))
        raise SystemExit(0)
    try:
        rest = flag_values([program, *argv])[1:]
    except flags.Error as e:
        # absl puts each of several failed validators (required flags) on a line of its own.
        usage_error(program, "; ".join(str(e).splitlines()))
    unexpected = [] if free_positional else [arg for arg in rest if arg not in positional]
    if unexpected:
        usage_error(program, f"unexpected arguments: {' '.join(unexpected)}")
    if reads_config_text:
        trust_packages(flag_values.trusted_packages)
    return flag_values, rest
