"""Fuji configs (axlearn/experiments/text/gpt/fuji.py): each registered config dumps to
AXLearn's own golden file of the same name, and the builder refuses what it lacks.

AXLearn's goldens are kept beside the repository, in shared/axlearn_goldens/; the
comparisons skip where they are absent.
"""

import difflib
import math
import re
import types

import jax
import pytest

from axlearn.common.config import ConfigError
from axlearn.experiments.text.gpt import fuji
from axlearn.experiments.text.gpt.common import scale_fn
from tests.test_axlearn_goldens import GOLDENS_DIR, golden_text


# Lines our dump has that AXLearn's lacks, each for a default our classes set differently:
# a regex on the whole line and why. A line matching none of these is a real difference.
KNOWN_EXTRA_LINES = (
    # A None field is dumped only where its default is not None. The reference gpt_3b dump
    # prints `attention_mask: None` (its AXLearn Decoder defaulted to a causal mask, ours to
    # 'causal'); AXLearn's Fuji-era Decoder defaults to None, so its dumps omit the None
    # these configs set. One Decoder class cannot have both defaults.
    (r"model\.decoder\.attention_mask: None", "decoder.Decoder.Config.attention_mask"),
)


def _axlearn_golden(name: str) -> str:
    if GOLDENS_DIR is not None and not (GOLDENS_DIR / f"{name}.txt").exists():
        pytest.skip(f"{name}.txt is not among the shared goldens")
    return golden_text(f"{name}.txt")


def _known_extra(line: str) -> bool:
    return any(re.fullmatch(regex, line) for regex, _ in KNOWN_EXTRA_LINES)


@pytest.fixture(scope="module")
def dumps() -> dict[str, str]:
    """Each registered Fuji config's golden text, as AXLearn writes it (final newline)."""
    return {
        name: builder().debug_string() + "\n"
        for name, builder in fuji.named_trainer_configs().items()
    }


@pytest.mark.parametrize("name", sorted(fuji.named_trainer_configs()))
def test_fuji_config_dumps_as_axlearn_golden_but_for_known_defaults(name, dumps):
    theirs = _axlearn_golden(name)
    ours = dumps[name]
    kept = [line for line in ours.splitlines() if not _known_extra(line)]
    if kept != theirs.splitlines():
        diff = difflib.unified_diff(
            theirs.splitlines(), kept, f"{name}.txt (AXLearn)", f"{name} (ours)", lineterm=""
        )
        pytest.fail(
            f"{name} differs from AXLearn's golden beyond KNOWN_EXTRA_LINES:\n" + "\n".join(diff),
            pytrace=False,
        )
    assert ours.endswith("\n") and theirs.endswith("\n")


def test_every_known_difference_still_occurs(dumps):
    # An entry no dump needs any more (its default was aligned) must leave the table.
    lines = [line for text in dumps.values() for line in text.splitlines()]
    for regex, why in KNOWN_EXTRA_LINES:
        assert any(re.fullmatch(regex, line) for line in lines), f"stale entry: {why}"


def test_registered_names_are_axlearns_names():
    assert "fuji-8B-v3-tiktoken-flash-single-host" in fuji.named_trainer_configs()
    name = fuji.config_name("70B", fuji.Version.V3, fp8=True, flash_attention=True)
    assert name == "fuji-70B-v3-flash-fp8"


def test_a_new_size_is_a_row_of_the_size_table(monkeypatch):
    sizes = dict(fuji.SIZES, tiny=fuji.SIZES["test"])
    monkeypatch.setattr(fuji, "SIZES", sizes)
    monkeypatch.setitem(fuji.MESH_RULES, "tiny", fuji.MESH_RULES["test"])
    cfg = fuji.fuji_trainer("tiny", version=fuji.Version.V3)
    assert cfg.model.decoder.dim == fuji.SIZES["test"].dim


@pytest.mark.parametrize(
    "size,version,variants,message",
    [
        ("2B", fuji.Version.V3, {}, "unknown size '2B'"),
        ("1B", fuji.Version.V1, {}, "no size '1B' in V1"),
        ("7B", fuji.Version.V2, dict(tiktoken=True), "tiktoken is Llama 3's tokenizer"),
        ("8B", fuji.Version.V3, dict(fp8=True), "8B has no FP8 rules"),
    ],
)
def test_builder_refuses_what_the_tables_lack(size, version, variants, message):
    with pytest.raises(ConfigError, match=message):
        fuji.fuji_trainer(size, version=version, **variants)


def test_versions_derive_batch_and_steps_from_tokens():
    # 15T tokens in batches of 16M tokens (2048 sequences of 8192), as AXLearn's V3.
    cfg = fuji.fuji_trainer("1B", version=fuji.Version.V3)
    assert cfg.max_step == 15 * 1024**4 // (16 * 1024**2) == 983040
    assert cfg.input.input_dispatcher.global_logical_batch_size == 2048
    v2 = fuji.fuji_trainer("7B", version=fuji.Version.V2)
    assert (v2.max_step, v2.input.input_dispatcher.global_logical_batch_size) == (524288, 1024)


# ----- config names -----
# Names AXLearn's Fuji goldens refer to in its experiment modules: the feed-forward
# `scale_fn` (against its arithmetic) and the offload remat policies (against jax's own).


@pytest.mark.parametrize(
    "dim,scale,multiple", [(8, 8 / 3, 16), (4096, 8 / 3, 256), (2048, 3.5, 256)]
)
def test_scale_fn_rounds_the_scaled_dim_up_to_the_multiple(dim, scale, multiple):
    want = math.ceil(math.ceil(dim * scale) / multiple) * multiple
    assert scale_fn(dim, scale=scale, round_up_to_multiples_of=multiple) == want


def test_scale_fn_needs_the_layer_to_set_input_dim():
    with pytest.raises(ConfigError, match="input_dim is set by the feed-forward layer"):
        scale_fn(scale=2.0)


def _name(name: str):
    return types.SimpleNamespace(name="name"), {"name": name}


def test_attention_proj_policy_offloads_qkv_projections_only():
    for name, offloaded in (("Attention.q_proj", True), ("Attention.o_proj", False)):
        prim, params = _name(name)
        decision = fuji.offload_attention_proj_policy(prim, **params)
        assert (getattr(decision, "dst", None) == "pinned_host") is offloaded


def test_dots_policy_decides_as_jax_offload_dot_with_no_batch_dims():
    want = jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        offload_src="device", offload_dst="pinned_host"
    )
    prim = jax.lax.dot_general_p
    params = dict(dimension_numbers=(((1,), (0,)), ((), ())))
    assert fuji.offload_dots_saveable_policy(prim, **params) == want(prim, **params)
