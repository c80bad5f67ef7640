"""The one-line descriptions `--list_configs` prints: an experiment module's `DESCRIPTIONS`,
else the builder's docstring."""

import re

import pytest

from axlearn.common import experiment_registry
from axlearn.common.config import ConfigError


def _experiments_package(tmp_path, monkeypatch, source: str) -> None:
    """Makes `source` the only experiment module ('mine') of a new package on sys.path."""
    name = "experiments_" + re.sub(r"\W", "_", tmp_path.name)  # Each test imports its own.
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mine.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(experiment_registry, "EXPERIMENTS_PACKAGE", name)


def test_a_module_s_descriptions_win_over_docstrings(tmp_path, monkeypatch):
    _experiments_package(tmp_path, monkeypatch, (
        "def tiny():\n"
        "    '''The docstring. More.'''\n\n"
        "def named_trainer_configs():\n"
        "    return {'tiny': tiny, 'plain': tiny}\n\n"
        "DESCRIPTIONS = {'tiny': 'Its own line.'}\n"
    ))
    builder = experiment_registry.named_configs()["tiny"][1]
    assert experiment_registry.config_description("mine", "tiny", builder) == "Its own line."
    assert experiment_registry.config_description("mine", "plain", builder) == "The docstring."


def test_a_partial_without_a_description_shows_its_function_and_bound_arguments(
    tmp_path, monkeypatch
):
    _experiments_package(tmp_path, monkeypatch, (
        "import functools\n\n"
        "def sized(size):\n"
        "    '''A model of some size.'''\n\n"
        "def named_trainer_configs():\n"
        "    return {'big': functools.partial(sized, '1B')}\n"
    ))
    builder = experiment_registry.named_configs()["big"][1]
    assert experiment_registry.config_description("mine", "big", builder) == (
        "A model of some size. [sized('1B')]"
    )


def test_a_description_of_a_config_the_module_does_not_define_is_an_error(tmp_path, monkeypatch):
    _experiments_package(tmp_path, monkeypatch, (
        "def tiny():\n"
        "    '''Tiny.'''\n\n"
        "def named_trainer_configs():\n"
        "    return {'tiny': tiny}\n\n"
        "DESCRIPTIONS = {'tiny': 'Tiny.', 'tiny_old': 'Renamed since.'}\n"
    ))
    message = r"\.mine\.DESCRIPTIONS describes tiny_old, which its named_trainer_configs\(\)"
    with pytest.raises(ConfigError, match=message):
        experiment_registry.config_description("mine", "tiny", experiment_registry.named_configs()["tiny"][1])
