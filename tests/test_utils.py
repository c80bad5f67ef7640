"""Tests of axlearn.common.utils: leaf paths against a hand-written walk of the tree and
jax.tree_util's leaf order, floating-point casts against NumPy."""

import contextlib
import io
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

from axlearn.common.config import config_for_function
from axlearn.common.golden_text import parse_flat_text
from axlearn.common.utils import (
    cast_floats,
    combine_fn,
    combine_remat_policies,
    flatten_with_paths,
    offload_dots_with_no_batch_dims,
    save_and_offload_only_these_names_regex,
    tree_paths,
    unflatten_paths,
)

RNG = np.random.default_rng(0)


class _Pair(NamedTuple):
    first: Any
    second: Any


def _walk(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """(path entries, leaf) by hand: dict keys in sorted order, named fields by name,
    sequence items by index; None holds no leaf."""
    if tree is None:
        return []
    if isinstance(tree, dict):
        return [item for key in sorted(tree) for item in _walk(tree[key], prefix + (str(key),))]
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return [item for name in tree._fields for item in _walk(getattr(tree, name), prefix + (name,))]
    if isinstance(tree, (list, tuple)):
        return [item for i, x in enumerate(tree) for item in _walk(x, prefix + (str(i),))]
    return [(prefix, tree)]


def _random_tree(depth: int = 3) -> Any:
    """A nested dict of arrays, lists, tuples, named tuples and Nones, drawn from RNG."""
    kind = RNG.integers(0, 5) if depth > 0 else 0
    if kind == 0:
        return np.asarray(RNG.normal(size=RNG.integers(1, 4)), np.float32)
    if kind == 1:
        return {f"k{RNG.integers(0, 100)}_{i}": _random_tree(depth - 1) for i in range(3)}
    if kind == 2:
        return [_random_tree(depth - 1) for _ in range(RNG.integers(1, 4))]
    if kind == 3:
        return _Pair(_random_tree(depth - 1), None)
    return (_random_tree(depth - 1), _random_tree(depth - 1))


TREES = [{"root": _random_tree()} for _ in range(8)] + [
    {"b": [1.0, (2.0, 3.0)], "a": {"y": 4.0, "x": None}, "c": _Pair(first=5.0, second=6.0)}
]


@pytest.mark.parametrize("tree", TREES)
def test_flatten_with_paths_joins_keys_fields_and_indices_in_jax_leaf_order(tree):
    got = flatten_with_paths(tree)
    want = _walk(tree)
    assert [path for path, _ in got] == ["/".join(entries) for entries, _ in want]
    # The leaves are jax's own, in jax's order.
    leaves = jax.tree_util.tree_leaves(tree)
    assert len(got) == len(leaves)
    for (_, got_leaf), leaf in zip(got, leaves):
        assert got_leaf is leaf


def test_flatten_with_paths_takes_a_separator_and_stops_at_is_leaf():
    tree = {"a": {"b": (1, 2)}, "c": [3]}
    assert flatten_with_paths(tree, separator=".") == [("a.b.0", 1), ("a.b.1", 2), ("c.0", 3)]
    as_leaves = flatten_with_paths(tree, is_leaf=lambda x: isinstance(x, tuple))
    assert as_leaves == [("a/b", (1, 2)), ("c/0", 3)]


@pytest.mark.parametrize("tree", TREES)
def test_tree_paths_puts_each_leaf_s_path_in_its_place(tree):
    paths = tree_paths(tree)
    assert jax.tree_util.tree_structure(paths) == jax.tree_util.tree_structure(tree)
    assert jax.tree_util.tree_leaves(paths) == ["/".join(entries) for entries, _ in _walk(tree)]


def test_unflatten_paths_rebuilds_the_nested_dict_that_flatten_with_paths_flattened():
    for _ in range(8):
        tree = {f"k{i}": _random_tree() for i in range(3)}
        # Only nested dicts round-trip: sequences come back as dicts keyed by index.
        dicts_only = _to_dicts(tree)
        flat = dict(flatten_with_paths(dicts_only))
        rebuilt = unflatten_paths(flat)
        assert jax.tree_util.tree_structure(rebuilt) == jax.tree_util.tree_structure(
            _without_empty(dicts_only)
        )
        assert dict(flatten_with_paths(rebuilt)) == flat


def _to_dicts(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _to_dicts(v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return {name: _to_dicts(getattr(tree, name)) for name in tree._fields}
    if isinstance(tree, (list, tuple)):
        return {str(i): _to_dicts(x) for i, x in enumerate(tree)}
    return tree


def _without_empty(tree: Any) -> Any:
    """The nested dict with the subtrees that hold no leaf removed."""
    if not isinstance(tree, dict):
        return tree
    return {k: _without_empty(v) for k, v in tree.items() if _walk(v)}


def test_unflatten_paths_takes_a_separator():
    assert unflatten_paths({"a.b": 1, "a.c": 2, "d": 3}, separator=".") == {
        "a": {"b": 1, "c": 2},
        "d": 3,
    }


@pytest.mark.parametrize("flat", [{"a": 1, "a/b": 2}, {"a/b": 2, "a": 1}])
def test_unflatten_paths_refuses_a_path_that_is_both_a_leaf_and_a_prefix(flat):
    with pytest.raises(ValueError, match="'a"):
        unflatten_paths(flat)


def test_cast_floats_casts_floating_leaves_and_keeps_the_others():
    tree = {
        "w": jnp.asarray(RNG.normal(size=(3, 4)), jnp.float32),
        "h": jnp.asarray(RNG.normal(size=(2,)), jnp.float16),
        "step": jnp.asarray(7, jnp.int32),
        "key": jax.random.key(0),
        "flag": True,
    }
    got = cast_floats(tree, jnp.bfloat16)
    for name in ("w", "h"):
        assert got[name].dtype == jnp.bfloat16
        want = np.asarray(tree[name]).astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(got[name]), want)
    assert got["step"] is tree["step"] and got["key"] is tree["key"] and got["flag"] is True


def test_cast_floats_to_none_returns_the_tree_itself():
    tree = {"w": jnp.zeros((2,), jnp.float32)}
    assert cast_floats(tree, None) is tree


# ----- remat policies -----
# Tests of the remat policies in axlearn.common.utils against jax's own name-set policies.


NAMES = ("q_proj", "k_proj", "v_proj", "context", "hidden")


def _named_chain(x):
    """Five named intermediates of distinct widths, so each saved residual is recognisable."""
    for i, name in enumerate(NAMES):
        x = checkpoint_name(jnp.sin(x @ jnp.ones((x.shape[-1], 3 + i))), name)
    return jnp.sum(x)


def _saved_names(policy) -> set[str]:
    x = jnp.asarray(RNG.normal(size=(2, 4)), jnp.float32)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(_named_chain, policy=policy), x)
    return {name for name in NAMES if f"named '{name}'" in out.getvalue()}


def _name_prim(name: str):
    """The checkpoint-name primitive as a policy sees it."""
    return types.SimpleNamespace(name="name"), dict(name=name)


def test_regex_policy_saves_the_same_names_as_jax_save_only_these_names():
    ours = save_and_offload_only_these_names_regex(
        names_which_can_be_saved=".*[qk]_proj|context", names_which_can_be_offloaded=None
    )
    want = jax.checkpoint_policies.save_only_these_names("q_proj", "k_proj", "context")
    assert _saved_names(ours) == _saved_names(want) == {"q_proj", "k_proj", "context"}


def test_regex_policy_offloads_names_matching_the_offload_regex():
    policy = save_and_offload_only_these_names_regex(
        names_which_can_be_saved="q_proj", names_which_can_be_offloaded=".*_proj"
    )
    prim, params = _name_prim("k_proj")
    decision = policy(prim, **params)
    assert (decision.src, decision.dst) == ("device", "pinned_host")
    assert policy(*_name_prim("q_proj")[:1], name="q_proj") is True  # Saving wins.
    assert policy(types.SimpleNamespace(name="dot_general")) is False


def test_combined_policy_saves_what_either_saves_like_jax_save_from_both_policies():
    first = jax.checkpoint_policies.save_only_these_names("q_proj")
    second = save_and_offload_only_these_names_regex(
        names_which_can_be_saved="context|hidden", names_which_can_be_offloaded=None
    )
    want = jax.checkpoint_policies.save_from_both_policies(
        first, jax.checkpoint_policies.save_only_these_names("context", "hidden")
    )
    assert _saved_names(combine_remat_policies(first, second)) == _saved_names(want)


def test_combining_save_with_offload_of_one_name_is_an_error():
    save = save_and_offload_only_these_names_regex(
        names_which_can_be_saved="q_proj", names_which_can_be_offloaded=None
    )
    offload = save_and_offload_only_these_names_regex(
        names_which_can_be_saved=None, names_which_can_be_offloaded="q_proj"
    )
    with pytest.raises(ValueError, match="disagree"):
        combine_remat_policies(save, offload)(*_name_prim("q_proj")[:1], name="q_proj")


def test_combined_policy_config_dumps_its_default_combine_fn_and_parses_back():
    cfg = config_for_function(combine_remat_policies).set(
        policy_1=config_for_function(save_and_offload_only_these_names_regex).set(
            names_which_can_be_saved="q_proj", names_which_can_be_offloaded=None
        ),
        policy_2=jax.checkpoint_policies.dots_saveable,
    )
    text = cfg.debug_string()
    assert "combine_fn: 'axlearn.common.utils.combine_fn'" in text.splitlines()
    parsed = parse_flat_text(text)
    assert parsed.combine_fn is combine_fn and parsed.debug_string() == text
    assert callable(parsed.instantiate())


# ----- the named save-cheap and offload policies, through a layer's remat_spec -----

_HIDDEN = 24  # The feed-forward's hidden width: its matmul outputs are f32[2,8,24].


def _feed_forward_grads(policy):
    """(gradients of a gated feed-forward layer's sum of squares with respect to its
    parameters and its input, the grad function's jaxpr text), the layer rematerialized
    by `policy` (None: no remat)."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.attention import TransformerFeedForwardLayer
    from axlearn.common.module import functional  # pylint: disable=import-outside-toplevel
    from axlearn.common.param_init import default_initializer_config  # pylint: disable=import-outside-toplevel

    cfg = TransformerFeedForwardLayer.default_config().set(
        name="ffn", input_dim=16, hidden_dim=_HIDDEN, activation=("nn.silu", "linear"),
        param_init=default_initializer_config(),
    )
    if policy is not None:
        cfg.remat_spec = {"prevent_cse": True, "policy": policy}
    layer = cfg.instantiate(parent=None)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 16)), jnp.float32)

    def loss(p, inputs):
        out, _ = functional(layer, state=p, inputs=dict(inputs=inputs), prng_key=None, is_training=True)
        return jnp.sum(out**2)

    grad = jax.grad(loss, argnums=(0, 1))
    return jax.jit(grad)(params, x), str(jax.make_jaxpr(grad)(params, x))


def _assert_grads_equal(grads, reference):
    for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _kind(decision) -> str:
    """A policy's decision as text: 'src->dst' (offload), 'save' or 'recompute' (jax answers
    with its own types, policies may answer bools)."""
    if hasattr(decision, "dst"):
        return f"{decision.src}->{decision.dst}"
    if decision is True or "Saveable" in type(decision).__name__:
        return "save"
    assert decision is False or "Recompute" in type(decision).__name__, decision
    return "recompute"


def test_offload_dots_policy_decides_as_jax_offload_dot_with_no_batch_dims():
    jax_policy = getattr(jax.checkpoint_policies, "offload_dot_with_no_batch_dims", None)
    if jax_policy is None:
        pytest.skip("this jax has no checkpoint_policies.offload_dot_with_no_batch_dims")
    want = jax_policy("device", "pinned_host")

    def f(x, w, a):
        return jnp.sum(jnp.tanh(x @ w)) + jnp.sum(jnp.einsum("bij,bjk->bik", a, a))

    args = (jnp.ones((4, 3)), jnp.ones((3, 5)), jnp.ones((2, 3, 3)))
    eqns = jax.make_jaxpr(f)(*args).jaxpr.eqns
    assert {e.primitive.name for e in eqns} >= {"dot_general", "tanh", "reduce_sum"}
    for eqn in eqns:
        ours = offload_dots_with_no_batch_dims(eqn.primitive, **eqn.params)
        theirs = want(eqn.primitive, **eqn.params)
        assert _kind(ours) == _kind(theirs), eqn.primitive.name


def test_offload_dots_policy_named_in_a_remat_spec_gives_no_remat_gradients_via_the_host():
    reference, plain = _feed_forward_grads(None)
    grads, jaxpr = _feed_forward_grads("axlearn.common.utils.offload_dots_with_no_batch_dims")
    _assert_grads_equal(grads, reference)
    # The matmul outputs go to host memory and come back for the backward pass.
    assert "MemorySpace.Host" in jaxpr and "MemorySpace.Host" not in plain


def test_save_dots_policy_named_in_a_remat_spec_gives_no_remat_gradients():
    reference, _ = _feed_forward_grads(None)
    grads, jaxpr = _feed_forward_grads("dots_with_no_batch_dims_saveable")
    _assert_grads_equal(grads, reference)
    assert "MemorySpace.Host" not in jaxpr  # Saved on the device.
    # The backward pass recomputes the matmuls only where nothing is saved.
    _, recomputing = _feed_forward_grads("nothing_saveable")
    assert jaxpr.count("dot_general") < recomputing.count("dot_general")


def test_hybrid_mesh_shape_is_the_product_of_its_parts_with_minus_one_resolved():
    from axlearn.common.trainer import infer_mesh_shape  # pylint: disable=import-outside-toplevel
    from axlearn.common.utils import HybridMeshShape  # pylint: disable=import-outside-toplevel

    shape = HybridMeshShape(ici_mesh_shape=(1, 1, 1, 8, 1, 1), dcn_mesh_shape=(1, -1, 1, 1, 1, 1))
    assert shape.flat() == (1, -1, 1, 8, 1, 1) and len(shape) == 6
    assert infer_mesh_shape(shape, 64) == (1, 8, 1, 8, 1, 1)
    with pytest.raises(ValueError, match="cannot cover 4 devices"):
        infer_mesh_shape(shape, 4)
    uneven = HybridMeshShape(ici_mesh_shape=(1, 4, 1, 1, 1, 1), dcn_mesh_shape=(1, -1, 1, 1, 1, 1))
    with pytest.raises(ValueError, match="does not split into parts of 4"):
        infer_mesh_shape(uneven, 6)
