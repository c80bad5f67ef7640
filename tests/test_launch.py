"""Tests of the launcher: launch.py, launch_trainer.py and launch_trainer_main.py.

Flag handling runs in-process on fresh absl FlagValues; the main job itself runs as a
subprocess (`python -m axlearn.common.launch_trainer_main ...`), including two processes
that train one model together through jax.distributed on localhost (gloo collectives).
"""

import json
import os
import socket
import subprocess
import sys

import pytest
from absl import flags

from axlearn.common import launch, launch_trainer
from axlearn.common.config import ConfigError
from axlearn.common.input_builtin import BuiltinTextInput
from axlearn.common.input_fake import FakeLmInput
from axlearn.common.launch_trainer import build_trainer_config, get_named_trainer_config
from axlearn.common.causal_lm import count_parameters
from axlearn.experiments.text.gpt import common
from experiments import gpt
from tests.fresh_python import REPO, fresh_env

MAIN = "axlearn.common.launch_trainer_main"


def _flag_values(*argv: str) -> flags.FlagValues:
    flag_values = flags.FlagValues()
    launch.define_flags(flag_values)
    launch_trainer.define_flags(flag_values)
    flag_values(["launch_trainer_main", *argv])
    return flag_values


def _main(*argv: str, devices: int = 1, timeout: int = 300, **popen_kwargs):
    """Starts the main job in a subprocess on `devices` fake CPU devices."""
    env = fresh_env(devices)
    command = [sys.executable, "-m", MAIN, *argv]
    if popen_kwargs.pop("background", False):
        return subprocess.Popen(
            command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )
    return subprocess.run(
        command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


# ----- --print_config, --config and --module -----


def test_print_config_prints_the_flat_config_and_does_not_train(tmp_path):
    trainer_dir = tmp_path / "never_created"
    result = _main(
        "--config=gpt_test", f"--trainer_dir={trainer_dir}", "--print_config",
        "--config_override=max_step=7",
    )
    assert result.returncode == 0, result.stderr
    expected = build_trainer_config(
        config_name="gpt_test", config_overrides=["max_step=7"], trainer_dir=str(trainer_dir)
    )
    assert result.stdout.strip() == expected.debug_string()
    lines = result.stdout.splitlines()
    assert "max_step: 7" in lines and "klass: 'axlearn.common.trainer.SpmdTrainer'" in lines
    assert not trainer_dir.exists()


def test_unknown_config_name_fails_listing_close_names_without_a_traceback():
    with pytest.raises(ConfigError, match="Unknown config 'gpt_tst'.*Did you mean: gpt_test"):
        get_named_trainer_config("gpt_tst")
    result = _main("--config=gpt_tst", "--print_config")
    assert result.returncode == 1
    assert "Did you mean: gpt_test" in result.stderr and "Traceback" not in result.stderr


def test_module_may_be_named_or_left_out_when_the_config_name_is_unique():
    named = get_named_trainer_config("gpt_test", module="gpt")
    assert named.debug_string() == get_named_trainer_config("gpt_test").debug_string()


def test_unknown_module_is_rejected_listing_the_modules():
    with pytest.raises(ConfigError, match="No experiment module 'gtp'; available: .*gpt"):
        get_named_trainer_config("gpt_test", module="gtp")


def test_a_config_name_in_several_modules_needs_the_module_flag(tmp_path, monkeypatch):
    package = tmp_path / "h8_experiments"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, max_step in (("first", 1), ("second", 2)):
        (package / f"{name}.py").write_text(
            "from experiments.gpt import gpt_test_trainer\n\n"
            "def named_trainer_configs():\n"
            f"    return {{'shared': lambda: gpt_test_trainer().set(max_step={max_step}),\n"
            f"            'only_{name}': gpt_test_trainer}}\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(launch_trainer, "EXPERIMENTS_PACKAGE", "h8_experiments")
    with pytest.raises(ConfigError, match=r"'shared' is defined in .*\(first, second\).*--module"):
        get_named_trainer_config("shared")
    assert get_named_trainer_config("shared", module="second").max_step == 2
    assert get_named_trainer_config("only_second").name == "gpt_test"


# ----- --config_override -----


def test_config_overrides_are_repeatable_and_applied_in_order(capsys):
    flag_values = _flag_values(
        "--config=gpt_test",
        "--print_config",
        "--config_override=max_step=11",
        "--config_override=learner.optimizer.max_norm=2.5",
        "--config_override=max_step=12",
    )
    assert launch_trainer.run_from_flags(flag_values) is None
    lines = capsys.readouterr().out.splitlines()
    assert "max_step: 12" in lines and "learner.optimizer.max_norm: 2.5" in lines


@pytest.mark.parametrize(
    "override,message",
    [
        ("max_step='many'", "max_step: expected Union\\[int, .*got 'many'"),
        ("save_input_iterator=1", "save_input_iterator: expected bool"),
        ("max_steps=3", "no field 'max_steps'.*max_step"),
        ("max_step", "is not of the form path=value"),
    ],
)
def test_config_overrides_are_type_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        build_trainer_config(config_name="gpt_test", config_overrides=[override])


# ----- --mesh_selector -----


@pytest.mark.parametrize(
    "selector,mesh",
    [
        ("gpu-p5.48xlarge-64", dict(data=-1, fsdp=8)),  # A mesh-shape rule.
        ("gpu-h100-8", dict(fsdp=-1)),  # A chain of modifiers (mesh, remat).
        ("tpu-v5litepod-256", dict(data=-1, fsdp=256)),
    ],
)
def test_mesh_selector_applies_the_first_fully_matching_rule(selector, mesh):
    cfg = build_trainer_config(config_name="gpt_1b", mesh_selector=selector)
    assert cfg.mesh_shape == common.mesh_shape_from_axes(**mesh)


def test_mesh_selector_can_apply_a_config_modifier():
    default = build_trainer_config(config_name="gpt_1b")
    selected = build_trainer_config(config_name="gpt_1b", mesh_selector="gpu-h100-8")
    # gpt_1b's single-host rule saves all activations: no remat spec.
    assert default.model.decoder.transformer.layer.remat_spec is not None
    assert selected.model.decoder.transformer.layer.remat_spec is None


@pytest.mark.parametrize("config_name,carried", [("gpt_1b", True), ("gpt_7b", False)])
def test_single_host_gpu_rule_carries_weight_copies_only_without_remat(config_name, carried):
    # Measured (docs/benchmarks.md): a gain on gpt_1b, which saves all activations; none on
    # gpt_7b, whose layers are rematerialized, for more memory.
    cfg = build_trainer_config(config_name=config_name, mesh_selector="gpu-h100-8")
    assert (cfg.model.decoder.transformer.layer.remat_spec is None) is carried
    assert bool(cfg.carry_train_dtype_weights) is carried


@pytest.mark.parametrize("size_name", ["125M", "350M", "1B", "7B", "70B"])  # Not the reference.
def test_single_host_rules_name_the_hosts_that_hold_the_state(size_name):
    size, config_name = gpt.SIZES[size_name], f"gpt_{size_name.lower()}"
    model = get_named_trainer_config(config_name).model.clone(name="model")
    state_bytes = 16 * count_parameters(model.instantiate(parent=None))
    fits = tuple(n for n in (1, 2, 4, 8) if state_bytes / n <= 30e9)
    assert (size.single_host.gpu_counts if size.single_host else ()) == fits
    for n in (1, 2, 4, 8):
        selector = f"gpu-h100-{n}"
        if n not in fits:
            with pytest.raises(ConfigError, match=f"--mesh_selector={selector} matches none"):
                build_trainer_config(config_name=config_name, mesh_selector=selector)
            continue
        cfg = build_trainer_config(config_name=config_name, mesh_selector=selector)
        assert cfg.per_device_microbatch_size == size.single_host.microbatch
        # The configured batch splits into whole microbatches on every such host.
        assert (size.global_batch_size // n) % size.single_host.microbatch == 0


def test_unmatched_mesh_selector_fails_listing_the_rules():
    message = r"--mesh_selector=gpu-z100-3 matches none of gpt_1b's mesh_rules: \["
    with pytest.raises(ConfigError, match=message):
        build_trainer_config(config_name="gpt_1b", mesh_selector="gpu-z100-3")


# ----- --data_dir -----


def test_fake_data_dir_swaps_in_synthetic_inputs_of_the_same_shape():
    original = build_trainer_config(config_name="gpt_test")
    cfg = build_trainer_config(config_name="gpt_test", data_dir="FAKE")
    for fake, real in [(cfg.input, original.input)] + [
        (cfg.evalers[name].input, original.evalers[name].input) for name in cfg.evalers
    ]:
        assert fake.klass is FakeLmInput
        assert fake.global_batch_size == real.global_batch_size
        assert fake.max_sequence_length == real.max_sequence_length
        assert fake.is_training == real.is_training
        assert fake.vocab_size == cfg.model.decoder.vocab_size


def test_builtin_data_dir_swaps_in_the_builtin_corpus_in_the_same_shapes():
    cfg = build_trainer_config(
        config_name="gpt_1b", data_dir="BUILTIN", config_overrides=["input.global_batch_size=4"]
    )
    assert cfg.input.klass is BuiltinTextInput
    assert (cfg.input.split, cfg.input.is_training) == ("train", True)
    assert (cfg.input.global_batch_size, cfg.input.max_sequence_length) == (4, 4096)
    evaler_input = cfg.evalers["openwebtext_2"].input
    assert evaler_input.klass is BuiltinTextInput
    assert (evaler_input.split, evaler_input.is_training) == ("validation", False)
    assert evaler_input.model_vocab_size == cfg.model.decoder.vocab_size == 32768


def test_data_dir_is_set_on_every_input_source():
    cfg = build_trainer_config(config_name="gpt_1b", data_dir="/data/tfds")
    assert cfg.input.source.data_dir == "/data/tfds"
    assert cfg.evalers["openwebtext_2"].input.source.data_dir == "/data/tfds"


# ----- process set-up -----


def test_multi_process_flags_must_come_together():
    with pytest.raises(ConfigError, match="needs --num_processes, --process_id too"):
        launch.setup(jax_backend="cpu", distributed_coordinator="localhost:1234")


def test_xla_flag_presets_never_override_flags_the_user_set(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    launch.apply_xla_flag_preset("gpu")
    flags_set = os.environ["XLA_FLAGS"].split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in flags_set
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags_set
    assert "--xla_gpu_all_gather_combine_threshold_bytes=134217728" in flags_set


# ----- the main job trains, resumes, and trains across two processes -----

TINY_RUN = (
    "--config=gpt_test",
    "--data_dir=FAKE",
    "--jax_backend=cpu",
    "--config_override=input.max_sequence_length=64",
    "--config_override=summary_writer.write_every_n_steps=1",
    "--config_override=log_every_n_steps=1",
)


def _losses(trainer_dir) -> dict[int, float]:
    path = os.path.join(trainer_dir, "summaries", "train", "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _two_processes(trainer_dir, max_step: int) -> list[str]:
    port = _free_port()
    processes = [
        _main(
            *TINY_RUN,
            f"--trainer_dir={trainer_dir}",
            f"--config_override=max_step={max_step}",
            f"--distributed_coordinator=localhost:{port}",
            "--num_processes=2",
            f"--process_id={i}",
            background=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    return outputs


@pytest.fixture(name="single_process_run", scope="module")
def fixture_single_process_run(tmp_path_factory):
    """gpt_test on fake data, 6 steps, one process with 2 devices: (dir, output)."""
    trainer_dir = tmp_path_factory.mktemp("single")
    result = _main(
        *TINY_RUN, f"--trainer_dir={trainer_dir}", "--config_override=max_step=6", devices=2
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return trainer_dir, result.stderr


def test_main_job_trains_and_writes_checkpoints_and_summaries(single_process_run):
    trainer_dir, output = single_process_run
    assert "step 6/6 | loss " in output
    assert sorted(_losses(trainer_dir)) == [1, 2, 3, 4, 5, 6]
    assert os.listdir(os.path.join(trainer_dir, "checkpoints")) == ["step_00000006"]
    assert any(
        name.startswith("events.out.tfevents")
        for name in os.listdir(os.path.join(trainer_dir, "summaries", "train"))
    )


def test_two_processes_train_one_model_and_match_the_single_process_losses(
    single_process_run, tmp_path
):
    reference_dir, _ = single_process_run
    # Each process has one device: together they form the single process's fsdp=2 mesh.
    first = _two_processes(tmp_path, max_step=4)
    assert all("fsdp': 2" in output for output in first)
    assert all("[Gloo] Rank" in output for output in first)
    # Both processes restart from the checkpoint of step 4 and train on.
    second = _two_processes(tmp_path, max_step=6)
    assert all("Restored step 4" in output for output in second)
    reference, together = _losses(reference_dir), _losses(tmp_path)
    assert sorted(together) == [1, 2, 3, 4, 5, 6]
    for step, loss in reference.items():
        assert abs(together[step] - loss) <= 1e-5 * abs(loss), (step, together[step], loss)
