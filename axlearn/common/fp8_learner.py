"""Fp8Learner: a Learner that also keeps the FP8 layers' delayed-scaling state.

Delayed scaling (`axlearn.common.fp8`) keeps amax histories as parameters of the FP8
layers, so that they live in the model state and are checkpointed with it. The FP8
product's backward pass returns each history's next value as its gradient. This learner
freezes those parameters for the optimizer (no optimizer state, no weight decay, not in
the gradient norm or its clipping) and after each update sets each to its gradient.
`trainer_config_modifier.FP8ConfigModifier` puts it in place of the trainer's Learner.

With gradients accumulated over microbatches the "gradient" is the microbatches' mean:
the history with the mean of their amaxes in front (the steps before, alike in all).
"""

import re
from typing import Any, Optional

import jax
import jax.numpy as jnp

from axlearn.common import fp8
from axlearn.common.config import ConfigError, config_class
from axlearn.common.learner import Learner
from axlearn.common.module import Module, Tensor
from axlearn.common.utils import flatten_with_paths


class Fp8Learner(Learner):
    """A Learner whose parameters matching `state_regex` take their gradient as new value."""

    @config_class
    class Config(Learner.Config):
        """Configures Fp8Learner."""

        # '/'-joined parameter paths that are FP8 scaling state: frozen for the optimizer
        # (an update rule 'no_update' ahead of `update_rules`) and set to their gradient.
        state_regex: str = fp8.STATE_REGEX

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        try:
            state = re.compile(cfg.state_regex)
        except (re.error, TypeError) as e:
            raise ConfigError(f"{cfg.name}.state_regex: bad regex {cfg.state_regex!r}: {e}")
        cfg = cfg.clone(update_rules=[(cfg.state_regex, "no_update"), *(cfg.update_rules or ())])
        super().__init__(cfg, parent=parent)
        self._state = state

    def is_state(self, path: str) -> bool:
        """Whether the parameter at '/'-joined `path` is FP8 scaling state."""
        return self._state.fullmatch(path) is not None

    def is_differentiated(self, path: str) -> bool:
        """The scaling state is differentiated too: its gradient is its next value."""
        return self.is_state(path) or super().is_differentiated(path)

    def update(
        self,
        model_params: Any,
        grads: Any,
        learner_state: dict,
        *,
        param_specs: Optional[Any] = None,
        loss: Optional[Tensor] = None,
    ) -> tuple[Any, dict, dict[str, Tensor]]:
        """`Learner.update`, then each FP8 state parameter set to its gradient (kept as it
        was where that is not finite, as after a step the optimizer skips)."""
        new_params, new_state, summaries = super().update(
            model_params, grads, learner_state, param_specs=param_specs, loss=loss
        )
        paths = [path for path, _ in flatten_with_paths(new_params)]
        leaves, treedef = jax.tree_util.tree_flatten(new_params)
        grad_leaves = treedef.flatten_up_to(grads)
        written = [
            _next_value(param, grad) if self.is_state(path) else param
            for path, param, grad in zip(paths, leaves, grad_leaves)
        ]
        return treedef.unflatten(written), new_state, summaries


def _next_value(param: Tensor, grad: Tensor) -> Tensor:
    """`grad` in `param`'s dtype, or `param` where `grad` has a non-finite entry."""
    return jnp.where(jnp.all(jnp.isfinite(grad)), grad.astype(param.dtype), param)
