"""Config text names only what the library declared configurable (config.import_name).

A run directory's `config.txt`, a golden file or an override is data: reading it must not
import a module outside the trusted packages, nor reach a function that was not
registered (`register_configurable`, or a `Configurable` subclass), however trusted its
package. Each attack below would run a command, unpickle, delete, write a file or open a
port if it were called; a test checks that it is refused while parsing and that its
marker never appears.
"""

import os
import pickle
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
    is_registered,
    register_configurable,
    trust_packages,
    trusted_packages,
)
from axlearn.common.golden_text import UnresolvedConfig, parse_flat_text
from tests.fresh_python import REPO, fresh_env

PLANTED = "planted_untrusted_module"  # Not a package any test or library has.


@pytest.fixture(name="planted")
def fixture_planted(tmp_path, monkeypatch):
    """A package on sys.path that creates `marker` when imported; its `Thing` is
    registered, its `Other` is not, and importing its private `_impl` creates
    `impl.marker`. Returns the marker path."""
    marker = tmp_path / "imported.marker"
    package = tmp_path / "site" / PLANTED
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from axlearn.common.config import register_configurable\n\n"
        "@register_configurable\nclass Thing:\n    pass\n\n"
        "class Other:\n    pass\n",
        encoding="utf-8",
    )
    impl_marker = tmp_path / "impl.marker"
    (package / "_impl.py").write_text(
        f"open({str(impl_marker)!r}, 'w').close()\n\ndef thing():\n    pass\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(package.parent))
    for name in (PLANTED, f"{PLANTED}._impl"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield marker
    for name in (PLANTED, f"{PLANTED}._impl"):
        sys.modules.pop(name, None)


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


def _runstring_lines(marker, prefix: str = "model.param_init") -> list[str]:
    """The issue's example: numpy's private `runstring` executing a shell command."""
    code = f"__import__('os').system('touch {marker}')"
    return [
        f"{prefix}.astr: {code!r}",
        f"{prefix}.dict: {{}}",
        f"{prefix}.fn: 'numpy.testing._private.utils.runstring'",
    ]


class _Touch:
    """Unpickling it runs `touch path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _pickled_array(tmp_path, marker) -> str:
    path = tmp_path / "evil.npy"
    np.save(path, np.array([_Touch(marker)], dtype=object), allow_pickle=True)
    return str(path)


def _attacks(tmp_path, marker) -> dict[str, list[str]]:
    """Name -> the lines of a function config (under `cfg.`) that would leave `marker`
    (or remove `victim`) if it were built and called."""
    victim = tmp_path / "victim"
    pickled = _pickled_array(tmp_path, marker)
    return {
        "numpy's private runstring runs code": _runstring_lines(marker, "cfg"),
        "numpy.load unpickles": [
            "cfg.allow_pickle: True", f"cfg.file: {pickled!r}", "cfg.fn: 'numpy.load'"
        ],
        "jax.numpy.load unpickles": [
            "cfg.allow_pickle: True", f"cfg.file: {pickled!r}", "cfg.fn: 'jax.numpy.load'"
        ],
        "numpy.lib.format.read_array unpickles": [
            "cfg.allow_pickle: True", f"cfg.fp: {pickled!r}", "cfg.fn: 'numpy.lib.format.read_array'"
        ],
        "numpy.ctypeslib.load_library loads a library": [
            "cfg.fn: 'numpy.ctypeslib.load_library'", "cfg.libname: 'libc'", "cfg.loader_path: '/'"
        ],
        "numpy.savetxt writes a file": [
            "cfg.X: [1]", f"cfg.fname: {str(marker)!r}", "cfg.fn: 'numpy.savetxt'"
        ],
        "jax.profiler.start_server opens a port": [
            "cfg.fn: 'jax.profiler.start_server'", "cfg.port: 0"
        ],
        "a private jax module": ["cfg.fn: 'jax._src.util.safe_map'"],
        "file_system.rmtree deletes, unregistered under axlearn": [
            "cfg.fn: 'axlearn.common.file_system.rmtree'", f"cfg.path: {str(victim)!r}"
        ],
        "file_system.write_text writes, unregistered under axlearn": [
            "cfg.fn: 'axlearn.common.file_system.write_text'",
            f"cfg.path: {str(marker)!r}",
            "cfg.text: 'x'",
        ],
        "a trusted module's os reaches os.system": [
            f"cfg.command: 'touch {marker}'", "cfg.fn: 'axlearn.common.config.os.system'"
        ],
        "a trusted module's numpy reaches numpy.load": [
            "cfg.allow_pickle: True",
            f"cfg.file: {pickled!r}",
            "cfg.fn: 'axlearn.common.input_token_format.np.load'",
        ],
        "a trusted module's ctypes loader": [
            "cfg.fn: 'numpy.ctypeslib.ctypes.CDLL'", "cfg.name: 'libc.so.6'"
        ],
        "outside every trusted package": [f"cfg.args: 'touch {marker}'", "cfg.fn: 'subprocess.run'"],
    }


ATTACKS = [
    "numpy's private runstring runs code",
    "numpy.load unpickles",
    "jax.numpy.load unpickles",
    "numpy.lib.format.read_array unpickles",
    "numpy.ctypeslib.load_library loads a library",
    "numpy.savetxt writes a file",
    "jax.profiler.start_server opens a port",
    "a private jax module",
    "file_system.rmtree deletes, unregistered under axlearn",
    "file_system.write_text writes, unregistered under axlearn",
    "a trusted module's os reaches os.system",
    "a trusted module's numpy reaches numpy.load",
    "a trusted module's ctypes loader",
    "outside every trusted package",
]


def test_the_attack_list_is_the_attack_table(tmp_path):
    assert list(_attacks(tmp_path, tmp_path / "m")) == ATTACKS


@pytest.mark.parametrize("attack", ATTACKS)
def test_each_attack_is_refused_while_parsing_and_leaves_no_trace(attack, tmp_path):
    marker = tmp_path / "ran.marker"
    victim = tmp_path / "victim"
    victim.mkdir()
    lines = _attacks(tmp_path, marker)[attack]
    text = "\n".join(lines)
    with pytest.raises(UntrustedNameError) as e:
        parse_flat_text(text, source="config.txt").instantiate()
    message = str(e.value)
    assert message.startswith("config.txt:") and "\n" not in message, message
    assert not marker.exists() and victim.is_dir()


def test_the_pickled_array_of_the_attacks_does_run_when_loaded(tmp_path):
    """The unpickling attacks are real: numpy.load with pickles allowed runs the command."""
    marker = tmp_path / "ran.marker"
    np.load(_pickled_array(tmp_path, marker), allow_pickle=True)
    assert marker.exists()


def test_an_override_naming_an_unregistered_function_is_refused(tmp_path):
    cfg = config_for_function(_apply)
    with pytest.raises(UntrustedNameError, match=r"^activation: 'numpy.load' is not one of"):
        apply_overrides(cfg, ["activation=numpy.load"])
    with pytest.raises(UntrustedNameError, match=r"^activation: 'os.system' is not under"):
        apply_overrides(cfg, ["activation=os.system"])
    assert cfg.activation is np.tanh


@register_configurable
def _apply(x: float = 0.0, activation=np.tanh):
    return activation(x)


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


def test_foreign_text_keeps_an_unregistered_name_as_text_without_importing_it(planted):
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


def test_the_library_names_resolve_to_the_same_objects_as_python_imports():
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel

    from axlearn.common import layers, schedule  # pylint: disable=import-outside-toplevel

    assert import_name("jax.numpy.bfloat16") is jnp.bfloat16
    assert import_name("optax.adamw") is optax.adamw
    assert import_name("numpy.tanh") is np.tanh
    assert import_name("jax.nn.gelu") is jax.nn.gelu
    policy = jax.checkpoint_policies.dots_saveable
    # The name dumps write for jax's policy (its private module), and its public path.
    assert import_name(config_lib.qualified_name(policy)) is policy
    assert import_name("jax.checkpoint_policies.dots_saveable") is policy
    assert import_name("axlearn.common.layers.Linear") is layers.Linear
    assert import_name("axlearn.common.schedule.cosine_with_linear_warmup") is (
        schedule.cosine_with_linear_warmup
    )


def test_every_configurable_class_registers_itself_and_a_plain_function_does_not():
    class Local(config_lib.Configurable):
        pass

    def local_fn():
        pass

    assert is_registered(Local) and not is_registered(local_fn)
    assert register_configurable(local_fn) is local_fn and is_registered(local_fn)


def test_a_trusted_package_resolves_only_what_it_registered(planted, monkeypatch):
    monkeypatch.setenv(config_lib.TRUSTED_PACKAGES_ENV, f"other, {PLANTED}")
    cfg = parse_flat_text(f"klass: '{PLANTED}.Thing'\n")
    assert planted.exists() and cfg.klass is sys.modules[PLANTED].Thing
    with pytest.raises(UntrustedNameError, match=rf"'{PLANTED}.Other' is not registered"):
        parse_flat_text(f"klass: '{PLANTED}.Other'\n")


def test_a_private_module_of_a_trusted_package_is_never_imported(planted):
    trust_packages(PLANTED)
    with pytest.raises(UntrustedNameError, match="is in a private module"):
        import_name(f"{PLANTED}._impl.thing")
    assert not (planted.parent / "impl.marker").exists()


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


def _assert_refused(result: subprocess.CompletedProcess, key: str, name: str, why: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "config.txt:" in last and f"{key}: '{name}' {why}" in last, last


def _gpt_test_run_dir(tmp_path, marker):
    """A run directory whose config.txt is gpt_test's, its model's initializer replaced
    by the issue's example (numpy's runstring running `touch marker`)."""
    from axlearn.common.experiment_registry import (  # pylint: disable=import-outside-toplevel
        build_named_config,
    )

    lines = [
        line
        for line in build_named_config("gpt_test").debug_string().splitlines()
        if not line.startswith("model.param_init.")
    ]
    lines = sorted(lines + _runstring_lines(marker))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("command", ["generate", "export"])
def test_the_commands_refuse_the_issues_run_dir_and_run_nothing(command, tmp_path):
    marker = tmp_path / "ran.marker"
    run_dir = _gpt_test_run_dir(tmp_path, marker)
    args = {
        "generate": ["axlearn.common.generate", f"--trainer_dir={run_dir}", "--prompt=hi"],
        "export": [
            "axlearn.common.hf_llama", "export", f"--trainer_dir={run_dir}",
            f"--output={tmp_path / 'hf'}",
        ],
    }[command]  # fmt: skip
    name = "numpy.testing._private.utils.runstring"
    result = _run_command(args, cwd=REPO)
    _assert_refused(result, "model.param_init.fn", name, "is not one of the numpy objects")
    assert not marker.exists() and not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_generate_refuses_a_config_txt_that_names_os_system(tmp_path):
    marker = tmp_path / "ran.marker"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.txt").write_text(_system_text(marker), encoding="utf-8")
    args = ["axlearn.common.generate", f"--trainer_dir={run_dir}", "--prompt=hi"]
    _assert_refused(_run_command(args, cwd=REPO), "model.fn", "os.system", "is not under a trusted")
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
    _assert_refused(result, "model.klass", f"{PLANTED}.Thing", "is not under a trusted")
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
    assert "not registered" not in result.stderr, result.stderr


@pytest.mark.slow
def test_hf_llama_export_imports_the_planted_module_given_the_trusted_packages_flag(
    planted, tmp_path
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    text = f"klass: 'axlearn.common.trainer.SpmdTrainer'\nmodel.klass: '{PLANTED}.Other'\n"
    (run_dir / "config.txt").write_text(text, encoding="utf-8")
    args = [
        "axlearn.common.hf_llama",
        "export",
        f"--trainer_dir={run_dir}",
        f"--output={tmp_path / 'hf'}",
        f"--trusted_packages={PLANTED}",
    ]
    result = _run_command(args, cwd=tmp_path, extra_path=str(planted.parent / "site"))
    # Trusted, the package is imported; its unregistered class is refused all the same.
    assert planted.exists()
    _assert_refused(result, "model.klass", f"{PLANTED}.Other", "is not registered")


def test_the_launcher_trusts_the_packages_its_flag_names(monkeypatch):
    from absl import flags  # pylint: disable=import-outside-toplevel

    from axlearn.common import launch_trainer  # pylint: disable=import-outside-toplevel

    flag_values = flags.FlagValues()
    launch_trainer.define_flags(flag_values)
    flag_values(["launcher", f"--trusted_packages={PLANTED},other", "--list_configs"])
    monkeypatch.setattr(launch_trainer, "list_configs_text", lambda module: "")
    launch_trainer.run_from_flags(flag_values)
    assert trusted_packages()[-2:] == (PLANTED, "other")
