"""Config text resolves names only under trusted packages (config.import_name).

A run directory's `config.txt`, a golden file or an override is data: reading it must not
import a module or reach a function outside the trusted packages. The planted module
below writes a marker file when imported, so a test can tell that it never was.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from axlearn.common import config as config_lib
from axlearn.common.config import (
    UntrustedNameError,
    apply_overrides,
    config_for_function,
    import_name,
    trust_packages,
    trusted_packages,
)
from axlearn.common.golden_text import UnresolvedConfig, parse_flat_text
from tests.fresh_python import REPO, fresh_env

PLANTED = "planted_untrusted_module"  # Not a package any test or library has.


@pytest.fixture(name="planted")
def fixture_planted(tmp_path, monkeypatch):
    """A module on sys.path that creates `marker` when imported; returns the marker path."""
    marker = tmp_path / "imported.marker"
    module_dir = tmp_path / "site"
    module_dir.mkdir()
    (module_dir / f"{PLANTED}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\nclass Thing:\n    pass\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(module_dir))
    monkeypatch.delitem(sys.modules, PLANTED, raising=False)
    yield marker
    sys.modules.pop(PLANTED, None)


@pytest.fixture(name="no_widening", autouse=True)
def fixture_no_widening(monkeypatch):
    """Each test starts from the defaults: no env widening, no trust_packages calls."""
    monkeypatch.delenv(config_lib.TRUSTED_PACKAGES_ENV, raising=False)
    monkeypatch.setattr(config_lib, "_widened_packages", [])


def _system_text(marker) -> str:
    """A trainer config whose model, once instantiated, would run `touch marker`."""
    return (
        "klass: 'axlearn.common.trainer.SpmdTrainer'\n"
        "model.command: " + repr(f"touch {marker}") + "\n"
        "model.fn: 'os.system'\n"
    )


def test_defaults_are_the_library_experiments_jax_numpy_and_optax():
    assert trusted_packages() == ("axlearn", "experiments", "jax", "numpy", "optax")


def test_a_fn_outside_the_trusted_packages_is_refused_naming_key_and_name(tmp_path):
    marker = tmp_path / "ran.marker"
    with pytest.raises(UntrustedNameError) as e:
        parse_flat_text(_system_text(marker), source="config.txt")
    message = str(e.value)
    assert message.startswith("config.txt:3: model.fn: 'os.system' is not under a trusted")
    assert "\n" not in message and not marker.exists()


def test_an_unknown_module_is_refused_before_it_is_imported(planted):
    text = f"klass: '{PLANTED}.Thing'\n"
    with pytest.raises(UntrustedNameError, match=rf"t.txt:1: klass: '{PLANTED}.Thing' is not"):
        parse_flat_text(text, source="t.txt")
    assert not planted.exists() and PLANTED not in sys.modules


def test_foreign_text_keeps_an_untrusted_name_as_text_without_importing_it(planted):
    text = f"child.klass: '{PLANTED}.Thing'\nklass: 'axlearn.common.layers.Linear'"
    cfg = parse_flat_text(text, source="a.txt", foreign=True)
    assert isinstance(cfg.child, UnresolvedConfig) and cfg.debug_string() == text
    with pytest.raises(config_lib.ConfigError, match=r"a.txt:1: child.klass: .* not under a trust"):
        cfg.child.instantiate()
    assert not planted.exists()


def test_a_trusted_prefix_reaching_an_untrusted_object_is_refused():
    # `axlearn.common.config` imports os: the name starts trusted but ends at os.system.
    with pytest.raises(UntrustedNameError, match=r"'axlearn.common.config.os.system' \(defined"):
        import_name("axlearn.common.config.os.system")
    with pytest.raises(UntrustedNameError, match=r"'axlearn.common.config.os' \(defined in os\)"):
        import_name("axlearn.common.config.os")
    with pytest.raises(config_lib.ConfigError, match="dunder"):
        import_name("axlearn.common.config.__builtins__")


def test_a_name_sharing_only_a_prefix_string_with_a_trusted_package_is_refused():
    with pytest.raises(UntrustedNameError, match="'numpyx.thing'"):
        import_name("numpyx.thing")


def test_trusted_names_resolve_to_the_same_objects_as_python_imports():
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel

    assert import_name("jax.numpy.bfloat16") is jnp.bfloat16
    assert import_name("optax.adamw") is optax.adamw
    assert import_name("numpy.tanh") is np.tanh


def test_an_override_naming_an_untrusted_function_is_refused():
    cfg = config_for_function(_apply)
    with pytest.raises(UntrustedNameError, match=r"^activation: 'os.system' is not under"):
        apply_overrides(cfg, ["activation=os.system"])
    assert cfg.activation is np.tanh


def _apply(x: float = 0.0, activation=np.tanh):
    return activation(x)


def test_the_environment_variable_widens_trust_so_the_planted_module_resolves(
    planted, monkeypatch
):
    monkeypatch.setenv(config_lib.TRUSTED_PACKAGES_ENV, f"other, {PLANTED}")
    cfg = parse_flat_text(f"klass: '{PLANTED}.Thing'\n")
    assert planted.exists() and cfg.klass is sys.modules[PLANTED].Thing


def test_trust_packages_widens_trust_for_this_process(planted):
    trust_packages(f"{PLANTED},")
    assert trusted_packages()[-1] == PLANTED
    assert import_name(f"{PLANTED}.Thing") is sys.modules[PLANTED].Thing and planted.exists()


def test_trust_packages_refuses_what_is_not_a_package_name():
    with pytest.raises(config_lib.ConfigError, match="'os; rm' is not a dotted Python name"):
        trust_packages(["os; rm"])


# ----- the commands that read a run directory's config.txt -----


def _run_command(
    args: list[str], cwd, extra_path: str = "", trusted: str = ""
) -> subprocess.CompletedProcess:
    """Runs `python -m *args` as a user would: the suite's own trust of `tests` removed,
    `extra_path` importable, and `trusted` as the environment's trusted packages."""
    env = fresh_env()
    env[config_lib.TRUSTED_PACKAGES_ENV] = trusted
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([extra_path, env["PYTHONPATH"]])
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _assert_refused(result: subprocess.CompletedProcess, key: str, name: str) -> None:
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "config.txt:" in last and f"{key}: '{name}' is not under a trusted package" in last


@pytest.mark.slow
def test_generate_refuses_a_config_txt_that_names_os_system(tmp_path):
    marker = tmp_path / "ran.marker"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.txt").write_text(_system_text(marker), encoding="utf-8")
    args = ["axlearn.common.generate", f"--trainer_dir={run_dir}", "--prompt=hi"]
    _assert_refused(_run_command(args, cwd=REPO), "model.fn", "os.system")
    assert not marker.exists()


@pytest.mark.slow
def test_hf_llama_export_refuses_a_config_txt_that_names_an_unknown_module(planted, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    text = f"klass: 'axlearn.common.trainer.SpmdTrainer'\nmodel.klass: '{PLANTED}.Thing'\n"
    (run_dir / "config.txt").write_text(text, encoding="utf-8")
    args = [
        "axlearn.common.hf_llama",
        "export",
        f"--trainer_dir={run_dir}",
        f"--output={tmp_path / 'hf'}",
    ]
    # The planted module is importable in that process; it is refused by name all the same.
    result = _run_command(args, cwd=tmp_path, extra_path=str(planted.parent / "site"))
    _assert_refused(result, "model.klass", f"{PLANTED}.Thing")
    assert not planted.exists() and not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_generate_imports_the_planted_module_once_the_environment_trusts_it(planted, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    text = f"klass: 'axlearn.common.trainer.SpmdTrainer'\nmodel.klass: '{PLANTED}.Thing'\n"
    (run_dir / "config.txt").write_text(text, encoding="utf-8")
    args = ["axlearn.common.generate", f"--trainer_dir={run_dir}", "--prompt=hi"]
    result = _run_command(
        args, cwd=REPO, extra_path=str(planted.parent / "site"), trusted=PLANTED
    )
    # The config reads; the run then fails for want of a checkpoint (or a real model).
    assert planted.exists() and "trusted package" not in result.stderr, result.stderr
