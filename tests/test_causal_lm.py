"""causal_lm.Model: the loss and its summaries, chunked loss, the spec's model, counts."""

import pathlib
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common.base_layer import is_parameter_spec
from axlearn.common.causal_lm import Model, count_parameters, matmul_parameter_count
from axlearn.common.golden_text import parse_flat_text
from axlearn.common.hf_llama import llama_model_config
from axlearn.common.module import functional as F
from experiments import golf, gpt
from tests import reference_spec
from tests.fresh_python import assert_prints_ok
from tests.trainer_script import tiny_model_config

VOCAB, DIM, BATCH, SEQ = 29, 16, 3, 8
_REPO = pathlib.Path(__file__).resolve().parents[1]


def _spec_model_lines() -> list[str]:
    return reference_spec.lines_with_prefix("model.")


def _random_params(layer, seed: int = 0):
    """NumPy draws for every parameter: weights ~ N(0, 1/fan_in), norm scales near one."""
    rng = np.random.RandomState(seed)

    def draw(path, spec):
        shape = tuple(spec.shape)
        if getattr(path[-1], "key", None) == "scale":
            return jnp.asarray(1.0 + 0.1 * rng.randn(*shape), jnp.float32)
        fan_in = spec.fan_axes.fans(shape)["fan_in"]
        return jnp.asarray(rng.randn(*shape) / np.sqrt(fan_in), jnp.float32)

    specs = layer.create_parameter_specs_recursively()
    return jax.tree_util.tree_map_with_path(draw, specs, is_leaf=is_parameter_spec)


def _model_config(**kwargs) -> Model.Config:
    cfg = llama_model_config(
        vocab_size=VOCAB, dim=DIM, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=24
    )
    return cfg.set(**kwargs)


def _batch(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.RandomState(seed)
    ids = rng.randint(1, VOCAB, size=(BATCH, SEQ))
    labels = np.roll(ids, -1, axis=1)
    labels[0, -3:] = 0  # Padding (pad_token_id 0) ...
    labels[1, 2] = -1  # ... and an explicitly ignored target.
    return dict(input_ids=jnp.asarray(ids, jnp.int32), target_labels=jnp.asarray(labels, jnp.int32))


def _forward(model, params, batch, is_training=False):
    return jax.jit(
        lambda p, b: F(model, state=p, inputs=(b,), prng_key=jax.random.PRNGKey(0),
                       is_training=is_training)
    )(params, batch)


def _np_log_softmax_stats(logits):
    logits = np.asarray(logits, np.float64)
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    return lse, logits


def test_loss_and_summaries_match_numpy():
    model = _model_config(z_loss_scale=1e-2).instantiate(parent=None)
    params = _random_params(model)
    batch = _batch()
    (loss, aux), collection = _forward(model, params, batch)
    lse, logits = _np_log_softmax_stats(aux["logits"])
    labels = np.asarray(batch["target_labels"])
    live = (labels > 0).astype(np.float64)  # pad_token_id is 0; -1 is ignored.
    target = np.take_along_axis(logits, np.maximum(labels, 0)[..., None], -1)[..., 0]
    ce_tokens = lse - target
    n = live.sum()
    ce = (ce_tokens * live).sum() / n
    z = 1e-2 * (lse**2 * live).sum() / n
    accuracy = ((logits.argmax(-1) == labels) * live).sum() / n
    np.testing.assert_allclose(loss, ce + z, rtol=1e-5)
    summaries = collection.summaries
    for name, value in (("loss", ce + z), ("cross_entropy", ce), ("z_loss", z),
                        ("perplexity", np.exp(ce)), ("accuracy", accuracy)):
        np.testing.assert_allclose(summaries[name].mean, value, rtol=1e-5, err_msg=name)
        assert float(summaries[name].weight) == n
    np.testing.assert_array_equal(aux["live_targets"], live)
    np.testing.assert_allclose(
        aux["per_token_loss"], (ce_tokens + 1e-2 * lse**2) * live, rtol=1e-5, atol=1e-6
    )


def test_bits_per_byte_is_total_nats_over_bytes_in_bits():
    model = _model_config().instantiate(parent=None)
    params = _random_params(model)
    batch = dict(_batch(), target_num_bytes=jnp.array([30, 25, 41], jnp.int32))
    (_, aux), collection = _forward(model, params, batch)
    lse, logits = _np_log_softmax_stats(aux["logits"])
    labels = np.asarray(batch["target_labels"])
    live = labels > 0
    target = np.take_along_axis(logits, np.maximum(labels, 0)[..., None], -1)[..., 0]
    total_nats = ((lse - target) * live).sum()
    bpb = collection.summaries["bits_per_byte"]
    np.testing.assert_allclose(bpb.mean, total_nats / np.log(2) / 96, rtol=1e-5)
    assert float(bpb.weight) == 96


def _loss_and_grads(model, params, batch):
    def loss_fn(p):
        (loss, _), _ = F(model, state=p, inputs=(batch,), prng_key=None, is_training=True)
        return loss

    return jax.jit(jax.value_and_grad(loss_fn))(params)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [3, 4])
def test_chunked_loss_equals_unchunked_loss_and_gradients(chunk):
    cfg = _model_config(z_loss_scale=1e-3)
    model = cfg.instantiate(parent=None)
    chunked = cfg.clone(loss_chunk_size=chunk).instantiate(parent=None)
    params = _random_params(model)
    batch = _batch()
    loss, grads = _loss_and_grads(model, params, batch)
    chunked_loss, chunked_grads = _loss_and_grads(chunked, params, batch)
    np.testing.assert_allclose(chunked_loss, loss, rtol=1e-6)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), chunked_grads, grads
    )


def _shapes_in_jaxpr(jaxpr) -> set:
    """Shapes of every value computed in `jaxpr` and in the jaxprs nested in its equations."""
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes.update(tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    shapes |= _shapes_in_jaxpr(inner)
    return shapes


def test_chunked_loss_never_builds_full_logits_forward_or_backward():
    cfg = _model_config()
    params = _random_params(cfg.instantiate(parent=None))
    batch = _batch()
    full_logits = (BATCH, SEQ, VOCAB)

    def shapes(model_cfg):
        model = model_cfg.instantiate(parent=None)

        def loss_fn(p):
            (loss, _), _ = F(model, state=p, inputs=(batch,), prng_key=None, is_training=True)
            return loss

        return _shapes_in_jaxpr(jax.make_jaxpr(jax.value_and_grad(loss_fn))(params).jaxpr)

    assert full_logits in shapes(cfg)  # The check can see logits when they exist...
    assert full_logits not in shapes(cfg.clone(loss_chunk_size=4))  # ... and chunking removes them.


def _small_spec_model_config() -> Model.Config:
    cfg = parse_flat_text("\n".join(_spec_model_lines()), source=str(reference_spec.path()))
    decoder = cfg.decoder
    decoder.set(dim=64, vocab_size=128)
    decoder.transformer.num_layers = 2
    layer = decoder.transformer.layer
    layer.feed_forward.hidden_dim = 96
    layer.self_attention.attention.num_heads = 4
    layer.self_attention.attention.input_linear.input_linear.num_kv_heads = 2
    return cfg.set(name="model")


def test_spec_model_config_dumps_back_to_the_spec_lines():
    lines = _spec_model_lines()
    cfg = parse_flat_text("\n".join(lines))
    assert sorted(cfg.debug_string().splitlines()) == sorted(lines)


@pytest.mark.slow
def test_spec_model_with_small_dims_runs_forward_and_backward():
    model = _small_spec_model_config().instantiate(parent=None)
    params = _random_params(model)
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(2, 128, size=(2, 16)), jnp.int32)
    batch = dict(input_ids=ids, target_labels=jnp.roll(ids, -1, axis=1))
    loss, grads = _loss_and_grads(model, params, batch)
    assert np.isfinite(loss) and 3.0 < float(loss) < 8.0  # About log(128) = 4.85 at init.
    norms = [float(jnp.linalg.norm(g)) for g in jax.tree_util.tree_leaves(grads)]
    assert all(np.isfinite(norms)) and all(n > 0 for n in norms)


def test_parameter_counts_of_the_full_size_spec_model_from_specs():
    cfg = parse_flat_text("\n".join(_spec_model_lines())).set(name="model")
    model = cfg.instantiate(parent=None)  # Builds the module tree only: nothing is allocated.
    vocab, dim, layers, ff = 49152, 3072, 26, 8064
    heads, kv_heads, head_dim = 24, 8, 128
    attention = dim * (heads + 2 * kv_heads) * head_dim + dim * heads * head_dim
    feed_forward = 3 * dim * ff
    norms = 2 * dim + 2 * head_dim  # Two pre-norms and the query/key norms per layer.
    expected_matmul = layers * (attention + feed_forward) + vocab * dim  # Tied head.
    expected_total = layers * (attention + feed_forward + norms) + vocab * dim + dim
    assert count_parameters(model) == expected_total
    assert matmul_parameter_count(model) == expected_matmul
    assert 2.6e9 < expected_total < 2.8e9  # The spec is a 2.7B model.


def test_untied_head_counts_once_and_the_lookup_table_not_at_all():
    tied = llama_model_config(vocab_size=100, dim=8, num_layers=1, num_heads=2, num_kv_heads=1,
                              hidden_dim=12, tie_word_embeddings=True)
    untied = tied.clone()
    untied.decoder.lm_head = llama_model_config(
        vocab_size=100, dim=8, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=12
    ).decoder.lm_head
    layer_matmul = 8 * (2 + 2 * 1) * 4 + 8 * 2 * 4 + 3 * 8 * 12
    tied_model, untied_model = tied.instantiate(parent=None), untied.instantiate(parent=None)
    assert matmul_parameter_count(tied_model) == layer_matmul + 100 * 8
    assert matmul_parameter_count(untied_model) == layer_matmul + 100 * 8
    assert count_parameters(untied_model) == count_parameters(tied_model) + 100 * 8
    # Arrays work as well as specs.
    assert count_parameters(_random_params(tied_model)) == count_parameters(tied_model)


def _design_flops_per_token(model_cfg, seq_len: int) -> int:
    """DESIGN.md's training FLOPs per token, from the config's numbers alone: 6 x matmul
    parameters (LM head in, embedding lookup out) + 6 x layers x seq_len x dim."""
    decoder = model_cfg.decoder
    dim, vocab = decoder.dim, decoder.vocab_size
    layers = decoder.transformer.num_layers
    layer = decoder.transformer.layer
    attention = layer.self_attention.attention
    heads, kv_heads = attention.num_heads, attention.input_linear.input_linear.num_kv_heads
    head_dim = dim // heads
    qkv_and_output = dim * (heads + 2 * kv_heads) * head_dim + heads * head_dim * dim
    gated = isinstance(layer.feed_forward.activation, (tuple, list))  # Two input matrices.
    mlp = (3 if gated else 2) * dim * layer.feed_forward.hidden_dim
    lm_head = vocab * dim  # Tied or not, the head's matmul counts once.
    matmul = layers * (qkv_and_output + mlp) + lm_head
    return 6 * matmul + 6 * layers * seq_len * dim


def _gpt_test_model_and_seq_len():
    cfg = gpt.gpt_test_trainer()
    return cfg.model, cfg.input.max_sequence_length


def _golf_model_and_seq_len():
    cfg = golf.golf_baseline()
    return cfg.model, cfg.input.max_sequence_length


@pytest.mark.parametrize(
    "make",
    [
        _gpt_test_model_and_seq_len,
        _golf_model_and_seq_len,  # Tied embeddings, a two-matrix (squared ReLU) MLP.
        lambda: (tiny_model_config(stack="repeat"), 64),  # Parameters stacked over layers.
        lambda: (_model_config(), SEQ),  # An untied LM head.
    ],
    ids=["gpt_test", "golf_baseline", "repeated_layers", "untied_head"],
)
def test_model_flops_per_token_is_the_design_formula_of_the_config(make):
    model_cfg, seq_len = make()
    model = model_cfg.clone(name="model").instantiate(parent=None)  # Specs only.
    assert model.model_flops_per_token(seq_len) == _design_flops_per_token(model_cfg, seq_len)


@pytest.mark.slow
def test_generation_wrappers_delegate_to_the_decoder():
    model = _model_config().instantiate(parent=None)
    params = _random_params(model)
    prompt = jnp.array([[3, 4, 5]], jnp.int32)
    run = lambda method, state, **kw: F(  # noqa: E731
        getattr(model, method.split(".")[0]) if "." in method else model,
        state=state, inputs=dict(prompt_ids=prompt, max_len=6, **kw), prng_key=None,
        is_training=False, method=method.split(".")[-1],
    )[0]
    ours = run("greedy_decode", params)
    direct = run("decoder.greedy_decode", params["decoder"])
    np.testing.assert_array_equal(ours["sequences"], direct["sequences"])
    sampled = run("sample_decode", params, prng_key=jax.random.PRNGKey(0), top_k=1)
    np.testing.assert_array_equal(sampled["sequences"][:, 0], ours["sequences"])


_SHARDED_SCRIPT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
    import jax, jax.numpy as jnp, numpy as np
    import test_causal_lm as t
    from axlearn.common.base_layer import is_parameter_spec
    from axlearn.common.module import functional as F
    from axlearn.common.sharding import create_mesh, named_sharding

    cfg = t._small_spec_model_config()
    model = cfg.instantiate(parent=None)
    params = t._random_params(model)
    ids = jnp.asarray(np.random.RandomState(0).randint(2, 128, size=(8, 16)), jnp.int32)
    batch = dict(input_ids=ids, target_labels=jnp.roll(ids, -1, axis=1))

    def loss_fn(p, b):
        (loss, aux), _ = F(model, state=p, inputs=(b,), prng_key=None, is_training=True)
        return loss, aux["logits"]

    expected, _ = jax.jit(loss_fn)(params, batch)
    # fsdp x model. (A mesh with data, fsdp and model all > 1 hits an XLA CPU partitioner
    # bug in jax 0.10 on the spec's linear2 sharding: a plain matmul reproduces it.)
    mesh = create_mesh((1, 4, 2), ("data", "fsdp", "model"))
    specs = model.create_parameter_specs_recursively()
    shardings = jax.tree_util.tree_map(
        lambda s: named_sharding(mesh, s.partition_spec), specs, is_leaf=is_parameter_spec)
    with jax.set_mesh(mesh):
        sharded = jax.device_put(params, shardings)
        loss, logits = jax.jit(loss_fn)(sharded, batch)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    spec = tuple(logits.sharding.spec) + (None,) * 3
    batch_axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    assert "fsdp" in batch_axes and spec[2] == "model", spec
    print("OK")
    """
)


@pytest.mark.slow
def test_sharded_forward_matches_single_device_and_shards_logits():
    reference_spec.path()  # The script builds the spec's model.
    assert_prints_ok(_SHARDED_SCRIPT, str(_REPO), devices=8)


@pytest.mark.slow
def test_attend_across_documents_ignores_segments_and_positions():
    """With attend_across_documents, the loss is that of an unpacked batch of one document."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    from axlearn.common.module import functional  # pylint: disable=import-outside-toplevel
    from axlearn.experiments.text.gpt.common import model_config  # pylint: disable=import-outside-toplevel

    cfg = model_config(
        dim=32, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=64, vocab_size=64, z_loss_scale=0.0
    ).set(name="model", dtype=jnp.float32)
    cfg.decoder.transformer.layer.self_attention.attention.input_linear.cache_dtype = None
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(2, 64, size=(2, 16)), jnp.int32)
    labels = jnp.asarray(rng.integers(2, 64, size=(2, 16)), jnp.int32)
    packed = dict(
        input_ids=ids,
        target_labels=labels,
        input_segment_ids=jnp.asarray(np.repeat([[1, 2]], 8, axis=1).repeat(2, axis=0), jnp.int32),
        input_positions=jnp.asarray(np.tile(np.arange(8), 2)[None].repeat(2, axis=0), jnp.int32),
    )
    plain = dict(input_ids=ids, target_labels=labels)
    model = cfg.instantiate(parent=None)
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))

    def loss(model, batch):
        forward = lambda p, b: functional(  # noqa: E731
            model, state=p, inputs=dict(input_batch=b), prng_key=None, is_training=False
        )[0][0]
        return jax.jit(forward)(params, batch)

    across = cfg.clone(attend_across_documents=True).instantiate(parent=None)
    plain_loss = loss(model, plain)
    np.testing.assert_allclose(loss(across, packed), plain_loss, rtol=1e-6)
    assert abs(float(loss(model, packed)) - float(plain_loss)) > 1e-4


def test_cross_entropy_gradient_matches_a_numpy_derivation():
    # _cross_entropy has a hand-written VJP: d/dlogits of (w_ce * ce + w_z * lse) is
    # (w_ce + w_z) * softmax - w_ce * onehot(label).
    from axlearn.common.causal_lm import _cross_entropy  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 5, 11)).astype(np.float32)
    labels = rng.integers(-1, 11, size=(2, 5)).astype(np.int32)
    w_ce, w_z = rng.normal(size=(2, 5)), rng.normal(size=(2, 5))

    def loss(x):
        ce, lse = _cross_entropy(x, jnp.asarray(labels))
        return jnp.sum(ce * w_ce + lse * w_z)

    got = jax.grad(loss)(jnp.asarray(logits))
    shifted = logits - logits.max(-1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
    onehot = np.eye(11)[np.maximum(labels, 0)]
    want = (w_ce + w_z)[..., None] * probs - w_ce[..., None] * onehot
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    ce, lse = _cross_entropy(jnp.asarray(logits), jnp.asarray(labels))
    want_lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
    np.testing.assert_allclose(ce, want_lse - np.take_along_axis(logits, np.maximum(labels, 0)[..., None], -1)[..., 0], rtol=1e-5)


def test_without_a_pad_id_token_0_targets_count_and_segment_0_is_padding():
    model_cfg = _model_config()
    model_cfg.decoder.pad_token_id = None
    model = model_cfg.instantiate(parent=None)
    batch = _batch()
    segments = np.ones((BATCH, SEQ), np.int32)
    segments[2, -2:] = 0  # The end of a finite stream: padding.
    batch["input_segment_ids"] = jnp.asarray(segments)
    (_, aux), _ = _forward(model, _random_params(model), batch)
    labels = np.asarray(batch["target_labels"])
    expected = (labels >= 0) & (segments != 0)  # Row 0's zeros are tokens now.
    np.testing.assert_array_equal(aux["live_targets"], expected.astype(np.float32))


def test_target_weights_weight_the_loss_and_its_summaries_against_numpy():
    model = _model_config().instantiate(parent=None)
    params = _random_params(model)
    rng = np.random.RandomState(3)
    weights = (rng.rand(BATCH, SEQ) < 0.5).astype(np.float32)
    batch = dict(
        _batch(),
        target_weights=jnp.asarray(weights),
        target_num_bytes=jnp.array([7, 0, 12], jnp.int32),  # Bytes of the trained text.
    )
    (loss, aux), collection = _forward(model, params, batch)
    lse, logits = _np_log_softmax_stats(aux["logits"])
    labels = np.asarray(batch["target_labels"])
    counted = (labels > 0) * weights  # Live (not padding, not ignored) and masked in.
    target = np.take_along_axis(logits, np.maximum(labels, 0)[..., None], -1)[..., 0]
    total_nats = ((lse - target) * counted).sum()
    np.testing.assert_allclose(loss, total_nats / counted.sum(), rtol=1e-5)
    summaries = collection.summaries
    assert float(summaries["loss"].weight) == counted.sum()
    accuracy = ((logits.argmax(-1) == labels) * counted).sum() / counted.sum()
    np.testing.assert_allclose(summaries["accuracy"].mean, accuracy, rtol=1e-5)
    np.testing.assert_allclose(
        summaries["bits_per_byte"].mean, total_nats / np.log(2) / 19, rtol=1e-5
    )


@pytest.mark.slow
def test_masked_out_targets_change_neither_loss_nor_gradients():
    model = _model_config().instantiate(parent=None)
    params = _random_params(model)
    weights = np.ones((BATCH, SEQ), np.float32)
    weights[:, : SEQ // 2] = 0  # A prompt that does not train.
    batch = dict(_batch(), target_weights=jnp.asarray(weights))
    other = dict(batch)
    labels = np.asarray(batch["target_labels"]).copy()
    labels[:, : SEQ // 2] = (labels[:, : SEQ // 2] % (VOCAB - 2)) + 1  # Other live targets.
    other["target_labels"] = jnp.asarray(labels)
    loss, grads = _loss_and_grads(model, params, batch)
    other_loss, other_grads = _loss_and_grads(model, params, other)
    np.testing.assert_allclose(loss, other_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads,
                 other_grads)
