"""Generic pytree helpers: '/'-joined leaf paths and floating-point casts.

A leaf's path is the keys, attribute names and sequence indices that lead to it, joined
by '/' (`{'a': {'b': [x, y]}}` holds 'a/b/0' and 'a/b/1'): the names that checkpoints,
parameter regexes and golden `_init` lines use. Leaves come in jax's flatten order (dict
keys sorted), and None is an empty subtree, as in `jax.tree_util`.

This module is the bottom of the library's layering: it imports no other axlearn module.
"""

from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp


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
