"""Tests of the launcher: launch.py, launch_trainer.py (with experiment_registry.py,
mesh_selection.py, launch_data.py, run_record.py) and launch_trainer_main.py.

Flag handling runs in-process on fresh absl FlagValues; the main job itself runs as a
subprocess (`python -m axlearn.common.launch_trainer_main ...`), including two processes
that train one model together through jax.distributed on localhost (gloo collectives).
"""

import importlib.util
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from absl import flags

from axlearn.common import (
    experiment_registry,
    launch,
    launch_trainer,
    launch_trainer_main,
    run_record,
)
from axlearn.common.config import ConfigError
from axlearn.common.experiment_registry import build_named_config
from axlearn.common.input_builtin import BuiltinTextInput
from axlearn.common.input_fake import FakeLmInput
from axlearn.common.input_token_format import write_shard
from axlearn.common.launch_data import missing_input_packages
from axlearn.common.launch_trainer import build_trainer_config
from axlearn.common.mesh_selection import instance_type, mesh_rule_for, selector_contradiction
from axlearn.common.run_dir import RunDir
from axlearn.common.run_record import config_changes
from axlearn.common.causal_lm import count_parameters
from axlearn.common.trainer import infer_mesh_shape
from axlearn.common.trainer_config_modifier import apply_mesh_rule
from axlearn.experiments.text.gpt import common
from experiments import gpt
from tests.fresh_python import REPO, fresh_env, run_python

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
    env.update(popen_kwargs.pop("env", {}))
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_unknown_config_name_fails_listing_close_names_without_a_traceback():
    with pytest.raises(ConfigError, match="Unknown config 'gpt_tst'.*Did you mean: gpt_test"):
        build_named_config("gpt_tst")
    result = _main("--config=gpt_tst", "--print_config")
    assert result.returncode == 1
    assert "Did you mean: gpt_test" in result.stderr and "Traceback" not in result.stderr


def test_module_may_be_named_or_left_out_when_the_config_name_is_unique():
    named = build_named_config("gpt_test", module="gpt")
    assert named.debug_string() == build_named_config("gpt_test").debug_string()


def test_unknown_module_is_rejected_listing_the_modules():
    with pytest.raises(ConfigError, match="No experiment module 'gtp'; available: .*gpt"):
        build_named_config("gpt_test", module="gtp")


def test_a_config_name_in_several_modules_needs_the_module_flag(tmp_path, monkeypatch):
    package = tmp_path / "h8" / "experiments"  # AXLearn's <root>.experiments layout.
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    for name, max_step in (("first", 1), ("second", 2)):
        (package / f"{name}.py").write_text(
            "from experiments.gpt import gpt_test_trainer\n\n"
            "def named_trainer_configs():\n"
            f"    return {{'shared': lambda: gpt_test_trainer().set(max_step={max_step}),\n"
            f"            'only_{name}': gpt_test_trainer}}\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(experiment_registry, "EXPERIMENTS_PACKAGE", "h8.experiments")
    with pytest.raises(ConfigError, match=r"'shared' is defined in .*\(first, second\).*--module"):
        build_named_config("shared")
    assert build_named_config("shared", module="second").max_step == 2
    assert build_named_config("only_second").name == "gpt_test"


def test_help_lists_the_launcher_flags():
    result = _main("--help")
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("--config", "--list_configs", "--mesh_selector", "--allow_config_change",
                 "--jax_backend", "--distributed_coordinator"):
        assert f"  {flag}:" in result.stdout or f"  --[no]{flag[2:]}:" in result.stdout, flag


@pytest.mark.slow
def test_list_configs_prints_each_config_with_its_parameter_count():
    result = _main("--list_configs")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()}
    assert set(lines) == set(experiment_registry.named_configs())
    # gpt_test by hand: a tied 384x128 embedding, the final norm, and 2 layers of attention
    # (q and o 128x128, k and v 128x64, two 32-wide QK-norm scales), a gated MLP
    # (2 x 128x384 in, 384x128 out) and two norms.
    layer = 2 * 128 * 128 + 2 * 128 * 64 + 2 * 32 + 3 * 128 * 384 + 2 * 128
    expected = 384 * 128 + 128 + 2 * layer
    assert f" {expected:,} parameters  A tiny byte-level GPT" in lines["gpt_test"]
    # Every named config has its own line in its module's DESCRIPTIONS, and shows it.
    for name, (module, _) in experiment_registry.named_configs().items():
        description = experiment_registry.module_descriptions(module)[name]
        assert lines[name].endswith(f" parameters  {description}"), name


@pytest.mark.parametrize(
    "tool", [["-m", MAIN, "--print_config"], ["-m", "axlearn.bench", "--steps=1"]],
    ids=["launcher", "bench"],
)
@pytest.mark.slow
def test_every_tool_refuses_an_unknown_config_name_listing_close_names(tool):
    result = subprocess.run(
        [sys.executable, *tool, "--config=gpt_tst"], env=fresh_env(1), cwd=REPO,
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    assert "Unknown config 'gpt_tst'" in result.stderr and "Did you mean: gpt_test" in result.stderr


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
        ("max_step='many'", "max_step: expected an int, got 'many'"),
        ("save_input_iterator=1", "save_input_iterator: expected True or False"),
        ("model.decoder.dim=1.5", r"model\.decoder\.dim: expected an int, got 1\.5 \(a float\)$"),
        ("max_step=0", r"--config_override=max_step=0: max_step must be a positive int"),
        ("max_steps=3", "no field 'max_steps'.*max_step"),
        ("max_step", "is not of the form path=value"),
    ],
)
def test_config_overrides_are_type_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        build_trainer_config(config_name="gpt_test", config_overrides=[override])


# ----- one step count: max_step -----


def test_max_step_override_moves_every_field_that_held_the_step_count():
    cfg = build_trainer_config(config_name="gpt_test", config_overrides=["max_step=20"])
    schedule_cfg = cfg.learner.optimizer.inner.update_schedule
    assert schedule_cfg.max_step == 20
    assert cfg.checkpointer.save_policy.max_step == 20
    assert cfg.evalers["validation"].eval_policy.max_step == 20
    # The schedule decays to alpha * peak at step 20 (cosine, after the warmup).
    schedule = schedule_cfg.instantiate()
    warmup, end = schedule_cfg.warmup_steps, schedule_cfg.alpha * schedule_cfg.peak_lr
    for step in (warmup, 12, 19, 20, 25):
        fraction = min(1.0, (step - warmup) / (20 - warmup))
        expected = end + (schedule_cfg.peak_lr - end) * 0.5 * (1 + np.cos(np.pi * fraction))
        np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-6)
    # The final step is evaluated and saved; it is no multiple of their cadences.
    assert cfg.evalers["validation"].eval_policy.instantiate()(20)
    assert cfg.checkpointer.save_policy.instantiate()(20)
    assert not cfg.checkpointer.save_policy.instantiate()(19)


def test_a_warmup_longer_than_the_run_is_shortened_in_proportion():
    base = build_named_config("gpt_test").learner.optimizer.inner.update_schedule
    assert (base.max_step, base.warmup_steps) == (200, 30)
    cfg = build_trainer_config(config_name="gpt_test", config_overrides=["max_step=20"])
    assert cfg.learner.optimizer.inner.update_schedule.warmup_steps == 3
    longer = build_trainer_config(config_name="gpt_test", config_overrides=["max_step=400"])
    assert longer.learner.optimizer.inner.update_schedule.warmup_steps == 30


def test_a_max_step_field_overridden_by_hand_keeps_its_value():
    path = "learner.optimizer.inner.update_schedule.max_step"
    cfg = build_trainer_config(
        config_name="gpt_test", config_overrides=[f"{path}=50", "max_step=20"]
    )
    assert cfg.learner.optimizer.inner.update_schedule.max_step == 50
    assert cfg.checkpointer.save_policy.max_step == 20


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
    # Carried copies speed up gpt_1b, which saves all activations; gpt_7b's rematerialized
    # layers would only pay their memory.
    cfg = build_trainer_config(config_name=config_name, mesh_selector="gpu-h100-8")
    assert (cfg.model.decoder.transformer.layer.remat_spec is None) is carried
    assert bool(cfg.carry_train_dtype_weights) is carried


@pytest.mark.parametrize("size_name", ["125M", "350M", "1B", "7B", "8B", "70B"])  # Not the reference.
def test_single_host_rules_name_the_hosts_that_hold_the_state(size_name):
    size, config_name = gpt.SIZES[size_name], f"gpt_{size_name.lower()}"
    model = build_named_config(config_name).model.clone(name="model")
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


def test_one_h200_trains_gpt_7b_and_gpt_8b_in_compact_state_and_one_h100_does_not():
    for config_name in ("gpt_7b", "gpt_8b"):
        cfg = build_trainer_config(config_name=config_name, mesh_selector="gpu-h200-1")
        assert cfg.mesh_shape == common.mesh_shape_from_axes(fsdp=-1)
        assert cfg.per_device_microbatch_size == 1
        assert cfg.carry_train_dtype_weights and cfg.split_carried_weights
        casts = cfg.learner.optimizer.inner, cfg.learner.optimizer.inner.inner
        assert [(c.state_paths, c.dtype) for c in casts] == list(gpt.NARROW_STATE_DTYPES.items())
        # 12 bytes a parameter do not fit an 80 GB card.
        with pytest.raises(ConfigError, match="--mesh_selector=gpu-h100-1 matches none"):
            build_trainer_config(config_name=config_name, mesh_selector="gpu-h100-1")
    remat = build_trainer_config(config_name="gpt_7b", mesh_selector="gpu-h200-1").model
    assert remat.decoder.transformer.layer.remat_spec["policy"].policy_2 == (
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    )
    # gpt_8b (with XLA_PYTHON_CLIENT_MEM_FRACTION=0.94): matmul outputs saved, attention not.
    remat = build_trainer_config(config_name="gpt_8b", mesh_selector="gpu-h200-1").model
    assert remat.decoder.transformer.layer.remat_spec == {
        "prevent_cse": True, "policy": "dots_with_no_batch_dims_saveable"
    }


@pytest.mark.parametrize("config_name", ["gpt_1b", "gpt_7b", "gpt_8b"])
def test_mesh_selector_none_gives_a_mesh_that_covers_one_device(config_name):
    cfg = build_trainer_config(config_name=config_name, mesh_selector="none")
    assert infer_mesh_shape(cfg.mesh_shape, 1) == (1,) * len(cfg.mesh_axis_names)
    assert infer_mesh_shape(cfg.mesh_shape, 8) == common.mesh_shape_from_axes(fsdp=8)


# gpt_7b at a size a CPU trains in seconds: 2 layers of 64, 4/2 heads, 32 tokens.
_SMALL_7B = (
    "model.decoder.dim=64",
    "model.decoder.vocab_size=256",
    "model.decoder.transformer.num_layers=2",
    "model.decoder.transformer.layer.feed_forward.hidden_dim=128",
    "model.decoder.transformer.layer.self_attention.attention.num_heads=4",
    "model.decoder.transformer.layer.self_attention.attention.input_linear.input_linear."
    "num_kv_heads=2",
    "input.max_sequence_length=32",
    "input.global_batch_size=2",
)


def _small_7b_run(mesh_selector: str, steps: int) -> tuple[float, list[float]]:
    """(bytes of weights and optimizer state a parameter, the losses of `steps` steps) of
    gpt_7b under `mesh_selector`'s rule at _SMALL_7B's size, on this process's first CPU."""
    from axlearn.bench import build_benchmark_config  # pylint: disable=import-outside-toplevel

    cfg = build_benchmark_config("gpt_7b", mesh_selector=mesh_selector, overrides=_SMALL_7B)
    trainer = cfg.instantiate(parent=None, devices=jax.devices("cpu")[:1])
    trainer._state = trainer.init_state(jax.random.PRNGKey(0))  # pylint: disable=protected-access
    state = trainer._state  # pylint: disable=protected-access
    carried = (state.model, state.learner, state.weight_copies, state.weight_low_bits)
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(carried))
    batches = (batch for _, batch in trainer._host_batches())  # pylint: disable=protected-access
    losses = [float(trainer.train_step(trainer.global_batch(next(batches)))["loss"])
              for _ in range(steps)]
    return state_bytes / count_parameters(trainer.model), losses


@pytest.mark.slow
def test_the_one_gpu_rule_trains_in_8_bytes_a_parameter_as_the_float32_state_rule_does():
    # The 4- and 8-GPU H200 rule (float32 weights and moments, carried bf16 copies, also
    # unrolled, so the same initial weights) on one device is the reference.
    compact_bytes, compact_losses = _small_7b_run("gpu-h200-1", steps=3)
    full_bytes, full_losses = _small_7b_run("gpu-h200-4", steps=3)
    assert compact_bytes == pytest.approx(8.0, abs=0.01)  # 2 + 2 weight halves, 2 + 2 EMAs.
    assert full_bytes == pytest.approx(14.0, abs=0.01)  # 4 + 2 copy, 4 + 4 EMAs.
    # Step 1 sees the same weights (its two microbatches sum to the same gradient); later
    # steps differ only by the EMAs' rounding to bf16 and fp16.
    np.testing.assert_allclose(compact_losses[0], full_losses[0], rtol=1e-5)
    np.testing.assert_allclose(compact_losses, full_losses, rtol=1e-3)


def test_unmatched_mesh_selector_fails_listing_the_rules():
    message = r"--mesh_selector=gpu-z100-3 matches none of gpt_1b's mesh_rules: \["
    with pytest.raises(ConfigError, match=message):
        build_trainer_config(config_name="gpt_1b", mesh_selector="gpu-z100-3")


@pytest.mark.parametrize(
    "platform,device_kind,count,selector",
    [
        ("gpu", "NVIDIA H100 80GB HBM3", 1, "gpu-h100-1"),
        ("gpu", "NVIDIA H100 PCIe", 2, "gpu-h100-2"),
        ("gpu", "NVIDIA H200", 8, "gpu-h200-8"),
        ("gpu", "NVIDIA A100-SXM4-80GB", 8, "gpu-a100-8"),
        ("gpu", "NVIDIA GeForce RTX 4090", 1, "gpu-geforcertx4090-1"),
        ("cpu", "cpu", 1, "cpu"),
        ("cpu", "cpu", 8, "cpu"),
        ("tpu", "TPU v4", 128, "tpu-v4-256"),  # v4 and v5p sizes count TensorCores.
        ("tpu", "TPU v5", 512, "tpu-v5p-1024"),
        ("tpu", "TPU v5 lite", 256, "tpu-v5litepod-256"),
    ],
)
def test_mesh_selector_is_named_from_the_devices(platform, device_kind, count, selector):
    assert instance_type(platform, device_kind, count) == selector


@pytest.mark.parametrize(
    "devices,pattern",
    [
        (("gpu", "NVIDIA H100 80GB HBM3", 1), "gpu-(h100|h200)-(1|2|4|8)"),
        (("gpu", "NVIDIA H200", 8), "gpu-(h100|h200)-(1|2|4|8)"),
        (("cpu", "cpu", 2), "cpu(-[0-9]+)?"),
        (("tpu", "TPU v5", 512), "tpu-v5p-(1024|2048)"),
        (("tpu", "TPU v5 lite", 256), "tpu-v5litepod-256"),
    ],
)
def test_named_devices_select_the_rule_written_for_them(devices, pattern):
    rules = dict(build_named_config("gpt_1b").mesh_rules)
    cfg = build_trainer_config(
        config_name="gpt_1b", mesh_selector=instance_type(*devices)
    )
    expected = build_trainer_config(config_name="gpt_1b", mesh_selector=None)
    assert cfg.debug_string() == apply_mesh_rule(expected, rules[pattern]).debug_string()


@pytest.mark.parametrize(
    "selector,devices,reason",
    [
        ("gpu-h100-8", ("cpu", "cpu", 1), "it names gpu devices"),
        ("gpu-h100-8", ("gpu", "NVIDIA H100 80GB HBM3", 1), "it names 8 devices"),
        ("cpu-4", ("cpu", "cpu", 2), "it names 4 devices"),
        ("tpu-v5p-1024", ("tpu", "TPU v5", 256), "it names 512 devices"),
        ("gpu-h100-8", ("gpu", "NVIDIA H100 80GB HBM3", 8), None),
        ("gpu-p5.48xlarge-64", ("gpu", "NVIDIA H100 80GB HBM3", 64), None),
        ("tpu-v5p-1024", ("tpu", "TPU v5", 512), None),
        ("cpu", ("cpu", "cpu", 2), None),
        ("my-cluster-3", ("cpu", "cpu", 1), None),  # The user's own name: not checked.
    ],
)
def test_a_selector_contradicting_the_devices_is_found(selector, devices, reason):
    assert selector_contradiction(selector, *devices) == reason


# Devices as mesh_rule_for reads them (JAX's have a platform and a device kind).
_H200S = [types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")] * 8
_RULES = [("gpu-h200-8", (1, 8)), ("cpu", (1, -1))]


def test_mesh_rule_for_an_unset_selector_is_named_from_the_devices():
    assert mesh_rule_for(None, _RULES, devices=_H200S) == ("gpu-h200-8", "gpu-h200-8", (1, 8))


def test_mesh_rule_for_an_unset_selector_without_devices_is_no_rule():
    assert mesh_rule_for(None, _RULES) is None


@pytest.mark.parametrize("devices", [None, _H200S])
def test_mesh_rule_for_none_is_no_rule(devices):
    assert mesh_rule_for("none", _RULES, devices=devices) is None


def test_mesh_rule_for_a_selector_naming_other_devices_is_an_error():
    with pytest.raises(ConfigError, match=r"--mesh_selector=cpu contradicts .*8 NVIDIA H200"):
        mesh_rule_for("cpu", _RULES, devices=_H200S)


def test_mesh_rule_for_another_hosts_selector_without_devices_is_its_rule():
    assert mesh_rule_for("cpu", _RULES).rule == (1, -1)


@pytest.mark.slow
def test_main_job_refuses_a_mesh_selector_that_contradicts_its_devices(tmp_path):
    result = _main("--config=gpt_1b", "--mesh_selector=gpu-h100-8", f"--trainer_dir={tmp_path}")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert "--mesh_selector=gpu-h100-8 contradicts this run's devices" in message
    assert "1 cpu device (cpu)" in message and "it names gpu devices" in message


def test_print_config_applies_another_hosts_selector_without_checking_the_devices(capsys):
    # Reviewers print a GPU host's config on a machine without that GPU.
    flag_values = _flag_values("--config=gpt_1b", "--mesh_selector=gpu-h100-1", "--print_config")
    assert launch_trainer.run_from_flags(flag_values) is None
    lines = capsys.readouterr().out.splitlines()
    assert "per_device_microbatch_size: 4" in lines and "carry_train_dtype_weights: True" in lines


def test_mesh_selector_none_keeps_the_configs_own_mesh():
    cfg = build_trainer_config(config_name="gpt_1b", mesh_selector="none")
    assert cfg.debug_string() == build_named_config("gpt_1b").debug_string()


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


def test_tf_data_inputs_name_the_packages_they_miss(monkeypatch):
    cfg = build_named_config("gpt_1b")
    found = importlib.util.find_spec
    # Only tensorflow_datasets missing (tensorflow and seqio as found, or not, here).
    present = {"tensorflow", "seqio"}
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == "tensorflow_datasets" else (
            object() if name in present else found(name, *a)
        ),
    )
    path, missing = missing_input_packages(cfg)
    assert path.startswith("input.") and path.endswith((".klass", ".fn"))
    assert missing == ["tensorflow_datasets"]
    assert missing_input_packages(build_trainer_config(config_name="gpt_1b", data_dir="FAKE")) == (
        None, [],
    )
    assert missing_input_packages(build_named_config("gpt_test")) == (None, [])


@pytest.mark.slow
def test_main_job_without_tensorflow_datasets_stops_with_one_line_saying_what_to_pass(tmp_path):
    # tensorflow_datasets made unimportable, as on a machine without it.
    script = (
        "import runpy, sys; sys.modules['tensorflow_datasets'] = None; "
        f"sys.argv = ['{MAIN}', '--config=gpt_1b', '--trainer_dir={tmp_path}']; "
        f"runpy.run_module('{MAIN}', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=fresh_env(1), cwd=REPO, capture_output=True,
        text=True, timeout=300,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("launch_trainer_main: gpt_1b reads its data through tf.data")
    for alternative in ("tensorflow_datasets", "--data_dir=FAKE", "--data_dir=BUILTIN"):
        assert alternative in message
    assert "pip install 'axlearn[tf]'" in message
    assert not os.listdir(tmp_path)  # Stopped before building or recording anything.


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


def test_tpu_probe_record_is_dropped_and_other_records_pass():
    probe_filter = launch_trainer_main._TpuProbeFilter()  # pylint: disable=protected-access

    def record(message: str, *args) -> logging.LogRecord:
        return logging.LogRecord("jax._src.xla_bridge", logging.INFO, "", 0, message, args, None)

    assert not probe_filter.filter(record("Unable to initialize backend '%s': %s", "tpu", "no"))
    assert probe_filter.filter(record("Unable to initialize backend '%s': %s", "cuda", "no"))
    assert probe_filter.filter(record("An unrelated warning"))


@pytest.mark.slow
@pytest.mark.skipif(launch.tpu_present(), reason="This host has TPUs.")
def test_main_job_logs_no_tpu_probe_on_a_host_without_tpus():
    env = {"JAX_PLATFORMS": ""}  # JAX probes every platform it knows, the TPU included.
    result = _main("--config=gpt_test", "--print_config", env=env)
    assert result.returncode == 0, result.stderr
    assert "Mesh selector cpu, named from this run's devices" in result.stderr
    assert "Unable to initialize backend 'tpu'" not in result.stderr


# ----- the main job trains, resumes, and trains across two processes -----

TINY_RUN = (
    "--config=gpt_test",
    "--data_dir=FAKE",
    "--jax_backend=cpu",
    "--config_override=input.global_batch_size=4",
    "--config_override=input.max_sequence_length=64",
    "--config_override=evalers['validation'].input.global_batch_size=4",
    "--config_override=evalers['validation'].input.max_sequence_length=64",
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


# The 6-step run's schedule (max_step=6 carries it to step 6 and shortens its warmup to 1
# step), pinned, so that a run of 4 steps resumed to 6 follows the same one.
SIX_STEP_SCHEDULE = (
    "--config_override=learner.optimizer.inner.update_schedule.max_step=6",
    "--config_override=learner.optimizer.inner.update_schedule.warmup_steps=1",
)


def _two_processes(trainer_dir, max_step: int) -> list[str]:
    port = _free_port()
    processes = [
        _main(
            *TINY_RUN,
            *SIX_STEP_SCHEDULE,
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


@pytest.mark.slow
def test_main_job_trains_and_writes_checkpoints_and_summaries(single_process_run):
    trainer_dir, output = single_process_run
    assert "step 6/6 | loss " in output
    assert "Mesh selector cpu, named from this run's devices: 2 cpu devices" in output
    assert "Mesh selector cpu: gpt_test's rule 'cpu(-[0-9]+)?'" in output
    assert sorted(_losses(trainer_dir)) == [1, 2, 3, 4, 5, 6]
    assert os.listdir(os.path.join(trainer_dir, "checkpoints")) == ["step_00000006"]
    assert any(
        name.startswith("events.out.tfevents")
        for name in os.listdir(os.path.join(trainer_dir, "summaries", "train"))
    )


@pytest.mark.slow
def test_two_processes_train_one_model_and_match_the_single_process_losses(
    single_process_run, tmp_path
):
    reference_dir, _ = single_process_run
    # Each process has one device: together they form the single process's fsdp=2 mesh.
    first = _two_processes(tmp_path, max_step=4)
    assert all("fsdp': 2" in output for output in first)
    assert all("[Gloo] Rank" in output for output in first)
    # Both processes restart from the checkpoint of step 4 and train on; the longer run
    # is a change allowed between restarts, and listed.
    second = _two_processes(tmp_path, max_step=6)
    assert all("Restored step 4" in output for output in second)
    assert all("checkpointer.save_policy.max_step: 4 -> 6" in output for output in second)
    reference, together = _losses(reference_dir), _losses(tmp_path)
    assert sorted(together) == [1, 2, 3, 4, 5, 6]
    for step, loss in reference.items():
        assert abs(together[step] - loss) <= 1e-5 * abs(loss), (step, together[step], loss)


@pytest.mark.slow
def test_max_step_override_brings_the_final_eval_and_checkpoint_to_it(single_process_run):
    trainer_dir, output = single_process_run
    assert "max_step 200 -> 6; followed by" in output
    # gpt_test evaluates and saves every 100 steps, and at its max_step.
    assert "eval validation step 6:" in output
    assert os.listdir(os.path.join(trainer_dir, "checkpoints")) == ["step_00000006"]


# ----- the run records its config -----


@pytest.mark.slow
def test_main_job_records_its_resolved_config_as_golden_text(single_process_run):
    trainer_dir, _ = single_process_run
    expected = build_trainer_config(
        config_name="gpt_test",
        mesh_selector="cpu",
        data_dir="FAKE",
        config_overrides=[f.split("=", 1)[1] for f in TINY_RUN if f.startswith("--config_o")]
        + ["max_step=6"],
        trainer_dir=str(trainer_dir),
    )
    with open(os.path.join(trainer_dir, "config.txt"), encoding="utf-8") as f:
        assert f.read() == expected.debug_string()


def test_config_changes_allow_the_length_and_cadences_of_a_run_only():
    old = "\n".join([
        "checkpointer.save_policy.max_step: 200", "checkpointer.save_policy.n: 100",
        "learner.optimizer.max_norm: 1", "learner.schedule.max_step: 200",
        "learner.schedule.warmup_steps: 30", "log_every_n_steps: 25", "max_step: 200",
        "other.max_step: 999",
    ])
    new = "\n".join([
        "checkpointer.save_policy.max_step: 20", "checkpointer.save_policy.n: 10",
        "learner.optimizer.max_norm: 2.0", "learner.schedule.max_step: 20",
        "learner.schedule.warmup_steps: 3", "log_every_n_steps: 1", "max_step: 20",
        "other.max_step: 20", "model.extra: True",
    ])
    allowed = {key: ok for key, _, _, ok in config_changes(old, new)}
    assert allowed == {
        "checkpointer.save_policy.max_step": True,
        "checkpointer.save_policy.n": True,
        "learner.optimizer.max_norm": False,
        "learner.schedule.max_step": True,
        "learner.schedule.warmup_steps": True,
        "log_every_n_steps": True,
        "max_step": True,
        "other.max_step": False,  # It did not hold the run's max_step before.
        "model.extra": False,
    }
    # A warmup changed while its schedule kept its length is a recipe change.
    warmup_only = config_changes(old, old.replace("warmup_steps: 30", "warmup_steps: 5"))
    assert warmup_only == [("learner.schedule.warmup_steps", "30", "5", False)]


@pytest.fixture(name="restarted_dir")
def fixture_restarted_dir(single_process_run, tmp_path):
    """A copy of the single-process run's directory, to restart in."""
    trainer_dir = tmp_path / "run"
    shutil.copytree(single_process_run[0], trainer_dir)
    return trainer_dir


def _restart(trainer_dir, *flags_):
    # At max_step 6 the run restores its checkpoint and has nothing left to train.
    return _main(
        *TINY_RUN, f"--trainer_dir={trainer_dir}", "--config_override=max_step=6", *flags_,
        devices=2,
    )


@pytest.mark.slow
def test_restart_with_a_changed_recipe_stops_listing_the_keys(restarted_dir):
    recorded = (restarted_dir / "config.txt").read_text()
    result = _restart(restarted_dir, "--config_override=learner.optimizer.max_norm=2.0")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert "changed since the run's last start in 1 key(s)" in message
    assert "learner.optimizer.max_norm: 1 -> 2.0" in message and "--allow_config_change" in message
    assert "Restored step" not in result.stderr
    assert (restarted_dir / "config.txt").read_text() == recorded


@pytest.mark.slow
def test_restart_with_allow_config_change_resumes_and_records_the_new_config(restarted_dir):
    result = _restart(
        restarted_dir, "--config_override=learner.optimizer.max_norm=2.0", "--allow_config_change"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "learner.optimizer.max_norm: 1 -> 2.0" in result.stderr
    assert "Restored step 6" in result.stderr
    assert "learner.optimizer.max_norm: 2.0" in (restarted_dir / "config.txt").read_text()


# The packages of the optional extras (pyproject.toml): a core install has none of them.
_EXTRA_PACKAGES = (
    "tensorflow", "tensorflow_datasets", "seqio", "sentencepiece", "tokenizers", "pyarrow",
    "zstandard", "safetensors", "torch", "transformers", "moto",
)


@pytest.mark.slow
def test_a_core_install_lists_every_named_config():
    """The quick start's command runs on a core install: no experiment module imports an
    extra's package at import time (the packages are hidden from the subprocess)."""
    script = f"""
import importlib.abc, runpy, sys
class NoExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {_EXTRA_PACKAGES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden)", name=name)
        return None
sys.meta_path.insert(0, NoExtras())
sys.argv = ["launch_trainer_main", "--list_configs"]
runpy.run_module("axlearn.common.launch_trainer_main", run_name="__main__")
"""
    result = run_python(script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fuji-test-v3" in result.stdout and "gpt_test" in result.stdout


# ----- a first day: failed starts, one vocabulary size, one-line errors -----


def _record(tmp_path, text: str, **kwargs) -> None:
    run_record.record_config(RunDir(str(tmp_path)), text, allow_change=False, write=True, **kwargs)


def _add_checkpoint(trainer_dir) -> None:
    step_dir = os.path.join(trainer_dir, "checkpoints", "step_00000002")
    os.makedirs(step_dir)
    with open(os.path.join(step_dir, "index.json"), "w", encoding="utf-8") as f:
        f.write("{}")


_RECORD = "klass: 'axlearn.common.trainer.SpmdTrainer'\nlearner.lr: 0.1\nmax_step: 10\n"


def test_a_changed_config_replaces_the_record_while_the_run_has_no_checkpoint(tmp_path):
    _record(tmp_path, _RECORD)
    changed = _RECORD.replace("0.1", "0.2")
    _record(tmp_path, changed)  # A start that failed before its first checkpoint.
    assert (tmp_path / "config.txt").read_text() == changed


def test_a_changed_config_is_refused_once_the_run_has_a_checkpoint(tmp_path):
    _record(tmp_path, _RECORD)
    _add_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match=r"learner.lr: 0.1 -> 0.2.*--allow_config_change"):
        _record(tmp_path, _RECORD.replace("0.1", "0.2"))
    assert (tmp_path / "config.txt").read_text() == _RECORD


def test_a_record_that_is_no_config_is_named_in_one_short_line(tmp_path):
    (tmp_path / "config.txt").write_text("garbage " + "x" * 20_000 + "\nmore: 1\n")
    _add_checkpoint(tmp_path)
    with pytest.raises(ConfigError) as error:
        _record(tmp_path, _RECORD)
    message = str(error.value)
    assert "config.txt cannot be parsed: line 1" in message
    assert len(message) < 300 and "\n" not in message
    (tmp_path / "config.txt").write_bytes(b"\xff" * 20_000)
    with pytest.raises(ConfigError, match="config.txt cannot be parsed: byte 0 is not UTF-8"):
        _record(tmp_path, _RECORD)


def test_a_record_that_is_no_config_is_replaced_while_the_run_has_no_checkpoint(tmp_path):
    (tmp_path / "config.txt").write_bytes(b"\xff\xfe not a config")
    _record(tmp_path, _RECORD)
    assert (tmp_path / "config.txt").read_text() == _RECORD


def test_many_refused_changes_are_listed_up_to_a_limit_and_counted(tmp_path):
    old = _RECORD + "".join(f"model.f{i}: {i}\n" for i in range(50))
    _record(tmp_path, old)
    _add_checkpoint(tmp_path)
    with pytest.raises(ConfigError) as error:
        _record(tmp_path, old.replace(": ", ": 9", ).replace("klass: 9", "klass: "))
    message = str(error.value)
    limit = run_record.MAX_LISTED_CHANGES
    assert message.count(" -> ") == limit
    assert f"and {51 - limit} more" in message


def _shards(directory, *, vocab_size: int) -> str:
    """Train and validation shards of random ids below `vocab_size`, in `directory`."""
    rng = np.random.default_rng(0)
    for split in ("train", "validation"):
        docs = [rng.integers(3, vocab_size, size=n) for n in rng.integers(50, 200, size=16)]
        write_shard(
            os.path.join(directory, f"{split}-00000.tok"), docs, [len(d) for d in docs],
            vocab_name="test", vocab_size=vocab_size, eos_id=1,
        )
    return str(directory)


def test_the_models_vocab_size_carries_the_inputs_and_evalers_copies(tmp_path):
    data_dir = _shards(tmp_path, vocab_size=512)
    cfg = build_trainer_config(
        config_name="gpt_test", data_dir=data_dir,
        config_overrides=["model.decoder.vocab_size=512"],
    )
    assert cfg.input.model_vocab_size == 512
    assert cfg.evalers["validation"].input.model_vocab_size == 512
    fake = build_trainer_config(
        config_name="gpt_test", data_dir="FAKE", config_overrides=["model.decoder.vocab_size=512"]
    )
    assert fake.input.vocab_size == 512 and fake.evalers["validation"].input.vocab_size == 512


def test_a_vocab_size_copy_overridden_by_hand_keeps_its_value(tmp_path):
    cfg = build_trainer_config(
        config_name="gpt_test", data_dir=_shards(tmp_path, vocab_size=512),
        config_overrides=["model.decoder.vocab_size=512", "input.model_vocab_size=640"],
    )
    assert cfg.input.model_vocab_size == 640
    assert cfg.evalers["validation"].input.model_vocab_size == 512


def test_a_non_number_for_a_number_field_is_an_error_naming_the_field():
    with pytest.raises(ConfigError) as error:
        build_trainer_config(
            config_name="gpt_test",
            config_overrides=["learner.optimizer.inner.learning_rate=-1e9x"],
        )
    message = str(error.value)
    assert "learner.optimizer.inner.learning_rate holds a number (0.01)" in message
    assert "'-1e9x' is not one" in message


def test_a_trainer_dir_that_is_a_file_or_cannot_be_made_is_refused(tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        run_record.check_trainer_dir(str(file))
    with pytest.raises(ConfigError, match="cannot create the directory"):
        run_record.check_trainer_dir(str(file / "run"))
    run_record.check_trainer_dir(str(tmp_path / "new" / "run"))
    assert (tmp_path / "new" / "run").is_dir()


@pytest.mark.slow
def test_main_job_stops_on_a_trainer_dir_that_is_a_file_with_one_line(tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    result = _main("--config=gpt_test", "--data_dir=FAKE", f"--trainer_dir={file}")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"launch_trainer_main: --trainer_dir={file} is a file, not a directory"
    )


SHARD_RUN = (
    "--config=gpt_test",
    "--jax_backend=cpu",
    "--config_override=input.global_batch_size=4",
    "--config_override=input.max_sequence_length=64",
    "--config_override=evalers={}",
    "--config_override=max_step=2",
)


@pytest.mark.slow
def test_a_start_that_failed_on_its_data_does_not_block_the_corrected_rerun(tmp_path):
    data_dir = _shards(tmp_path / "data", vocab_size=512)
    trainer_dir = tmp_path / "run"
    failed = _main(*SHARD_RUN, f"--data_dir={data_dir}", f"--trainer_dir={trainer_dir}")
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert "more than the model's vocab_size 384" in failed.stderr.strip().splitlines()[-1]
    # One override: the inputs follow the model's vocabulary, and the record is replaced.
    fixed = _main(
        *SHARD_RUN, f"--data_dir={data_dir}", f"--trainer_dir={trainer_dir}",
        "--config_override=model.decoder.vocab_size=512",
    )
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert "model.decoder.vocab_size 384 -> 512; followed by input.model_vocab_size" in fixed.stderr
    assert "model.decoder.vocab_size: 512" in (trainer_dir / "config.txt").read_text()
    assert os.listdir(trainer_dir / "checkpoints") == ["step_00000002"]
    # The console says where the summaries are and that the first step compiles.
    assert f"Summaries: tensorboard --logdir={trainer_dir}/summaries" in fixed.stderr
    compiling = fixed.stderr.index("Compiling the train step...")
    assert fixed.stderr.index("Compiled the train step in ") > compiling


def _flip_a_stored_byte(step_dir) -> None:
    arrays = [
        os.path.join(root, name)
        for root, _, names in os.walk(os.path.join(step_dir, "arrays"))
        for name in names if not name.startswith(".")
    ]
    with open(sorted(arrays)[0], "r+b") as f:
        data = bytearray(f.read())
        data[-1] ^= 1
        f.seek(0)
        f.write(data)


def _edit_index_keeping_its_checksum(step_dir) -> None:
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.checkpointer import INDEX_CHECKSUM, _index_digest

    path = os.path.join(step_dir, "index.json")
    with open(path, encoding="utf-8") as f:
        index = json.load(f)
    name = next(name for name in index["arrays"] if name.endswith("output_norm/scale"))
    index["arrays"][name]["shape"] = [7]
    index[INDEX_CHECKSUM] = _index_digest(index)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(index, f)


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage,message",
    [
        (_flip_a_stored_byte, "Every committed checkpoint in "),
        (_edit_index_keeping_its_checksum, "holds shape (7,)"),
    ],
)
def test_a_checkpoint_that_cannot_be_restored_stops_the_run_with_one_line(
    restarted_dir, damage, message
):
    damage(restarted_dir / "checkpoints" / "step_00000006")
    result = _restart(restarted_dir, "--config_override=max_step=8")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("launch_trainer_main: ") and message in last
    assert "Move the bad step directories out of" in last


# ----- trackers -----


@pytest.mark.slow
def test_trackers_flag_logs_a_run_to_wandb_offline_and_a_restart_continues_it(tmp_path):
    from tests import test_summary_writer  # pylint: disable=import-outside-toplevel

    trainer_dir = tmp_path / "run"
    env = {"WANDB_MODE": "offline"}
    for max_step in (2, 3):
        result = _main(
            *TINY_RUN, f"--trainer_dir={trainer_dir}", f"--config_override=max_step={max_step}",
            "--trackers=tensorboard,jsonl,wandb", env=env,
        )
        assert result.returncode == 0, result.stderr[-3000:]
    run_id = (trainer_dir / "wandb_run_id").read_text()
    files = sorted((trainer_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2  # The restart logged on into the same run.
    histories = [test_summary_writer._history(test_summary_writer._finished_wandb_records(f))
                 for f in files]
    assert sorted(histories[0]) == [1, 2] and sorted(histories[1]) == [3]
    assert all("train/loss" in histories[0][step] for step in (1, 2))
    records = test_summary_writer._finished_wandb_records(files[0])
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["max_step"] == "2" and config["model.decoder.dim"] == "128"
    # The other trackers wrote as well.
    assert (trainer_dir / "summaries" / "train" / "metrics.jsonl").exists()
    assert list((trainer_dir / "summaries" / "train").glob("events.out.tfevents.*"))
