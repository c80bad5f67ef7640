"""Repeat: one layer config applied `num_layers` times with jax.lax.scan.

The parameters of the repeated layer are stacked on a new leading axis of size
`num_layers` (replicated over the mesh, fan axes shifted by one), so a deep stack
compiles once instead of once per layer. Inside the scan body the layer runs in its
own invocation context with its slice of the parameters, so `self.layer(...)` works as
in any parent and the layer's own `remat_spec` applies to every iteration. The `_init`
golden lines describe one layer's parameters, without the stacked axis, as AXLearn's do.

What the layer adds to its output collection comes out stacked along the layer axis;
`drop_output` names the collection paths that should not be kept at all (by default
module outputs, which would cost one activation-sized tensor per layer).
"""

import re
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax

from axlearn.common.base_layer import BaseLayer, is_parameter_spec, stacked_parameter_spec
from axlearn.common.config import (
    REQUIRED,
    ConfigError,
    ConfigOr,
    Required,
    config_class,
    config_for_function,
    maybe_instantiate,
    register_configurable,
)
from axlearn.common.module import (
    Module,
    OutputCollection,
    set_current_context,
    stacked_layer_context,
)
from axlearn.common.utils import flatten_with_paths


@register_configurable
def _drop_by_regex(rules: Sequence[str]) -> Callable[[str], bool]:
    """A predicate on '/'-joined output-collection paths: True if any rule fully matches."""
    patterns = [re.compile(rule) for rule in rules]
    return lambda path: any(p.fullmatch(path) for p in patterns)


def _filter_collection(
    collection: OutputCollection, drop: Optional[Callable[[str], bool]]
) -> OutputCollection:
    """A copy of `collection` without the leaves whose path `drop` selects."""
    if drop is None:
        return collection
    kept = OutputCollection()
    for field in ("summaries", "state_updates", "module_outputs"):
        tree = getattr(collection, field)
        flat = flatten_with_paths({field: tree})
        keep = {path: value for path, value in flat if not drop(path)}
        setattr(kept, field, _prune(tree, f"{field}", keep))
    return kept


def _prune(tree: Any, prefix: str, keep: dict[str, Any]) -> Any:
    """Rebuilds nested dict `tree` with only the leaves in `keep` (empty dicts stay)."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            path = f"{prefix}/{key}"
            if isinstance(value, dict):
                out[key] = _prune(value, path, keep)
            elif any(p == path or p.startswith(path + "/") for p in keep):
                out[key] = value
        return out
    return tree


class Repeat(BaseLayer):
    """Applies child `layer` `num_layers` times, scanning over its stacked parameters."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures Repeat."""

        layer: Required[BaseLayer.Config] = REQUIRED  # The layer to repeat; set by the parent.
        num_layers: Required[int] = REQUIRED
        # Which output-collection paths ('summaries/...', 'module_outputs/...') to drop:
        # a predicate on the '/'-joined path, or a config of one.
        drop_output: Optional[ConfigOr[Callable[[str], bool]]] = config_for_function(
            _drop_by_regex
        ).set(rules=["module_outputs.*"])

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        if not isinstance(cfg.num_layers, int) or cfg.num_layers < 1:
            raise ConfigError(
                f"{self.path()}.num_layers: expected a positive int, got {cfg.num_layers}"
            )
        self._add_child("layer", cfg.layer)
        self._drop = maybe_instantiate(cfg.drop_output)

    def create_parameter_specs_recursively(self) -> dict[str, Any]:
        specs = super().create_parameter_specs_recursively()
        num_layers = self.config.num_layers
        return jax.tree_util.tree_map(
            lambda s: stacked_parameter_spec(s, num_layers), specs, is_leaf=is_parameter_spec
        )

    def forward(self, carry: Any, **kwargs) -> Any:
        """carry <- layer(carry, **kwargs), num_layers times; kwargs are shared by all layers."""
        carry, _ = self._run(lambda c, _: (self.layer(c, **kwargs), None), carry)
        return carry

    def _run(
        self, fn: Callable[[Any, Any], tuple[Any, Any]], carry: Any, xs: Any = None
    ) -> tuple[Any, Any]:
        """Scans `(carry, y_i) = fn(carry, xs[i])` over the layers.

        `fn` runs in this module's context with layer i's parameters, so it calls the
        layer as `self.layer(...)` or `self.layer.<method>(...)`. Returns the final carry
        and the ys stacked along a leading layer axis.
        """
        cfg = self.config
        context = self.get_invocation_context()
        state = context.state if isinstance(context.state, dict) else {}
        layer_state = state.get("layer", {})
        prng_keys = (
            jax.random.split(context.prng_key, cfg.num_layers)
            if context.prng_key is not None
            else None
        )

        def body(carry, scanned):
            layer_state_i, prng_key_i, x_i = scanned
            inner = stacked_layer_context(context, layer_state_i, prng_key_i)
            with set_current_context(inner):
                carry, y = fn(carry, x_i)
            return carry, (y, _filter_collection(inner.output_collection, self._drop))

        carry, (ys, collection) = jax.lax.scan(
            body, carry, (layer_state, prng_keys, xs), length=cfg.num_layers
        )
        out = context.output_collection
        for field in ("summaries", "state_updates", "module_outputs"):
            getattr(out, field).update(getattr(collection, field))
        return carry, ys
