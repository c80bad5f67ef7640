"""The README's examples do what it says: the experiment of "Write an experiment" is a
named config with its own line in --list_configs; the tests that need the reference files
are found where it says."""

import os
import re

from axlearn.common import experiment_registry
from tests import reference_spec, test_axlearn_goldens
from tests.fresh_python import REPO


def _readme_block(section: str, language: str) -> str:
    """The first ```language block under the README heading `## section`."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(rf"```{language}\n(.*?)```", body, re.S).group(1)


def test_the_readme_experiment_is_listed_with_its_description(tmp_path, monkeypatch):
    package = tmp_path / "readme_experiments"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mine.py").write_text(_readme_block("Write an experiment", "python"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(experiment_registry, "EXPERIMENTS_PACKAGE", "readme_experiments")
    builder = experiment_registry.named_configs()["gpt_test_wide"][1]
    assert builder().model.decoder.dim == 256
    description = experiment_registry.config_description("mine", "gpt_test_wide", builder)
    assert description == "gpt_test with a model twice as wide."


def test_the_readme_says_where_the_reference_files_of_the_skipped_tests_go():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    # The names and places the tests look for (reference_spec.shared_path).
    assert f"`spec/{reference_spec.NAME}`" in text and "`axlearn_goldens/`" in text
    assert "`../shared/`" in text
    assert f"`{reference_spec.SPEC_ENV}=FILE`" in text
    assert f"`{test_axlearn_goldens.GOLDENS_ENV}=DIR`" in text
