"""Tests of axlearn.common.evaler: the eval policy, summary accumulation and SpmdEvaler."""

import json
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from axlearn.common.base_layer import BaseLayer, ParameterSpec
from axlearn.common.config import REQUIRED, ConfigError, Required, config_class, config_for_function
from axlearn.common.evaler import ModelSummaryAccumulator, SpmdEvaler, every_n_steps_policy
from axlearn.common.module import Module
from axlearn.common.run_dir import RunDir
from axlearn.common.summary import WeightedScalar
from axlearn.common.summary_writer import JSONL_FILE_NAME
from tests.fresh_python import run_python

VOCAB = 16
SEQ_LEN = 8


class BigramModel(BaseLayer):
    """A tiny LM: logits = w[input_id] + b, with the causal_lm summaries."""

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        return dict(
            w=ParameterSpec(shape=[VOCAB, VOCAB], mesh_axes=("fsdp", "model")),
            b=ParameterSpec(shape=[VOCAB], mesh_axes=(None,)),
        )

    def forward(self, input_batch):
        # Upcast: the evaluation precision is that of the (cast) parameters.
        w = self.parameters["w"].astype(jnp.float32)
        b = self.parameters["b"].astype(jnp.float32)
        logits = w[input_batch["input_ids"]] + b
        labels = input_batch["target_labels"]
        live = (labels >= 0).astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits)
        token_ce = -jnp.take_along_axis(log_probs, jnp.maximum(labels, 0)[..., None], -1)[..., 0]
        num_live = live.sum()
        total_nats = (token_ce * live).sum()
        cross_entropy = total_nats / jnp.maximum(num_live, 1)
        correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        self.add_summary("loss", WeightedScalar(cross_entropy, num_live))
        self.add_summary("cross_entropy", WeightedScalar(cross_entropy, num_live))
        # Per-batch perplexity: averaging these is wrong; the evaler must not report it.
        self.add_summary("perplexity", WeightedScalar(jnp.exp(cross_entropy), num_live))
        self.add_summary("accuracy", WeightedScalar((correct * live).sum() / num_live, num_live))
        if "target_num_bytes" in input_batch:
            num_bytes = input_batch["target_num_bytes"].sum().astype(jnp.float32)
            self.add_summary(
                "bits_per_byte", WeightedScalar(total_nats / math.log(2) / num_bytes, num_bytes)
            )
        return cross_entropy, {}


def make_batches(seed: int = 0, num_batches: int = 4, batch_size: int = 8):
    """Eval batches whose live-token counts differ a lot (padding labels are -1)."""
    rng = np.random.default_rng(seed)
    batches = []
    for i in range(num_batches):
        ids = rng.integers(0, VOCAB, size=(batch_size, SEQ_LEN), dtype=np.int32)
        labels = rng.integers(0, VOCAB, size=(batch_size, SEQ_LEN), dtype=np.int32)
        # Batch i keeps only a prefix of its rows' tokens: 1, 3, 5, ... live per row.
        labels[:, 2 * i + 1 :] = -1
        num_bytes = rng.integers(1, 30, size=(batch_size,), dtype=np.int32)
        batches.append(dict(input_ids=ids, target_labels=labels, target_num_bytes=num_bytes))
    return batches


class FakeInput(Module):
    """Yields the same host-local numpy batches on every pass; counts the passes."""

    @config_class
    class Config(Module.Config):
        """Configures FakeInput."""

        seed: int = 0
        num_batches: int = 4
        is_training: bool = False

    def __init__(self, cfg, *, parent):
        super().__init__(cfg, parent=parent)
        self.num_passes = 0

    def dataset(self):
        self.num_passes += 1
        yield from make_batches(self._config.seed, self._config.num_batches)


class FakeTrainer(Module):
    """A parent with a directory, as the trainer is."""

    @config_class
    class Config(Module.Config):
        """Configures FakeTrainer."""

        dir: Required[str] = REQUIRED

    @property
    def run_dir(self) -> RunDir:
        return RunDir(self.config.dir)


def make_params(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return dict(
        w=rng.normal(size=(VOCAB, VOCAB)).astype(np.float32) * 2,
        b=rng.normal(size=(VOCAB,)).astype(np.float32),
    )


def reference_metrics(params, batches) -> dict[str, float]:
    """NumPy over all live tokens of all batches at once (float64)."""
    w, b = (params[k].astype(np.float64) for k in ("w", "b"))
    ids = np.concatenate([x["input_ids"] for x in batches])
    labels = np.concatenate([x["target_labels"] for x in batches])
    logits = w[ids] + b
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    live = labels >= 0
    token_ce = -np.take_along_axis(log_probs, np.maximum(labels, 0)[..., None], -1)[..., 0]
    cross_entropy = token_ce[live].mean()
    accuracy = (logits.argmax(-1) == labels)[live].mean()
    total_bytes = sum(x["target_num_bytes"].sum() for x in batches)
    return dict(
        loss=cross_entropy,
        cross_entropy=cross_entropy,
        perplexity=math.exp(cross_entropy),
        accuracy=accuracy,
        bits_per_byte=token_ce[live].sum() / math.log(2) / total_bytes,
    )


def make_evaler(parent=None, name="eval_set", **cfg_kwargs) -> tuple[SpmdEvaler, BigramModel]:
    model = BigramModel.default_config().set(name="model").instantiate(parent=None)
    cfg_kwargs = dict(dict(eval_dtype=jnp.float32), **cfg_kwargs)
    cfg = SpmdEvaler.default_config().set(name=name, input=FakeInput.default_config(), **cfg_kwargs)
    evaler = cfg.instantiate(
        parent=parent,
        model=model,
        model_param_partition_specs=model.create_parameter_specs_recursively(),
    )
    return evaler, model


def assert_matches_reference(results, reference, rtol=1e-5):
    for name in ("loss", "cross_entropy", "perplexity", "accuracy", "bits_per_byte"):
        np.testing.assert_allclose(results[name], reference[name], rtol=rtol, err_msg=name)


# ----- every_n_steps_policy -----


def test_policy_fires_at_multiples_of_n_from_min_step_and_at_max_step():
    policy = every_n_steps_policy(3, min_step=4, max_step=10)
    assert [s for s in range(15) if policy(s)] == [6, 9, 10, 12]


def test_policy_defaults_skip_step_zero():
    policy = config_for_function(every_n_steps_policy).instantiate()
    assert [s for s in range(4) if policy(s)] == [1, 2, 3]


def test_policy_rejects_non_positive_n():
    with pytest.raises(ConfigError, match="n must be a positive int"):
        every_n_steps_policy(0)


# ----- ModelSummaryAccumulator -----


def test_model_summary_accumulator_weights_batches_by_live_tokens():
    model = BigramModel.default_config().set(name="model").instantiate(parent=None)
    calculator = (
        ModelSummaryAccumulator.default_config()
        .set(name="calc")
        .instantiate(parent=None, model=model, model_param_partition_specs=None)
    )
    params, batches = make_params(), make_batches()
    calculator.start()
    for batch in batches:
        calculator.add_batch(
            model_params=jax.tree.map(jnp.asarray, params),
            prng_key=jax.random.PRNGKey(0),
            input_batch=jax.tree.map(jnp.asarray, batch),
        )
    summaries = calculator.summaries()
    reference = reference_metrics(params, batches)
    np.testing.assert_allclose(
        float(summaries["cross_entropy"].mean), reference["cross_entropy"], rtol=1e-5
    )
    live_tokens = sum((b["target_labels"] >= 0).sum() for b in batches)
    assert float(summaries["cross_entropy"].weight) == live_tokens


def test_unknown_model_method_is_an_error_naming_the_field():
    model = BigramModel.default_config().set(name="model").instantiate(parent=None)
    cfg = ModelSummaryAccumulator.default_config().set(name="calc", model_method="predict")
    with pytest.raises(ConfigError, match=r"calc\.model_method.*'predict'"):
        cfg.instantiate(parent=None, model=model)


# ----- SpmdEvaler -----


def test_eval_step_reports_exact_perplexity_and_bits_per_byte_over_uneven_batches():
    evaler, _ = make_evaler()
    params = make_params()
    results = evaler.eval_step(
        5, prng_key=jax.random.PRNGKey(0), model_params=jax.tree.map(jnp.asarray, params)
    )
    reference = reference_metrics(params, make_batches())
    assert_matches_reference(results, reference)
    # The naive answers are far outside the tolerance, so the test can tell them apart:
    # unweighted means of per-batch values, and the token-weighted mean of per-batch
    # perplexities (what accumulating the model's own 'perplexity' summary gives).
    per_batch = [reference_metrics(params, [b]) for b in make_batches()]
    live = [(b["target_labels"] >= 0).sum() for b in make_batches()]
    naive = dict(
        cross_entropy=np.mean([m["cross_entropy"] for m in per_batch]),
        bits_per_byte=np.mean([m["bits_per_byte"] for m in per_batch]),
        perplexity=np.average([m["perplexity"] for m in per_batch], weights=live),
    )
    for name, value in naive.items():
        assert abs(value / reference[name] - 1) > 1e-3, name


def test_microbatched_eval_feeds_pieces_and_reports_the_whole_batches_metrics():
    evaler, _ = make_evaler(per_device_microbatch_size=2)
    batch = make_batches()[0]
    pieces = evaler._microbatches(batch)  # One device: the whole batch is its share.
    assert [p["input_ids"].shape[0] for p in pieces] == [2, 2, 2, 2]
    for name, value in batch.items():
        np.testing.assert_array_equal(np.concatenate([p[name] for p in pieces]), value)
    params = make_params()
    results = evaler.eval_step(
        5, prng_key=jax.random.PRNGKey(0), model_params=jax.tree.map(jnp.asarray, params)
    )
    assert_matches_reference(results, reference_metrics(params, make_batches()))


def test_microbatch_size_that_does_not_divide_an_eval_batch_names_the_field():
    evaler, _ = make_evaler(per_device_microbatch_size=3)
    with pytest.raises(ValueError, match="eval_set.per_device_microbatch_size=3 does not divide"):
        evaler._microbatches(make_batches()[0])


def test_eval_step_runs_only_when_the_policy_says_so():
    policy = config_for_function(every_n_steps_policy).set(n=4, min_step=1, max_step=10)
    evaler, _ = make_evaler(eval_policy=policy)
    params = jax.tree.map(jnp.asarray, make_params())
    ran = [
        step
        for step in range(12)
        if evaler.eval_step(step, prng_key=jax.random.PRNGKey(0), model_params=params) is not None
    ]
    assert ran == [4, 8, 10]
    assert [step for step in range(12) if evaler.due(step)] == ran
    assert evaler.input.num_passes == 3  # The input is only read when evaluating.


def test_parameters_are_cast_to_eval_dtype():
    evaler, _ = make_evaler(eval_dtype=jnp.bfloat16)
    params = make_params()
    results = evaler.eval_step(
        1, prng_key=jax.random.PRNGKey(0), model_params=jax.tree.map(jnp.asarray, params)
    )
    rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in params.items()}
    assert_matches_reference(results, reference_metrics(rounded, make_batches()))
    # ... and rounding is visible: the float32 answer differs.
    exact = reference_metrics(params, make_batches())["cross_entropy"]
    assert abs(results["cross_entropy"] - exact) > 1e-4


def test_summaries_are_written_under_the_trainer_dir(tmp_path):
    trainer_cfg = FakeTrainer.default_config().set(name="trainer", dir=str(tmp_path))
    trainer = trainer_cfg.instantiate(parent=None)
    evaler, _ = make_evaler(parent=trainer, name="openwebtext")
    params = make_params()
    results = evaler.eval_step(7, prng_key=jax.random.PRNGKey(0), model_params=params)
    with open(tmp_path / "summaries" / "openwebtext" / JSONL_FILE_NAME, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 1 and records[0]["step"] == 7
    assert set(records[0]) == {"step", *results}
    for name, value in results.items():
        np.testing.assert_allclose(records[0][name], value, rtol=1e-6)
    files = os.listdir(tmp_path / "summaries" / "openwebtext")
    assert any(f.startswith("events.out.tfevents.") for f in files)


def test_an_explicit_summary_dir_wins(tmp_path):
    evaler, _ = make_evaler()
    assert "summary_writer" not in evaler.children  # No parent dir, no dir: nothing written.
    cfg_dir = str(tmp_path / "mine")
    model = BigramModel.default_config().set(name="model").instantiate(parent=None)
    cfg = SpmdEvaler.default_config().set(name="e", input=FakeInput.default_config())
    cfg.summary_writer.dir = cfg_dir
    evaler = cfg.instantiate(parent=None, model=model)
    evaler.eval_step(1, prng_key=jax.random.PRNGKey(0), model_params=make_params())
    assert os.path.exists(os.path.join(cfg_dir, JSONL_FILE_NAME))


_MESH_SCRIPT = """
import json
import jax, jax.numpy as jnp
from axlearn.common.sharding import create_mesh
from tests.test_evaler import make_evaler, make_params
assert len(jax.devices()) == 8
from jax.sharding import PartitionSpec as P
evaler, model = make_evaler()  # Default batch axes: those of the mesh among data/fsdp/...
mesh = create_mesh((2, 4), ("data", "fsdp"))
with jax.set_mesh(mesh):
    params = jax.tree.map(jnp.asarray, make_params())
    # The batch is split over both axes; parameters follow their partition specs.
    batch = evaler._global_batch({"x": make_params()["w"]})
    assert batch["x"].sharding.spec == P(("data", "fsdp"), None), batch["x"].sharding
    cast = evaler._cast_params(params)
    assert cast["w"].sharding.spec == P("fsdp", None), cast["w"].sharding
    results = evaler.eval_step(2, prng_key=jax.random.PRNGKey(0), model_params=params)
print("RESULTS" + json.dumps(results))
"""


@pytest.mark.slow
def test_eval_on_a_data_fsdp_mesh_matches_the_reference():
    proc = run_python(_MESH_SCRIPT, devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULTS")][-1]
    results = json.loads(line[len("RESULTS") :])
    assert_matches_reference(results, reference_metrics(make_params(), make_batches()))


_INDIVISIBLE_SCRIPT = """
import jax
from axlearn.common.sharding import create_mesh
from tests.test_evaler import make_evaler
evaler, _ = make_evaler()
with jax.set_mesh(create_mesh((8,), ("data",))):
    evaler._global_batch({"input_ids": __import__("numpy").zeros((4, 8))})
"""


@pytest.mark.slow
def test_a_batch_that_the_mesh_cannot_split_is_an_error_with_the_fix():
    proc = run_python(_INDIVISIBLE_SCRIPT, devices=8)
    assert proc.returncode != 0
    assert "a batch of 4 rows cannot be split over mesh axes ('data',) (8 shards)" in proc.stderr
