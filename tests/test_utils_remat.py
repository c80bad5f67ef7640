"""Tests of the remat policies in axlearn.common.utils against jax's own name-set policies."""

import contextlib
import io
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

from axlearn.common.config import config_for_function
from axlearn.common.golden_text import parse_flat_text
from axlearn.common.utils import (
    combine_fn,
    combine_remat_policies,
    save_and_offload_only_these_names_regex,
)

RNG = np.random.default_rng(0)
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
