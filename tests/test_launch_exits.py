"""The launcher's exit on a trainer directory it cannot write: one line naming the file
and the system's error, STORAGE_EXIT_CODE, no traceback. Real processes; as root (whom
file modes do not stop) the launcher runs as user nobody, through setpriv."""

import errno
import os
import shutil
import pathlib
import subprocess
import sys
import tempfile

import jax
import pytest

from axlearn.common.launch_trainer_main import STORAGE_EXIT_CODE, exit_for
from tests.fresh_python import REPO, fresh_env

NOBODY = 65534


def _as_user() -> list[str]:
    """The command prefix that runs the launcher as nobody where this is root."""
    if os.getuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root, and no setpriv to run the launcher as another user")
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def _launch(trainer_dir, home, max_step: int) -> subprocess.CompletedProcess:
    command = [
        *_as_user(), sys.executable, "-m", "axlearn.common.launch_trainer_main",
        "--config=gpt_test",
        "--data_dir=FAKE", f"--trainer_dir={trainer_dir}", "--jax_backend=cpu",
        "--config_override=input.global_batch_size=2",
        "--config_override=input.max_sequence_length=16",
        "--config_override=evalers={}",
        f"--config_override=max_step={max_step}",
    ]
    env = fresh_env(1)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # The suite's cache is not nobody's.
    env["HOME"] = str(home)
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        check=False,
    )


def _chown_tree(path) -> None:
    if os.getuid() == 0:
        for root, dirs, files in os.walk(path):
            for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                os.chown(name, NOBODY, NOBODY)


def _read_only(path) -> None:
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o555 if name in dirs else 0o444)
    os.chmod(path, 0o555)


def _writable_everywhere(path) -> None:
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777)
    os.chmod(path, 0o777)


@pytest.fixture(name="scratch")
def fixture_scratch():
    """A directory the launcher user can reach (pytest's own are root's alone, 0700)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="axlearn-exits-"))
    os.chmod(path, 0o777)
    yield path
    _writable_everywhere(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(name="trained", scope="module")
def fixture_trained():
    """(a run trained to step 2 and saved, a home directory), both the launcher user's."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="axlearn-exits-trained-"))
    os.chmod(root, 0o777)
    (root / "home").mkdir()
    _chown_tree(root)
    result = _launch(root / "run", root / "home", max_step=2)
    assert result.returncode == 0, result.stderr[-3000:]
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _copy(trained, scratch):
    shutil.copytree(trained / "run", scratch / "run")
    _chown_tree(scratch / "run")
    return scratch / "run"


@pytest.mark.slow
def test_a_save_into_a_read_only_checkpoint_dir_exits_naming_the_real_error(trained, scratch):
    run = _copy(trained, scratch)
    _read_only(run / "checkpoints")
    result = _launch(run, trained / "home", max_step=4)
    assert result.returncode == STORAGE_EXIT_CODE, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("launch_trainer_main: ")
    assert "Permission denied" in last and str(run / "checkpoints") in last
    assert "Traceback" not in result.stderr
    assert not os.path.exists(run / "LOCK")


@pytest.mark.slow
def test_a_read_only_trainer_dir_exits_naming_it(trained, scratch):
    run = _copy(trained, scratch)
    _read_only(run)
    result = _launch(run, trained / "home", max_step=4)
    assert result.returncode == STORAGE_EXIT_CODE, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("launch_trainer_main: ") and "cannot write the run's files" in last
    assert "Permission denied" in last and str(run) in last
    assert "Traceback" not in result.stderr


# ----- which errors are the trainer directory's -----


def test_a_permission_error_in_the_trainer_dir_is_a_storage_exit(tmp_path):
    path = str(tmp_path / "run" / "checkpoints" / "step_00000004")
    error = RuntimeError("save failed")
    error.__cause__ = PermissionError(13, "Permission denied", path)
    status, line = exit_for(error, trainer_dir=str(tmp_path / "run"))
    assert status == STORAGE_EXIT_CODE and path in line and "Permission denied" in line


def test_a_permission_error_elsewhere_is_no_storage_exit(tmp_path):
    error = PermissionError(13, "Permission denied", str(tmp_path / "data" / "train-00000.tok"))
    assert exit_for(error, trainer_dir=str(tmp_path / "run")) == (1, None)


def test_a_device_out_of_memory_is_one_line_saying_what_frees_memory(tmp_path):
    error = jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 47.32GiB with allocator "
        "GPU_0_bfc on device 0. [executable_name='jit__train_step']\nmore detail"
    )
    status, line = exit_for(error, trainer_dir=str(tmp_path / "run"))
    assert status == 1 and "\n" not in line
    assert "a device ran out of memory (RESOURCE_EXHAUSTED: Out of memory" in line
    assert "per_device_microbatch_size" in line and "XLA_PYTHON_CLIENT_MEM_FRACTION" in line


def test_a_full_disk_is_a_storage_exit(tmp_path):
    error = OSError(28, "No space left on device")
    status, line = exit_for(error, trainer_dir=str(tmp_path / "run"))
    assert status == STORAGE_EXIT_CODE and "No space left on device" in line


# ----- a trainer directory that cannot be made -----


def test_a_trainer_dir_under_a_file_is_a_storage_exit_naming_the_file(tmp_path):
    from axlearn.common import run_record  # pylint: disable=import-outside-toplevel

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(run_record.TrainerDirNotWritableError) as e:
        run_record.check_trainer_dir(str(blocker / "run" / "a"))
    status, line = exit_for(e.value, trainer_dir=str(blocker / "run" / "a"))
    assert status == STORAGE_EXIT_CODE
    assert line.endswith(f"cannot create the directory: {blocker} is a file, not a directory")


def test_a_trainer_dir_on_a_read_only_file_system_says_so(tmp_path, monkeypatch):
    from axlearn.common import run_record  # pylint: disable=import-outside-toplevel

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), kwargs.get("dir") or args[0])

    monkeypatch.setattr(os, "makedirs", read_only)
    with pytest.raises(run_record.TrainerDirNotWritableError, match="Read-only file system"):
        run_record.check_trainer_dir(str(tmp_path / "new"))
    monkeypatch.undo()
    monkeypatch.setattr(tempfile, "mkstemp", read_only)  # An existing directory there.
    with pytest.raises(run_record.TrainerDirNotWritableError) as e:
        run_record.check_trainer_dir(str(tmp_path))
    assert "Read-only file system" in str(e.value) and "Permission" not in str(e.value)
    assert exit_for(e.value, trainer_dir=str(tmp_path))[0] == STORAGE_EXIT_CODE


@pytest.mark.slow
def test_the_launcher_exits_74_on_a_trainer_dir_under_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "axlearn.common.launch_trainer_main", "--config=gpt_test",
         "--data_dir=FAKE", f"--trainer_dir={blocker / 'run'}", "--jax_backend=cpu"],
        cwd=REPO, env=fresh_env(1), capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == STORAGE_EXIT_CODE, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"launch_trainer_main: --trainer_dir={blocker / 'run'}: cannot create the directory: "
        f"{blocker} is a file, not a directory"
    )
