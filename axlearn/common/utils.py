"""Generic pytree helpers ('/'-joined leaf paths, floating-point casts) and the
rematerialization policies that configs name (`utils.save_and_offload_only_these_names_regex`,
`utils.offload_dots_with_no_batch_dims`, `utils.combine_remat_policies`).

A leaf's path is the keys, attribute names and sequence indices that lead to it, joined
by '/' (`{'a': {'b': [x, y]}}` holds 'a/b/0' and 'a/b/1'): the names that checkpoints,
parameter regexes and golden `_init` lines use. Leaves come in jax's flatten order (dict
keys sorted), and None is an empty subtree, as in `jax.tree_util`.

This module is the bottom of the library's layering: of axlearn it imports only `config`
(pure Python), whose `register_configurable` lets config text name the policies.
"""

import re
from collections.abc import Callable
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp

from axlearn.common.config import register_configurable


def _key_str(key: Any) -> str:
    """One path entry as text: a dict key, an attribute name or a sequence index."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def flatten_with_paths(
    tree: Any, separator: str = "/", is_leaf: Optional[Callable[[Any], bool]] = None
) -> list[tuple[str, Any]]:
    """[(path, leaf)] for every leaf of `tree`, paths joined by `separator`."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(separator.join(_key_str(k) for k in path), leaf) for path, leaf in leaves]


def tree_paths(
    tree: Any, separator: str = "/", is_leaf: Optional[Callable[[Any], bool]] = None
) -> Any:
    """A tree of the same structure whose leaves are their own paths."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: separator.join(_key_str(k) for k in path), tree, is_leaf=is_leaf
    )


def unflatten_paths(flat: dict[str, Any], separator: str = "/") -> dict[str, Any]:
    """The nested dict whose `flatten_with_paths` is `flat`'s items: {'a/b': x} -> {'a': {'b': x}}.

    Raises:
        ValueError: when one path is a prefix of another ('a' and 'a/b'), so that a leaf
            would also have to be a dict.
    """
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        parts = path.split(separator)
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(
                    f"Path '{path}' runs through '{separator.join(parts[: i + 1])}', a leaf"
                )
        if isinstance(node.get(parts[-1]), dict):
            raise ValueError(f"Path '{path}' is a leaf and also holds other paths")
        node[parts[-1]] = value
    return tree


def cast_floats(tree: Any, dtype: Optional[jnp.dtype]) -> Any:
    """Casts the floating-point leaves of `tree` to `dtype` (None: unchanged); other leaves
    (integers, keys, Python values) are kept as they are."""
    if dtype is None:
        return tree

    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


# ----- rematerialization policies -----
#
# A remat policy is called as `policy(primitive, *args, **params)` for each primitive of a
# `jax.checkpoint`ed function and says what becomes of its output in the backward pass:
# saved (True or Saveable), recomputed (False or Recompute), or offloaded to another
# memory (Offloadable(src, dst)). Checkpoint names (`checkpoint_name(x, 'q_proj')`)
# reach the policy as the primitive 'name' with params {'name': ...}.


def _remat_types():
    """(Saveable, Recompute, Offloadable): jax's remat decisions, which it does not export."""
    from jax._src.interpreters import partial_eval  # pylint: disable=import-outside-toplevel

    return partial_eval.Saveable, partial_eval.Recompute, partial_eval.Offloadable


@register_configurable
def save_and_offload_only_these_names_regex(
    *,
    names_which_can_be_saved: Optional[str],
    names_which_can_be_offloaded: Optional[str],
    offload_src: str = "device",
    offload_dst: str = "pinned_host",
) -> Callable:
    """A remat policy: save the checkpoint names that fully match one regex, offload those
    matching the other from `offload_src` to `offload_dst` memory, recompute the rest.
    A name matching both is saved."""
    saved = re.compile(names_which_can_be_saved) if names_which_can_be_saved else None
    offloaded = re.compile(names_which_can_be_offloaded) if names_which_can_be_offloaded else None

    def policy(prim, *_, **params):
        if getattr(prim, "name", None) != "name":
            return False
        name = params.get("name", "")
        if saved is not None and saved.fullmatch(name):
            return True
        if offloaded is not None and offloaded.fullmatch(name):
            return _remat_types()[2](src=offload_src, dst=offload_dst)
        return False

    return policy


@register_configurable
def offload_dots_with_no_batch_dims(prim: Any, *_, **params) -> Any:
    """A remat policy: offload the output of every matmul without batch dimensions (x @ W:
    the attention projections and the feed-forward layers) from device to pinned host
    memory, and recompute the rest (norms, activations, attention's own products).

    Where device memory cannot hold the activations, the backward pass reads the matmul
    outputs back from the host instead of recomputing them. A remat_spec names it as
    'axlearn.common.utils.offload_dots_with_no_batch_dims'; its save-on-device
    counterpart is jax's 'dots_with_no_batch_dims_saveable'.
    """
    if getattr(prim, "name", None) != "dot_general":
        return False
    _, (lhs_batch, rhs_batch) = params["dimension_numbers"]
    if lhs_batch or rhs_batch:
        return False
    return _remat_types()[2](src="device", dst="pinned_host")


def _remat_type(decision: Any) -> Any:
    """A policy's answer as Saveable, Recompute or Offloadable (policies may answer bools)."""
    saveable, recompute, _ = _remat_types()
    if isinstance(decision, bool):
        return saveable if decision else recompute
    return decision


@register_configurable
def combine_fn(p1: Any, p2: Any, *, prim: Any, args: tuple, kwargs: dict) -> Any:
    """How `combine_remat_policies` joins two decisions by default: whichever does not
    recompute wins; two different non-recompute decisions (save vs offload) are an error."""
    del args, kwargs
    _, recompute, _ = _remat_types()
    if p1 is recompute:
        return p2
    if p2 is recompute or p1 == p2:
        return p1
    raise ValueError(
        f"Remat policies disagree on primitive {prim}: {p1} vs {p2}; pass a combine_fn "
        "that chooses"
    )


@register_configurable
def combine_remat_policies(
    policy_1: Union[Callable, Any],
    policy_2: Union[Callable, Any],
    *,
    combine_fn: Callable = combine_fn,  # pylint: disable=redefined-outer-name
) -> Callable:
    """A remat policy that asks both policies (callables or configs of them) and joins
    their decisions with `combine_fn(p1, p2, prim=, args=, kwargs=)`."""
    policy_1, policy_2, combine = (
        p.instantiate() if hasattr(p, "instantiate") else p
        for p in (policy_1, policy_2, combine_fn)
    )

    def policy(prim, *args, **kwargs):
        return combine(
            _remat_type(policy_1(prim, *args, **kwargs)),
            _remat_type(policy_2(prim, *args, **kwargs)),
            prim=prim,
            args=args,
            kwargs=kwargs,
        )

    return policy
