"""The commands' shared absl flag handling (command_flags): each call parses afresh,
--help prints the description and the flags and exits 0, a wrong flag exits 2 in one line."""

import sys

import pytest
from absl import flags

from axlearn import bench
from axlearn.common import golden_config, hf_llama
from axlearn.common.command_flags import parse_command_flags


def _define(flag_values: flags.FlagValues) -> None:
    flags.DEFINE_multi_string("side", None, "A side.", flag_values=flag_values)
    flags.DEFINE_integer("steps", 20, "Timed steps.", flag_values=flag_values)


def test_each_call_parses_into_fresh_flags():
    first, _ = parse_command_flags(_define, ["--side=a", "--steps=3"], program="p", doc=None)
    second, _ = parse_command_flags(_define, [], program="p", doc=None)
    assert (first.side, first.steps) == (["a"], 3)
    assert (second.side, second.steps) == (None, 20)


def test_positional_arguments_are_returned_where_allowed_and_refused_elsewhere(capsys):
    _, rest = parse_command_flags(_define, ["export", "--steps=2"], program="p", doc=None,
                                  positional=("export",))
    assert rest == ["export"]
    with pytest.raises(SystemExit) as e:
        parse_command_flags(_define, ["import"], program="p", doc=None, positional=("export",))
    assert e.value.code == 2
    assert capsys.readouterr().err == "p: error: unexpected arguments: import\n"


@pytest.mark.parametrize("argv", [["--steps=many"], ["--no_such_flag=1"]])
def test_a_wrong_flag_is_one_line_and_exit_status_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_command_flags(_define, argv, program="p", doc=None)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("p: error: ") and err.count("\n") == 1


def test_several_missing_required_flags_are_one_line(capsys):
    def define(flag_values: flags.FlagValues) -> None:
        for name in ("profile_dir", "steps"):
            flags.DEFINE_string(name, None, "Required.", flag_values=flag_values)
            flags.mark_flag_as_required(name, flag_values=flag_values)

    with pytest.raises(SystemExit) as e:
        parse_command_flags(define, [], program="p", doc=None)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--profile_dir" in err and "--steps" in err


@pytest.mark.parametrize(
    "main, flag",
    [(bench.main, "--compare_data_dirs"), (golden_config.main, "--summarize_diff"),
     (hf_llama.main, "--max_shard_size")],
    ids=["bench", "golden_config", "hf_llama"],
)
def test_help_prints_the_description_and_every_flag_and_exits_0(main, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(sys.modules[main.__module__].__doc__.strip().splitlines()[0])
    assert f"  {flag}:" in out or f"  --[no]{flag[2:]}:" in out
