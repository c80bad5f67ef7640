"""Tests of axlearn.common.trainer (SpmdTrainer) and axlearn.common.perf.

Every trainer here is tiny (tests/trainer_script.py) and trains in float32 on CPU, so a
run compiles and trains in a few seconds.
"""

import dataclasses
import functools
import glob
import json
import logging
import math
import os
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import causal_lm, perf
from axlearn.common.base_layer import (
    WeightWithCopy,
    cast_floats_with_copies,
    weight_einsum,
    weight_take,
)
from axlearn.common.checkpointer import Checkpointer
from axlearn.common.config import ConfigError, apply_overrides
from axlearn.common.input_builtin import BuiltinTextInput
from axlearn.common.input_fake import FakeLmInput
from axlearn.common.trainer import NonFiniteLossError, SpmdTrainer, infer_mesh_shape
from axlearn.common.utils import flatten_with_paths
from axlearn.experiments.text.gpt import common
from tests.fresh_python import assert_prints_ok, fresh_env
from tests.trainer_script import (
    BATCH,
    SEQ_LEN,
    VOCAB,
    PoisonedFakeLmInput,
    adamw_learner_config,
    losses_by_step,
    read_metrics,
    tiny_model_config,
    tiny_trainer_config,
)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _committed_steps(trainer_dir) -> list[int]:
    cfg = Checkpointer.default_config().set(
        name="checkpointer", dir=os.path.join(trainer_dir, "checkpoints")
    )
    return cfg.instantiate(parent=None).committed_steps()


def _builtin_input(split: str, is_training: bool) -> BuiltinTextInput.Config:
    return BuiltinTextInput.default_config().set(
        split=split,
        is_training=is_training,
        global_batch_size=8,
        max_sequence_length=64,
        model_vocab_size=384,
    )


# ----- training, checkpoints, summaries, resumption -----


@pytest.mark.slow
def test_small_trainer_loss_falls_and_writes_checkpoints_and_summaries(tmp_path):
    cfg = tiny_trainer_config(
        trainer_dir=str(tmp_path),
        max_step=40,
        save_every_n_steps=20,
        model=tiny_model_config(vocab_size=384),
        learner=adamw_learner_config(learning_rate=1e-2),
        input_cfg=_builtin_input("train", True),
    )
    cfg.evalers = {
        "validation": common.evaler_config(
            input_cfg=_builtin_input("validation", False), every_n_steps=20, max_step=40
        ).set(eval_dtype=None)
    }
    cfg.instantiate(parent=None).run()

    losses = losses_by_step(str(tmp_path))
    assert sorted(losses) == list(range(1, 41))
    last = np.mean([losses[s] for s in range(36, 41)])
    # Bytes of Python source: from about a uniform guess over 384 ids to a few bits per byte.
    assert losses[1] > math.log(384) - 0.5 and last < losses[1] - 2.5, (losses[1], last)
    assert _committed_steps(tmp_path) == [20, 40]
    train_summaries = tmp_path / "summaries" / "train"
    assert glob.glob(str(train_summaries / "events.out.tfevents.*"))
    eval_records = [
        json.loads(line)
        for line in open(tmp_path / "summaries" / "validation" / "metrics.jsonl", encoding="utf-8")
    ]
    assert [r["step"] for r in eval_records] == [20, 40]
    assert eval_records[-1]["loss"] < eval_records[0]["loss"]


class _Records(logging.Handler):
    """Collects log messages (caplog is per test; the fixtures below are per module)."""

    def __init__(self):
        super().__init__(level=logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(name="reference_run", scope="module")
def fixture_reference_run(tmp_path_factory):
    """An uninterrupted 6-step run: (trainer dir, its log messages, run()'s result)."""
    trainer_dir = str(tmp_path_factory.mktemp("reference"))
    cfg = tiny_trainer_config(trainer_dir=trainer_dir, max_step=6)
    cfg.peak_tflops_per_device = 1.0
    result, messages = _run_logged(cfg.instantiate(parent=None))
    return trainer_dir, messages, result


def _run_logged(trainer: SpmdTrainer) -> tuple[dict, list[str]]:
    """trainer.run()'s result, and the trainer's log messages while it ran."""
    logger, records = logging.getLogger("axlearn.common.trainer"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        result = trainer.run()
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return result, records.messages


def _train_in_two_runs(trainer_dir: str, *, save_input_iterator: bool, before_second_run=None):
    """Trains steps 1-3 (saved: the run's last step), then resumes and trains 4-6."""
    trainers = []
    for max_step in (3, 6):
        if max_step == 6 and before_second_run is not None:
            before_second_run()
        cfg = tiny_trainer_config(trainer_dir=trainer_dir, max_step=max_step)
        cfg.save_input_iterator = save_input_iterator
        trainers.append(cfg.instantiate(parent=None))
        trainers[-1].run()
    return trainers


@pytest.fixture(name="resumed_run", scope="module")
def fixture_resumed_run(tmp_path_factory):
    """The reference run interrupted after step 3; the second run may not initialize."""
    trainer_dir = str(tmp_path_factory.mktemp("resumed"))
    monkeypatch = pytest.MonkeyPatch()

    def no_init(self, prng_key):
        raise AssertionError("a resumed trainer must not initialize its state")

    try:
        trainers = _train_in_two_runs(
            trainer_dir,
            save_input_iterator=True,
            before_second_run=lambda: monkeypatch.setattr(SpmdTrainer, "init_state", no_init),
        )
    finally:
        monkeypatch.undo()
    return trainer_dir, trainers


@pytest.mark.slow
def test_rerun_in_the_same_directory_resumes_instead_of_reinitializing(resumed_run):
    trainer_dir, (first, second) = resumed_run
    assert first.step == 3 and second.step == 6
    # The first run wrote steps 1-3; the second continued with 4-6 (and never initialized).
    assert [r["step"] for r in read_metrics(trainer_dir)] == [1, 2, 3, 4, 5, 6]
    assert _committed_steps(trainer_dir) == [3, 6]


@pytest.mark.slow
def test_resumed_run_reproduces_the_uninterrupted_losses(reference_run, resumed_run):
    reference, resumed = losses_by_step(reference_run[0]), losses_by_step(resumed_run[0])
    assert resumed == reference  # Bit for bit, steps 1-6.


@pytest.mark.slow
def test_without_the_saved_input_position_a_resumed_run_replays_old_batches(
    reference_run, tmp_path
):
    _train_in_two_runs(str(tmp_path), save_input_iterator=False)
    reference, resumed = losses_by_step(reference_run[0]), losses_by_step(str(tmp_path))
    assert [resumed[s] for s in range(1, 4)] == [reference[s] for s in range(1, 4)]
    # Restarting the input feeds batches 1-3 again to the step-3 model: other losses.
    assert all(resumed[s] != reference[s] for s in range(4, 7))


# ----- non-finite losses -----


# ----- the train step compiled ahead -----


def _start_line(messages: list[str]) -> str:
    (line,) = [m for m in messages if m.startswith("Started in ")]
    return line


@pytest.fixture(name="first_step_compiled_run", scope="module")
def fixture_first_step_compiled_run(tmp_path_factory):
    """The reference run with its step compiled at the first step: (trainer dir, log)."""
    trainer_dir = str(tmp_path_factory.mktemp("compiled_at_first_step"))
    cfg = tiny_trainer_config(trainer_dir=trainer_dir, max_step=6).set(compile_ahead=False)
    _, messages = _run_logged(cfg.instantiate(parent=None))
    return trainer_dir, messages


@pytest.mark.slow
def test_a_step_compiled_ahead_trains_as_one_compiled_at_the_first_step(
    reference_run, first_step_compiled_run
):
    assert "(compiled ahead in " in _start_line(reference_run[1])
    assert "(compiled at the first step: " in _start_line(first_step_compiled_run[1])
    ahead = losses_by_step(reference_run[0])
    assert sorted(ahead) == list(range(1, 7))
    assert ahead == losses_by_step(first_step_compiled_run[0])


@pytest.mark.slow
def test_the_start_is_logged_once_naming_its_phases_in_order(reference_run):
    line = _start_line(reference_run[1])
    phases = re.findall(r"(?:: |, )([a-z][a-z() ]*?) \d+\.\d s", line)
    assert phases == [
        "process to trainer", "state (init)", "trackers and first batch", "train step ready",
        "first step",
    ], line


@pytest.mark.slow
def test_a_resumed_run_takes_the_step_compiled_ahead_for_its_restored_state(tmp_path):
    for max_step in (2, 4):
        cfg = tiny_trainer_config(trainer_dir=str(tmp_path), max_step=max_step)
        _, messages = _run_logged(cfg.instantiate(parent=None))
    line = _start_line(messages)
    assert "state (restore)" in line and "(compiled ahead in " in line, line
    assert not [m for m in messages if "does not fit" in m]


class _MisdescribedFakeLmInput(FakeLmInput):
    """FakeLmInput whose element_spec gives input_ids a dtype its batches lack (and that
    no step can be traced for: the thread's error is not the run's)."""

    def element_spec(self):
        spec = super().element_spec()
        spec["input_ids"] = jax.ShapeDtypeStruct((BATCH, SEQ_LEN), np.float32)
        return spec


@pytest.mark.slow
def test_a_batch_unlike_the_inputs_spec_compiles_at_the_first_step_naming_the_leaf(caplog):
    input_cfg = _MisdescribedFakeLmInput.default_config().set(
        is_training=True, global_batch_size=BATCH, max_sequence_length=SEQ_LEN, vocab_size=VOCAB
    )
    cfg = tiny_trainer_config(trainer_dir=None, max_step=2, input_cfg=input_cfg)
    trainer = cfg.instantiate(parent=None)
    with caplog.at_level(logging.INFO, logger="axlearn.common.trainer"):
        trainer.run()
    assert trainer.step == 2
    assert (
        "The train step compiled ahead does not fit, so it compiles again: the "
        "batch['input_ids'] is int32[8, 32], expected float32[8, 32]"
    ) in caplog.text
    assert "(compiled at the first step: " in caplog.text


def test_an_error_tracing_the_step_ahead_is_raised_by_run_as_at_the_first_step():
    errors = []
    for compile_ahead in (None, False):
        cfg = tiny_trainer_config(trainer_dir=None, max_step=2).set(
            per_device_microbatch_size=3, compile_ahead=compile_ahead
        )
        with pytest.raises(ConfigError) as error:
            cfg.instantiate(parent=None).run()
        errors.append(str(error.value))
    assert errors[0] == errors[1]
    assert "per_device_microbatch_size=3 does not divide the 8 rows" in errors[0]


@pytest.mark.parametrize(
    "bad_step", [pytest.param(4, marks=pytest.mark.slow), 5], ids=["at_a_save_step", "between_saves"]
)
def test_nonfinite_loss_stops_naming_the_step_and_keeps_the_last_checkpoint(tmp_path, bad_step):
    input_cfg = PoisonedFakeLmInput.default_config().set(
        is_training=True,
        global_batch_size=BATCH,
        max_sequence_length=SEQ_LEN,
        vocab_size=VOCAB,
        poisoned_batches=[bad_step - 1],  # Batch i is trained at step i + 1.
    )
    cfg = tiny_trainer_config(
        trainer_dir=str(tmp_path), max_step=8, save_every_n_steps=2, input_cfg=input_cfg
    )
    cfg.summary_writer.write_every_n_steps = 100  # Only saves force a check of the loss.
    with pytest.raises(NonFiniteLossError) as error:
        cfg.instantiate(parent=None).run()
    # With the bad step between saves (5), step 4 is saved and kept, but step 5 did not
    # train on it: it is judged bad, and the last good checkpoint is step 2 either way.
    last_good = 2
    message = str(error.value)
    assert f"at step {bad_step}" in message and f"checkpoint is step {last_good}" in message
    assert _committed_steps(tmp_path) == ([2] if bad_step == 4 else [2, 4])
    checkpointer = Checkpointer.default_config().set(
        name="checkpointer", dir=os.path.join(tmp_path, "checkpoints")
    ).instantiate(parent=None)
    verdicts = [checkpointer.verdict(step) for step in _committed_steps(tmp_path)]
    assert verdicts == ([True] if bad_step == 4 else [True, False])

    # The kept checkpoint is finite and restores: a rerun without the poison resumes there.
    trainer = tiny_trainer_config(trainer_dir=str(tmp_path), max_step=last_good).instantiate(
        parent=None
    )
    trainer.run()
    assert trainer.step == last_good
    for leaf in jax.tree.leaves(trainer.trainer_state.model):
        assert np.all(np.isfinite(np.asarray(leaf)))


@pytest.mark.slow
def test_learning_rate_override_that_overflows_parameters_stops_before_saving(tmp_path):
    cfg = tiny_trainer_config(trainer_dir=str(tmp_path), max_step=4, save_every_n_steps=1)
    # Updates of about 1e30 per weight: the squared parameter norm overflows float32.
    cfg = apply_overrides(cfg, ["learner.optimizer.learning_rate=1e30"])
    with pytest.raises(NonFiniteLossError, match="parameter norm became inf .* at step 1"):
        cfg.instantiate(parent=None).run()
    assert _committed_steps(tmp_path) == []


@pytest.mark.slow
def test_skip_and_clip_skips_a_nonfinite_step_with_a_warning_and_continues(tmp_path, caplog):
    input_cfg = PoisonedFakeLmInput.default_config().set(
        is_training=True,
        global_batch_size=BATCH,
        max_sequence_length=SEQ_LEN,
        vocab_size=VOCAB,
        poisoned_batches=[2],
    )
    cfg = tiny_trainer_config(
        trainer_dir=str(tmp_path),
        max_step=5,
        input_cfg=input_cfg,
        learner=adamw_learner_config(skip_non_finite=True),
    )
    with caplog.at_level(logging.WARNING, logger="axlearn.common.trainer"):
        cfg.instantiate(parent=None).run()
    assert any(
        "Step 3" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records
    ), caplog.text
    records = {r["step"]: r for r in read_metrics(str(tmp_path))}
    assert math.isnan(records[3]["loss"])
    assert all(math.isfinite(records[s]["loss"]) for s in (1, 2, 4, 5))
    assert records[3]["learner/skipped_steps"] == 1 and records[5]["learner/skipped_steps"] == 1
    # The skipped step left the parameters exactly as they were.
    assert records[3]["learner/parameter_norm"] == records[2]["learner/parameter_norm"]
    assert records[4]["learner/parameter_norm"] != records[3]["learner/parameter_norm"]
    assert _committed_steps(tmp_path) == [5]


def test_parameter_norm_is_reported_where_the_loop_logs_and_is_that_of_the_kept_state(tmp_path):
    cfg = tiny_trainer_config(trainer_dir=str(tmp_path), max_step=4)
    cfg.summary_writer.write_every_n_steps = 2
    trainer = cfg.instantiate(parent=None)
    trainer.run()
    records = {r["step"]: r for r in read_metrics(str(tmp_path))}
    assert sorted(records) == [2, 4]
    params = np.concatenate(
        [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(trainer.trainer_state.model)]
    )
    want = np.linalg.norm(params)
    np.testing.assert_allclose(records[4]["learner/parameter_norm"], want, rtol=1e-5)
    assert records[2]["learner/parameter_norm"] != records[4]["learner/parameter_norm"]


# ----- weight copies carried between steps -----


def test_cast_with_copies_takes_values_from_the_copies_and_gives_gradients_to_the_leaves():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 4)).astype(np.float32)
    scale = rng.normal(size=(4,)).astype(np.float32)
    c = rng.normal(size=(3, 4)).astype(np.float32)
    # A copy that is NOT the cast of w, to see which one the forward reads.
    copy = jnp.asarray(w + 1.0, jnp.bfloat16)

    def loss(params):
        cast = cast_floats_with_copies(params, {"w": copy, "scale": None}, jnp.bfloat16)
        assert cast["w"].dtype == cast["scale"].dtype == jnp.bfloat16
        return jnp.sum(cast["w"].astype(jnp.float32) ** 2 * c) + jnp.sum(
            cast["scale"].astype(jnp.float32)
        )

    value, grads = jax.value_and_grad(loss)({"w": jnp.asarray(w), "scale": jnp.asarray(scale)})
    used = np.asarray(copy, np.float32)
    bf16_scale = np.asarray(jnp.asarray(scale, jnp.bfloat16), np.float32)
    np.testing.assert_allclose(value, np.sum(used**2 * c) + np.sum(bf16_scale), rtol=1e-5)
    # d/dw of sum(w^2 c) at the value used, rounded to bf16 where the cast's transpose
    # carries it, and returned in the leaf's dtype.
    want = np.asarray(jnp.asarray(2 * used * c, jnp.bfloat16), np.float32)
    assert grads["w"].dtype == jnp.float32
    np.testing.assert_allclose(grads["w"], want, rtol=1e-2)
    np.testing.assert_array_equal(grads["scale"], np.ones(4, np.float32))


@pytest.mark.parametrize(
    "spec,x_shape,w_shape",
    [
        ("...i,io->...o", (2, 5, 6), (6, 4)),  # Linear
        ("...d,dnh->...nh", (2, 5, 6), (6, 3, 2)),  # MultiheadInputLinear
        ("...nh,dnh->...d", (2, 5, 3, 2), (6, 3, 2)),  # MultiheadOutputLinear
        ("...d,vd->...v", (2, 5, 6), (7, 6)),  # Embedding.attend
    ],
)
def test_weight_einsum_gives_a_float32_weight_its_gradient_unrounded(spec, x_shape, w_shape):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=x_shape), jnp.bfloat16)
    weight = jnp.asarray(rng.normal(size=w_shape), jnp.float32)
    copy = weight.astype(jnp.bfloat16)
    pair = WeightWithCopy(weight, copy)
    y, vjp = jax.vjp(lambda x_, w_: weight_einsum(spec, x_, WeightWithCopy(w_, copy)), x, weight)
    y_cast, vjp_cast = jax.vjp(lambda x_, w_: jnp.einsum(spec, x_, w_.astype(jnp.bfloat16)), x, weight)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_cast, np.float32))
    assert weight_einsum(spec, x, pair).dtype == jnp.bfloat16
    dy = jnp.asarray(rng.normal(size=y.shape), jnp.bfloat16)
    (dx, dw), (dx_cast, dw_cast) = vjp(dy), vjp_cast(dy)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_cast, np.float32))
    # NumPy's float64 sum of the bf16 operands' products over every axis but the weight's
    # (the leading '...' axes flattened into one, z).
    x_axes, w_axes = spec.replace("...", "z").split("->")[0].split(",")
    out_axes = spec.replace("...", "z").split("->")[1]
    x64 = np.asarray(x, np.float64).reshape((-1,) + x.shape[len(x_shape) - len(x_axes) + 1 :])
    dy64 = np.asarray(dy, np.float64).reshape((-1,) + dy.shape[dy.ndim - len(out_axes) + 1 :])
    want = np.einsum(f"{x_axes},{out_axes}->{w_axes}", x64, dy64)
    assert dw.dtype == jnp.float32
    np.testing.assert_allclose(dw, want, rtol=1e-6, atol=1e-6)
    # Through the cast the same gradient is rounded to bf16 on its way.
    assert np.max(np.abs(np.asarray(dw_cast) - want)) > 100 * np.max(np.abs(np.asarray(dw) - want))


def test_weight_take_reads_the_copy_and_gives_the_weight_the_rows_gradients():
    weight = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 7
    copy = (weight + 1).astype(jnp.bfloat16)  # NOT the cast, to see which one is read.
    ids = jnp.asarray([[1, 3, 1]])
    rows, vjp = jax.vjp(lambda w: weight_take(WeightWithCopy(w, copy), ids), weight)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(copy)[np.asarray(ids)])
    (dw,) = vjp(jnp.ones_like(rows))
    assert dw.dtype == jnp.float32
    np.testing.assert_array_equal(dw[:, 0], [0.0, 2.0, 0.0, 1.0])


def test_weight_take_sums_a_float32_weight_s_row_gradients_unrounded():
    # 2,048 lookups of 4 rows: each row's gradient sums ~500 bf16 cotangents.
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 4, size=(4, 512)))
    weight = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    copy = weight.astype(jnp.bfloat16)
    dy = jnp.asarray(rng.normal(size=(4, 512, 16)), jnp.bfloat16)
    _, vjp = jax.vjp(lambda w: weight_take(WeightWithCopy(w, copy), ids), weight)
    _, vjp_cast = jax.vjp(lambda w: jnp.take(w.astype(jnp.bfloat16), ids, axis=0), weight)
    (dw,), (dw_cast,) = vjp(dy), vjp_cast(dy)
    want = np.zeros(weight.shape)
    np.add.at(want, np.asarray(ids).reshape(-1), np.asarray(dy, np.float64).reshape(-1, 16))
    assert dw.dtype == jnp.float32
    np.testing.assert_allclose(dw, want, rtol=1e-5, atol=1e-5)
    # Through the cast the rows are summed in bf16.
    assert np.max(np.abs(np.asarray(dw_cast) - want)) > 100 * np.max(np.abs(np.asarray(dw) - want))


def _bf16_trainer_config(trainer_dir, *, max_step, carry):
    """carry: None, True (carried copies) or "split" (carried copies, split weights)."""
    cfg = tiny_trainer_config(trainer_dir=trainer_dir, max_step=max_step)
    cfg.train_dtype = jnp.bfloat16
    cfg.carry_train_dtype_weights = None if carry is None else True
    if carry == "split":
        cfg.split_carried_weights = True
    return cfg


@pytest.fixture(name="bf16_runs", scope="module")
def fixture_bf16_runs(tmp_path_factory):
    """Five bf16 steps without carried weight copies, with them, and with the weights split:
    {carry: (dir, trainer)}."""
    runs = {}
    for carry in (None, True, "split"):
        trainer_dir = str(tmp_path_factory.mktemp(f"bf16_carry_{carry}"))
        trainer = _bf16_trainer_config(trainer_dir, max_step=5, carry=carry).instantiate(
            parent=None
        )
        trainer.run()
        runs[carry] = (trainer_dir, trainer)
    return runs


@pytest.mark.slow
def test_carried_weight_copies_train_bit_for_bit_like_casting_every_step(bf16_runs):
    (cast_dir, cast_trainer), (carry_dir, carry_trainer) = bf16_runs[None], bf16_runs[True]
    assert losses_by_step(carry_dir) == losses_by_step(cast_dir)
    for a, b in zip(
        jax.tree.leaves(carry_trainer.trainer_state.model),
        jax.tree.leaves(cast_trainer.trainer_state.model),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert cast_trainer.trainer_state.weight_copies is None


@pytest.mark.slow
@pytest.mark.parametrize("carry", [None, True])
def test_bf16_microbatches_give_weights_float32_gradients_that_match_the_whole_batch(carry):
    # pylint: disable=protected-access
    cfg = _bf16_trainer_config(None, max_step=1, carry=carry)
    trainer = cfg.instantiate(parent=None, devices=jax.devices()[:1])
    trainer._restore_or_init()
    state = trainer.trainer_state
    batch = trainer.global_batch(next(iter(trainer.input)))
    params = trainer._weight_copies.train_dtype_params(
        state.model, state.weight_copies, float32_weight_grads=True
    )
    by_path = dict(flatten_with_paths(params, is_leaf=lambda x: isinstance(x, WeightWithCopy)))
    assert isinstance(by_path["decoder/emb/token_emb/weight"], WeightWithCopy)
    assert all(x.dtype == jnp.bfloat16 for p, x in by_path.items() if p.endswith("scale"))

    @functools.partial(jax.jit, static_argnums=0)  # As in a train step; eager is slower.
    def gradients(k, model, weight_copies, batch):
        loss_fn = functools.partial(
            trainer._loss_fn, weight_copies=weight_copies, float32_weight_grads=k > 1
        )
        key = jax.random.PRNGKey(1)
        return trainer.learner.compute_gradients(loss_fn, model, batch, key, num_microbatches=k)

    (loss_1, _, grads_1), (loss_4, _, grads_4) = (
        gradients(k, state.model, state.weight_copies, batch) for k in (1, 4)
    )
    np.testing.assert_allclose(loss_4, loss_1, rtol=1e-2)
    grads_1 = dict(flatten_with_paths(grads_1))
    for path, g4 in flatten_with_paths(grads_4):
        g1 = grads_1[path]
        assert g4.dtype == jnp.float32
        # Not equal: bf16 passes over other row groups, and the mean over live tokens taken
        # per microbatch. A wrong matmul gradient would be off by far more.
        rel = np.linalg.norm(np.asarray(g4) - np.asarray(g1)) / np.linalg.norm(np.asarray(g1))
        is_matrix = isinstance(by_path[path], WeightWithCopy)  # Norm scales: small sums.
        assert rel < (0.02 if is_matrix else 0.1), (path, rel)


def _assert_copies_are_the_weights_cast(state) -> dict:
    """Checks that each copy equals its parameter cast to bf16; returns the copies by path."""
    params = dict(flatten_with_paths(state.model))
    copies = dict(flatten_with_paths(state.weight_copies))
    assert copies
    for path, copy in copies.items():
        assert copy.dtype == jnp.bfloat16
        want = np.asarray(params[path]).astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(copy), want)
    return copies


@pytest.mark.slow
def test_carried_copies_are_the_weights_cast_and_norm_scales_have_none(bf16_runs):
    state = bf16_runs[True][1].trainer_state
    copies = _assert_copies_are_the_weights_cast(state)
    # The weights of matrix products and the embedding; no norm scale.
    assert "decoder/emb/token_emb/weight" in copies
    assert any(path.endswith("qkv_proj/weight") for path in copies)
    params = dict(flatten_with_paths(state.model))
    assert {p for p in params if not p.endswith("scale")} == set(copies)


@pytest.mark.slow
def test_a_resumed_run_rebuilds_the_copies_it_does_not_checkpoint(bf16_runs, tmp_path):
    # pylint: disable=protected-access
    trainer_dir = str(tmp_path)
    for max_step in (3, 5):
        trainer = _bf16_trainer_config(trainer_dir, max_step=max_step, carry=True).instantiate(
            parent=None
        )
        assert set(trainer._state_template()) == {"prng_key", "model", "learner"}
        if max_step == 5:
            trainer._restore_or_init()
            assert trainer.step == 3
            _assert_copies_are_the_weights_cast(trainer.trainer_state)
        trainer.run()
    assert losses_by_step(trainer_dir) == losses_by_step(bf16_runs[True][0])


def _nudge_ties(x: jax.Array) -> jax.Array:
    """float32 `x` with each value halfway between two bf16 values moved up one float32 ulp,
    where splitting and casting could round it differently."""
    bits = np.asarray(x).view(np.uint32)
    return jnp.asarray(np.where(bits & 0xFFFF == 0x8000, bits + 1, bits).view(np.float32))


@pytest.mark.slow
def test_a_step_on_split_weights_is_the_step_on_carried_copies_bit_for_bit():
    # pylint: disable=protected-access
    carried = _bf16_trainer_config(None, max_step=1, carry=True).instantiate(parent=None)
    split = _bf16_trainer_config(None, max_step=1, carry="split").instantiate(parent=None)
    carried._restore_or_init()
    state = carried.trainer_state
    params = jax.tree.map(_nudge_ties, state.model)
    # Each trainer makes its carried state from the same float32 parameters and steps it
    # with the program its runs compile. That step donates its state, so the split one
    # gets its own copy of the learner's.
    carried_state = carried._carried(dataclasses.replace(state, model=params))
    assert carried_state.weight_low_bits is None
    split_state = split._carried(dataclasses.replace(jax.tree.map(jnp.copy, state), model=params))
    assert split_state.weight_low_bits is not None
    batch = carried.global_batch(next(iter(carried.input)))
    with jax.set_mesh(carried.mesh):
        want, want_summaries = carried._compile_train_step()(carried_state, batch)
        got, got_summaries = split._compile_train_step()(split_state, batch)
        got_params = dict(flatten_with_paths(jax.jit(split._joined_params)(got)))
    assert float(got_summaries["loss"]) == float(want_summaries["loss"])
    for path, x in flatten_with_paths(want.model):
        np.testing.assert_array_equal(np.asarray(got_params[path]), np.asarray(x))
    # The new copies equal the new weights' casts except at the new weights' ties.
    for path, copy in flatten_with_paths(got.weight_copies):
        x = np.asarray(got_params[path])
        tie = x.view(np.uint32) & 0xFFFF == 0x8000
        np.testing.assert_array_equal(
            np.asarray(copy)[~tie], np.asarray(x.astype(jnp.bfloat16))[~tie]
        )


@pytest.mark.slow
def test_split_state_holds_each_weight_as_its_copy_and_low_bits(bf16_runs):
    trainer = bf16_runs["split"][1]
    state = trainer.trainer_state
    params = dict(flatten_with_paths(trainer.model_params()))
    copies = dict(flatten_with_paths(state.weight_copies))
    lows = dict(flatten_with_paths(state.weight_low_bits))
    kept = dict(flatten_with_paths(state.model))
    assert copies.keys() == lows.keys() == {p for p in params if not p.endswith("scale")}
    assert set(kept) == {p for p in params if p.endswith("scale")}  # No weight kept whole.
    for path, copy in copies.items():
        x = np.asarray(params[path])
        assert copy.dtype == jnp.bfloat16 and lows[path].dtype == jnp.int16
        # The copy is the weight's cast but at ties (tests/test_split_float.py has those).
        tie = x.view(np.uint32) & 0xFFFF == 0x8000
        np.testing.assert_array_equal(
            np.asarray(copy)[~tie], np.asarray(x.astype(jnp.bfloat16))[~tie]
        )


@pytest.mark.slow
def test_a_split_checkpoint_holds_float32_weights_any_trainer_restores(bf16_runs, tmp_path):
    # pylint: disable=protected-access
    trainer_dir = str(tmp_path)
    split = _bf16_trainer_config(trainer_dir, max_step=3, carry="split").instantiate(parent=None)
    assert set(split._state_template()) == {"prng_key", "model", "learner"}
    split.run()
    want = dict(flatten_with_paths(split.model_params()))
    for carry in (None, True):
        other = _bf16_trainer_config(trainer_dir, max_step=5, carry=carry).instantiate(parent=None)
        other._restore_or_init()
        assert other.step == 3
        got = dict(flatten_with_paths(other.trainer_state.model))
        assert got.keys() == want.keys()
        for path, x in got.items():
            np.testing.assert_array_equal(np.asarray(x), np.asarray(want[path]))
    # Resumed as split, the run goes on as the one that never stopped.
    resumed = _bf16_trainer_config(trainer_dir, max_step=5, carry="split").instantiate(parent=None)
    resumed.run()
    assert losses_by_step(trainer_dir) == losses_by_step(bf16_runs["split"][0])
    whole = bf16_runs["split"][1]
    for a, b in zip(jax.tree.leaves(resumed.model_params()), jax.tree.leaves(whole.model_params())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_split_weights_join_once_only_at_steps_that_evaluate_or_save(tmp_path, monkeypatch):
    # The loop asks for the evalers every step; joining the weights there would write every
    # weight as float32 each step.
    cfg = _bf16_trainer_config(str(tmp_path), max_step=6, carry="split")
    eval_input = cfg.input.clone(is_training=False)
    cfg.evalers = {
        name: common.evaler_config(input_cfg=eval_input, every_n_steps=3, max_step=6)
        for name in ("first", "second")
    }
    trainer = cfg.instantiate(parent=None)
    joined, joined_at = trainer.model_params, []

    def counted_model_params():
        joined_at.append(trainer.step)
        return joined()

    monkeypatch.setattr(trainer, "model_params", counted_model_params)
    trainer.run()
    # Steps 3 and 6 evaluate (both evalers from one join), and step 6 saves from that join.
    assert joined_at == [3, 6]
    assert _committed_steps(tmp_path) == [6]


@pytest.mark.slow
def test_parameter_norm_of_a_split_state_is_that_of_its_float32_weights(bf16_runs):
    trainer = bf16_runs["split"][1]
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(trainer.model_params())]
    want = math.sqrt(sum(float(np.sum(x * x)) for x in leaves))
    np.testing.assert_allclose(float(trainer.parameter_norm()), want, rtol=1e-6)


@pytest.mark.parametrize(
    "fields",
    [
        dict(carry_train_dtype_weights=None),
        dict(train_dtype=jnp.float16),
    ],
)
def test_splitting_weights_needs_carried_bfloat16_copies(fields):
    cfg = _bf16_trainer_config(None, max_step=1, carry="split").set(**fields)
    with pytest.raises(ConfigError, match="split_carried_weights needs carry_train_dtype_weights"):
        cfg.instantiate(parent=None)


def test_splitting_weights_other_than_float32_names_the_first():
    cfg = _bf16_trainer_config(None, max_step=1, carry="split")
    cfg.model.dtype = jnp.float16
    with pytest.raises(
        ConfigError, match="splits float32 weights only; model parameter decoder/emb/token_emb/"
    ):
        cfg.instantiate(parent=None)


def test_carrying_weight_copies_needs_a_train_dtype():
    cfg = tiny_trainer_config(trainer_dir=None).set(train_dtype=None, carry_train_dtype_weights=True)
    with pytest.raises(ConfigError, match="carry_train_dtype_weights needs a train_dtype"):
        cfg.instantiate(parent=None)


# ----- the mesh -----


def test_one_minus_one_in_the_mesh_shape_is_inferred():
    assert infer_mesh_shape((1, -1, 1, 2, 1, 1), 8) == (1, 4, 1, 2, 1, 1)
    assert infer_mesh_shape((2, 4), 8) == (2, 4)
    cfg = tiny_trainer_config(trainer_dir=None, mesh=dict(data=-1))
    trainer = cfg.instantiate(parent=None)
    assert dict(trainer.mesh.shape) == dict(pipeline=1, data=1, expert=1, fsdp=1, seq=1, model=1)


@pytest.mark.parametrize(
    "shape,num_devices,expected",
    [
        ((3, -1), 8, "cannot cover 8 devices"),
        ((2, 2), 8, "needs 4 devices, but 8 are available"),
        ((-1, -1), 8, "more than one -1"),
        ((0, -1), 8, "invalid entries"),
    ],
)
def test_impossible_mesh_shape_fails_naming_the_device_count(shape, num_devices, expected):
    with pytest.raises(ConfigError, match=expected):
        infer_mesh_shape(shape, num_devices)


def test_trainer_with_a_mesh_too_big_for_its_devices_names_the_device_count():
    cfg = tiny_trainer_config(trainer_dir=None, mesh=dict(data=2, fsdp=4))
    with pytest.raises(ConfigError, match="needs 8 devices, but 1 are available"):
        cfg.instantiate(parent=None, devices=jax.devices()[:1])


def test_mesh_axis_names_and_mesh_shape_of_different_lengths_are_rejected():
    cfg = tiny_trainer_config(trainer_dir=None).set(mesh_shape=(1, -1), mesh_axis_names=("data",))
    with pytest.raises(ConfigError, match=r"mesh_shape \(1, -1\) and mesh_axis_names \('data',\)"):
        cfg.instantiate(parent=None)


@pytest.mark.parametrize(
    "microbatch,expected", [(None, 1), (1, 8), (2, 4), (8, 1), (64, 1)]
)
def test_per_device_microbatch_size_sets_the_microbatch_count(microbatch, expected):
    cfg = tiny_trainer_config(trainer_dir=None).set(per_device_microbatch_size=microbatch)
    trainer = cfg.instantiate(parent=None, devices=jax.devices()[:1])
    assert trainer.num_microbatches(BATCH) == expected


@pytest.mark.slow
def test_the_microbatch_count_is_logged_once_when_the_step_is_traced(caplog):
    cfg = tiny_trainer_config(trainer_dir=None, max_step=3).set(per_device_microbatch_size=2)
    trainer = cfg.instantiate(parent=None, devices=jax.devices()[:1])
    message = "Each step accumulates gradients over 4 microbatches of 2 rows a device"
    with caplog.at_level(logging.INFO, logger="axlearn.common.trainer"):
        assert trainer.num_microbatches(BATCH) == 4  # Asking for the count logs nothing.
        assert message not in caplog.text
        trainer.run()
    assert caplog.text.count(message) == 1


def test_per_device_microbatch_size_that_does_not_divide_the_share_names_both():
    cfg = tiny_trainer_config(trainer_dir=None).set(per_device_microbatch_size=3)
    trainer = cfg.instantiate(parent=None, devices=jax.devices()[:1])
    message = (
        r"trainer.per_device_microbatch_size=3 does not divide the 8 rows a device gets of a "
        r"global batch of 8 over 1 batch shards; change it or input.global_batch_size"
    )
    with pytest.raises(ConfigError, match=message):
        trainer.num_microbatches(BATCH)


def test_evalers_take_the_trainers_microbatch_size_unless_they_set_their_own():
    cfg = tiny_trainer_config(trainer_dir=None).set(per_device_microbatch_size=2)
    eval_input = _builtin_input("validation", False)
    cfg.evalers = {
        "inherits": common.evaler_config(input_cfg=eval_input, every_n_steps=1, max_step=6),
        "own": common.evaler_config(input_cfg=eval_input, every_n_steps=1, max_step=6).set(
            per_device_microbatch_size=4
        ),
    }
    trainer = cfg.instantiate(parent=None)
    assert trainer.inherits.config.per_device_microbatch_size == 2
    assert trainer.own.config.per_device_microbatch_size == 4


@pytest.mark.parametrize("microbatch", [0, -1, 2.0])
def test_per_device_microbatch_size_must_be_a_positive_int(microbatch):
    cfg = tiny_trainer_config(trainer_dir=None).set(per_device_microbatch_size=microbatch)
    with pytest.raises(ConfigError, match="trainer.per_device_microbatch_size must be None or"):
        cfg.instantiate(parent=None)


@pytest.mark.slow
def test_meshes_of_eight_and_four_devices_match_one_device(tmp_path):
    script = os.path.join(TESTS_DIR, "trainer_script.py")
    subprocess.run(
        [sys.executable, script, "mesh", str(tmp_path)],
        env=fresh_env(devices=8), check=True, timeout=300,
    )
    with open(tmp_path / "results.json", encoding="utf-8") as f:
        results = json.load(f)
    assert results["single"]["mesh"]["fsdp"] == 1 and results["single"]["mesh"]["data"] == 1
    assert results["sharded"]["mesh"] == dict(pipeline=1, data=2, expert=1, fsdp=4, seq=1, model=1)
    single, sharded = results["single"]["losses"], results["sharded"]["losses"]
    assert len(single) == len(sharded) == 4
    np.testing.assert_allclose(sharded, single, rtol=1e-5, atol=1e-5)
    assert single[-1] != single[0]  # The steps trained something.
    # Carried weight copies on the sharded mesh: the same steps as casting every step,
    # each copy sharded like its parameter.
    assert results["sharded_bf16_carried"]["losses"] == results["sharded_bf16"]["losses"]
    copy_specs = results["sharded_bf16_carried"]["copy_specs"]
    assert copy_specs and all(copy == param for copy, param in copy_specs)
    assert any("fsdp" in copy for copy, _ in copy_specs)
    # Split weights on the same mesh: their halves sharded like the parameters, and the
    # steps near those of the unsplit copies (a weight at a tie rounds the other way).
    split = results["sharded_bf16_split"]
    assert split["copy_specs"] == copy_specs
    # (Which sends tiny bf16 runs apart by ~4e-4 in a few steps; a wrong join, by far more.)
    np.testing.assert_allclose(
        split["losses"], results["sharded_bf16_carried"]["losses"], rtol=5e-3
    )
    # Two rows a device in microbatches of one: the same steps as the whole batch at once.
    microbatched = results["microbatched"]
    assert microbatched["num_microbatches"] == 2 and results["single"]["num_microbatches"] == 1
    np.testing.assert_allclose(microbatched["losses"], single, rtol=1e-5, atol=1e-5)
    # The batch over two axes and the heads over a third (`sharding.gathered_for_matmul`).
    three_axes = results["data_fsdp_model"]
    assert three_axes["mesh"] == dict(pipeline=1, data=2, expert=1, fsdp=2, seq=1, model=2)
    np.testing.assert_allclose(three_axes["losses"], single, rtol=1e-5, atol=1e-5)


_INDIVISIBLE_MESH_SCRIPT = """
import pytest
from axlearn.common.config import ConfigError
from tests.trainer_script import tiny_trainer_config

# 4 heads cannot be split over model=8: the error names the parameter and the mesh.
cfg = tiny_trainer_config(trainer_dir=None, mesh=dict(model=8))
with pytest.raises(ConfigError) as e:
    cfg.instantiate(parent=None)
message = str(e.value)
assert "trainer.mesh_shape (1, 1, 1, 1, 1, 8)" in message, message
assert "attention/o_proj/weight of shape (2, 32, 4, 8)" in message, message
assert "dim 2 (4) over model (8 parts)" in message, message
print("OK")
"""


@pytest.mark.slow
def test_a_mesh_that_cannot_split_a_parameter_is_a_config_error_naming_it():
    assert_prints_ok(_INDIVISIBLE_MESH_SCRIPT, devices=8)


def test_batches_are_read_in_a_thread_and_put_on_devices_in_the_dispatching_one(
    tmp_path, monkeypatch
):
    # Device memory taken from a reading thread splits the GPU allocator's pool: placement
    # must stay in run()'s thread.
    cfg = tiny_trainer_config(trainer_dir=str(tmp_path), max_step=3)
    trainer = cfg.instantiate(parent=None)
    read_in, placed_in = set(), []
    dataset, global_batch = trainer.input.dataset, trainer.global_batch

    def reading():
        for batch in dataset():
            read_in.add(threading.current_thread())
            yield batch

    def placing(batch):
        placed_in.append(threading.current_thread())
        return global_batch(batch)

    monkeypatch.setattr(trainer.input, "dataset", reading)
    monkeypatch.setattr(trainer, "global_batch", placing)
    trainer.run()
    assert threading.current_thread() not in read_in
    assert placed_in == [threading.current_thread()] * 3


# ----- profiling and the progress line -----


@pytest.mark.slow
def test_profiler_writes_a_trace_for_the_configured_steps(tmp_path, caplog):
    cfg = tiny_trainer_config(trainer_dir=str(tmp_path), max_step=4)
    cfg.start_trace_steps = [1]
    cfg.start_trace_num_steps = 2
    with caplog.at_level(logging.INFO, logger="axlearn.common.trainer"):
        cfg.instantiate(parent=None).run()
    traces = glob.glob(str(tmp_path / "traces" / "**" / "*.xplane.pb"), recursive=True)
    assert len(traces) == 1, os.listdir(tmp_path)
    assert "Tracing steps 2-3 into" in caplog.text and "Stopped trace at step 3" in caplog.text


def test_no_trace_starts_on_processes_not_listed(tmp_path):
    cfg = tiny_trainer_config(trainer_dir=str(tmp_path), max_step=2)
    cfg.start_trace_steps = [0]
    cfg.start_trace_process_indices = [jax.process_index() + 1]
    trainer = cfg.instantiate(parent=None)
    assert trainer.step == 0
    assert trainer._maybe_trace(None) is None  # pylint: disable=protected-access
    assert not (tmp_path / "traces").exists()


@pytest.mark.slow
def test_progress_line_shows_every_column_and_mfu_when_the_peak_is_known(reference_run):
    _, messages, result = reference_run
    lines = [m for m in messages if m.startswith("step 6/6")]
    assert len(lines) == 1, messages
    line = lines[0]
    columns = ("loss ", "lr ", "gnorm ", " s/step", " tok/s/dev", " TFLOP/s/dev", "MFU ", "mem ")
    for column in columns:
        assert column in line, (column, line)
    assert f"loss {result['loss']:.4f}" in line
    # Peak 1 TFLOP/s: MFU is the TFLOP/s/device itself.
    assert math.isclose(result["perf/mfu"], result["perf/tflops_per_device"], rel_tol=1e-12)


def test_progress_line_leaves_out_mfu_when_the_peak_is_unknown():
    summaries = {
        "loss": 2.5,
        "learner/learning_rate": 1e-3,
        "learner/gradient_norm": 0.5,
        "perf/step_time_s": 0.25,
        "perf/tokens_per_s_per_device": 1024.0,
        "perf/tflops_per_device": 12.5,
        "perf/peak_memory_gib": 3.25,
    }
    line = perf.progress_line(7, 100, summaries)
    assert line == (
        "step   7/100 | loss 2.5000 | lr 1.000e-03 | gnorm 0.500 | 0.250 s/step | eta 23s | "
        "1,024 tok/s/dev | 12.5 TFLOP/s/dev | mem 3.2 GiB"
    )


# ----- performance accounting -----


def _hand_counts(*, dim, layers, heads, kv_heads, hidden, vocab, tied=True) -> tuple[int, int]:
    """(all, matmul) parameters of model_config's GPT, counted from its architecture."""
    head_dim = dim // heads
    qkv = dim * (heads + 2 * kv_heads) * head_dim
    out = heads * head_dim * dim
    mlp = 2 * dim * hidden + hidden * dim  # Gated: two input projections, one output.
    norms = dim + dim + head_dim + head_dim  # Attention and MLP pre-norms, QK-norms.
    matmul = layers * (qkv + out + mlp) + vocab * dim  # The tied table is the LM head.
    total = layers * (qkv + out + mlp + norms) + vocab * dim + dim  # + output norm.
    if not tied:
        matmul, total = matmul + vocab * dim, total + vocab * dim
    return total, matmul


@pytest.mark.parametrize("stack", ["stack", "repeat"])
def test_tree_size_of_the_parameter_specs_matches_a_hand_count(stack):
    sizes = dict(dim=32, num_layers=3, num_heads=4, num_kv_heads=2, hidden_dim=48, vocab_size=96)
    model = tiny_model_config(**sizes, stack=stack).set(name="model").instantiate(parent=None)
    total, _ = _hand_counts(dim=32, layers=3, heads=4, kv_heads=2, hidden=48, vocab=96)
    assert perf.tree_size(model.create_parameter_specs_recursively()) == total


def test_step_accounting_turns_a_step_time_into_the_standard_columns():
    trainer = tiny_trainer_config(trainer_dir=None).instantiate(parent=None)
    accounting = perf.StepAccounting.for_trainer(trainer)
    total, matmul = _hand_counts(dim=32, layers=2, heads=4, kv_heads=2, hidden=64, vocab=VOCAB)
    tokens = BATCH * SEQ_LEN
    assert accounting.num_params == total
    assert accounting.tokens_per_step == tokens
    # DESIGN.md: 6 FLOPs per matmul parameter (forward 2, backward 4) plus causal attention,
    # QK^T and AV over half the sequence: 2 * 2 * (seq/2) * d_model forward, x3 with backward.
    attention = 3 * (2 * 2 * (SEQ_LEN // 2) * 32)
    assert accounting.flops_per_step == tokens * (6 * matmul + 2 * attention)
    accounting.peak_tflops_per_device = 2e-6
    metrics = accounting.metrics(0.5)
    assert metrics["perf/tokens_per_s_per_device"] == tokens / 0.5
    assert math.isclose(metrics["perf/tflops_per_device"], accounting.flops_per_step / 0.5 / 1e12)
    assert math.isclose(metrics["perf/mfu"], metrics["perf/tflops_per_device"] / 2e-6)
    assert metrics["perf/peak_memory_gib"] > 0  # CPU: the process's peak resident set.


class _UncountedModel(causal_lm.Model):
    """A model that cannot count its FLOPs."""

    def model_flops_per_token(self, seq_len: int) -> None:
        del seq_len


def test_a_model_without_a_flops_count_trains_and_reports_no_tflops_or_mfu():
    cfg = tiny_trainer_config(trainer_dir=None, max_step=2)
    cfg.model.klass = _UncountedModel
    cfg.peak_tflops_per_device = 1.0
    result = cfg.instantiate(parent=None).run()
    assert "perf/tflops_per_device" not in result and "perf/mfu" not in result
    assert result["perf/tokens_per_s_per_device"] > 0
    assert "- TFLOP/s/dev" in perf.progress_line(2, 2, result)


def test_a_model_without_the_method_counts_no_flops():
    assert perf.model_flops_per_token(object(), seq_len=32) is None


def test_peak_tflops_are_known_for_hopper_gpus_and_unknown_for_cpus():
    class FakeDevice:  # pylint: disable=too-few-public-methods
        device_kind = "NVIDIA H100 80GB HBM3"

    assert perf.peak_tflops(FakeDevice()) == 989.0
    assert perf.peak_tflops(jax.devices("cpu")[0]) is None

