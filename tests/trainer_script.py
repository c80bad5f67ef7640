"""Tiny trainer configs for the trainer tests, and a subprocess entry point.

`tiny_trainer_config` builds an SpmdTrainer config small enough to compile and train in
seconds on a CPU: a 2-layer GPT from `axlearn.experiments.text.gpt.common.model_config`,
AdamW (optionally under skip_and_clip_by_global_norm), and FakeLmInput batches.

    python tests/trainer_script.py mesh OUT_DIR

trains the same config for a few steps on one device and on an 8-device mesh with
fsdp=4 and data=2 (the caller sets XLA_FLAGS for 8 fake CPU devices), and on that mesh
in bf16 with and without carried weight copies; on a data=2, fsdp=2 mesh of 4 devices in
microbatches of one row a device; and on a data=2, fsdp=2, model=2 mesh (one that XLA
partitions wrong unless the weights are gathered before their matmuls). It writes the
runs' meshes, microbatch counts, per-step losses and the copies' sharding specs to
OUT_DIR/results.json.
"""

import json
import os
import sys
from collections.abc import Sequence
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
import jax.numpy as jnp

from axlearn.common.checkpointer import Checkpointer, every_n_steps_policy
from axlearn.common.config import config_class, config_for_function
from axlearn.common.input_base import Batch
from axlearn.common.input_fake import FakeLmInput
from axlearn.common.learner import Learner
from axlearn.common.optimizers import adamw_optimizer, skip_and_clip_by_global_norm
from axlearn.common.summary_writer import SummaryWriter
from axlearn.common.trainer import SpmdTrainer
from axlearn.experiments.text.gpt import common

VOCAB = 128
SEQ_LEN = 32
BATCH = 8
DIM = 32


class PoisonedFakeLmInput(FakeLmInput):
    """FakeLmInput whose batches at `poisoned_batches` hold an out-of-vocabulary token.

    The embedding lookup (jnp.take, mode 'fill') returns NaN for it, so that batch's loss
    and gradients are NaN while every other batch is untouched.
    """

    @config_class
    class Config(FakeLmInput.Config):
        """Configures PoisonedFakeLmInput."""

        poisoned_batches: Sequence[int] = ()  # Global batch indices (0-based) to poison.

    def host_batch(self, step: int) -> Batch:
        batch = super().host_batch(step)
        cfg = self.config
        if step in cfg.poisoned_batches:
            batch["input_ids"] = batch["input_ids"].copy()
            batch["input_ids"][0, 0] = cfg.vocab_size
        return batch


def tiny_model_config(**kwargs) -> Any:
    """A 2-layer GPT (dim 32, 4 heads, 2 KV heads) over a 128-token vocabulary."""
    settings = dict(
        dim=DIM, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=64, vocab_size=VOCAB
    )
    settings.update(kwargs)
    return common.model_config(**settings)


def adamw_learner_config(learning_rate: float = 3e-3, skip_non_finite: bool = False) -> Any:
    optimizer = config_for_function(adamw_optimizer).set(learning_rate=learning_rate)
    if skip_non_finite:
        optimizer = config_for_function(skip_and_clip_by_global_norm).set(
            inner=optimizer, drop_norm=None, max_norm=None
        )
    return Learner.default_config().set(optimizer=optimizer)


def tiny_trainer_config(
    *,
    trainer_dir: Optional[str],
    max_step: int = 6,
    mesh: Optional[dict[str, int]] = None,
    input_cfg: Optional[Any] = None,
    save_every_n_steps: int = 1000,
    learner: Optional[Any] = None,
    model: Optional[Any] = None,
) -> SpmdTrainer.Config:
    """An SpmdTrainer config that trains the tiny model on fake batches in float32.

    `mesh`: axis sizes for `mesh_shape_from_axes` (default: everything on fsdp, -1).
    Summaries are written every step, so metrics.jsonl holds every step's loss.
    """
    cfg = SpmdTrainer.default_config().set(
        name="trainer",
        dir=trainer_dir,
        model=model or tiny_model_config(),
        learner=learner or adamw_learner_config(),
        input=input_cfg
        or FakeLmInput.default_config().set(
            is_training=True, global_batch_size=BATCH, max_sequence_length=SEQ_LEN, vocab_size=VOCAB
        ),
        max_step=max_step,
        # float32 end to end: bf16 is slow on CPU and the tests compare numerics.
        train_dtype=jnp.float32,
        mesh_shape=common.mesh_shape_from_axes(**(mesh or dict(fsdp=-1))),
        mesh_axis_names=common.MESH_AXIS_NAMES,
        batch_axis_names=common.BATCH_AXIS_NAMES,
        save_input_iterator=True,
        checkpointer=Checkpointer.default_config().set(
            save_policy=config_for_function(every_n_steps_policy).set(n=save_every_n_steps),
            keep_last_n=10,
        ),
        summary_writer=SummaryWriter.default_config().set(write_every_n_steps=1),
    )
    return cfg


def read_metrics(trainer_dir: str) -> list[dict[str, Any]]:
    """The training metrics.jsonl records, in order."""
    path = os.path.join(trainer_dir, "summaries", "train", "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def losses_by_step(trainer_dir: str) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in read_metrics(trainer_dir)}


def _mesh_main(out_dir: str) -> None:
    import jax  # pylint: disable=import-outside-toplevel

    assert jax.device_count() == 8, jax.devices()
    results = {}
    sharded = dict(data=2, fsdp=4)
    for name, mesh, devices, carry in (
        ("single", {}, jax.devices()[:1], None),
        ("sharded", sharded, None, None),
        ("sharded_bf16", sharded, None, None),
        ("sharded_bf16_carried", sharded, None, True),
        ("sharded_bf16_split", sharded, None, True),
        ("microbatched", dict(data=2, fsdp=2), jax.devices()[:4], None),
        ("data_fsdp_model", dict(data=2, fsdp=2, model=2), None, None),
    ):
        trainer_dir = os.path.join(out_dir, name)
        cfg = tiny_trainer_config(trainer_dir=trainer_dir, max_step=4, mesh=mesh)
        if name.startswith("sharded_bf16"):
            cfg.set(train_dtype=jnp.bfloat16, carry_train_dtype_weights=carry)
        if name == "sharded_bf16_split":
            cfg.set(split_carried_weights=True)
        if name == "microbatched":
            cfg.set(per_device_microbatch_size=1)  # 2 rows a device: 2 microbatches.
        trainer = cfg.instantiate(parent=None, devices=devices)
        trainer.run()
        losses = losses_by_step(trainer_dir)
        state = trainer.trainer_state
        params, treedef = jax.tree_util.tree_flatten(trainer.model_params())
        copies = treedef.flatten_up_to(state.weight_copies) if carry else [None] * len(params)
        if state.weight_low_bits is not None:  # Each low half must be sharded like its copy.
            for copy, low in zip(copies, treedef.flatten_up_to(state.weight_low_bits)):
                assert (copy is None) == (low is None)
                assert copy is None or copy.sharding.spec == low.sharding.spec
        results[name] = dict(
            mesh={k: int(v) for k, v in trainer.mesh.shape.items()},
            num_microbatches=trainer.num_microbatches(BATCH),
            losses=[losses[step] for step in sorted(losses)],
            # Each carried copy's sharding spec and that of its parameter.
            copy_specs=[
                [str(copy.sharding.spec), str(param.sharding.spec)]
                for copy, param in zip(copies, params)
                if copy is not None
            ],
        )
    with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    if sys.argv[1] == "mesh":
        _mesh_main(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
