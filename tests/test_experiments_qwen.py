"""Qwen3 configs (axlearn/experiments/text/gpt/qwen.py): each registered config dumps to
AXLearn's own golden files of the same name (apple/axlearn, commit 34aed43c,
axlearn/experiments/testdata/axlearn.experiments.text.gpt.c4_trainer/), known here by
their SHA-256 (and compared line by line where a copy is among the shared goldens); that
text parses with every name and field resolved, and trains on the CPU at a reduced size.
"""

import difflib
import hashlib
import math

import pytest

from axlearn.common import golden_config
from axlearn.common.golden_text import parse_flat_text, unresolved_values
from axlearn.common.mixture_of_experts import TopKDropFreeGating, TransformerFeedForwardDropFreeMoE
from axlearn.common.utils import HybridMeshShape
from axlearn.experiments.text.gpt import qwen
from tests.test_axlearn_goldens import GOLDENS_DIR
from tests.test_experiments_fuji import KNOWN_EXTRA_LINES, _known_extra

# sha256 of AXLearn's files: (config text, _init text, _regularizer text).
AXLEARN_SHA256 = {
    "qwen3-30B-A3B-bs8m-seq8k": (
        "64d7a915505648f1d51ef81bd37a3b36c44f0035640ee576be770db6c396a680",
        "23cb60171c938f40d9fe3a8158aaa8704050aa02f253f97d4e602aac180e88b3",
        "6b5cc98f57fb9871166ac7338a2d7e0723ca089e8e9cef0ad21e5b6b8b5cd1fc",
    ),
    "qwen3-30B-A3B-bs16m-seq32k": (
        "cc95a051a9e8c6b4f06f19ac21863804e643d10fe8f0e3c32b557925d5ca3f70",
        "23cb60171c938f40d9fe3a8158aaa8704050aa02f253f97d4e602aac180e88b3",
        "6b5cc98f57fb9871166ac7338a2d7e0723ca089e8e9cef0ad21e5b6b8b5cd1fc",
    ),
}
NAMES = sorted(AXLEARN_SHA256)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@pytest.fixture(scope="module", name="configs")
def fixture_configs():
    return {name: builder() for name, builder in qwen.named_trainer_configs().items()}


def _as_axlearn_writes_it(cfg) -> str:
    """The config's golden text less the lines KNOWN_EXTRA_LINES explains (the defaults
    our classes set differently), with AXLearn's final newline."""
    lines = [line for line in cfg.debug_string().splitlines() if not _known_extra(line)]
    return "\n".join(lines) + "\n"


def test_registered_names_are_axlearns():
    assert sorted(qwen.named_trainer_configs()) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_qwen_config_dumps_as_axlearn_golden_but_for_known_defaults(name, configs):
    text = _as_axlearn_writes_it(configs[name])
    if GOLDENS_DIR is not None and (GOLDENS_DIR / f"{name}.txt").exists():
        theirs = (GOLDENS_DIR / f"{name}.txt").read_text(encoding="utf-8")
        diff = difflib.unified_diff(theirs.splitlines(), text.splitlines(), lineterm="")
        assert text == theirs, "\n".join(diff)
    assert _sha256(text) == AXLEARN_SHA256[name][0]


@pytest.mark.parametrize("name", NAMES)
def test_qwen_init_and_regularizer_texts_are_axlearns(name, configs):
    cfg = configs[name]
    assert _sha256(golden_config.init_text(cfg) + "\n") == AXLEARN_SHA256[name][1]
    assert _sha256(golden_config.regularizer_text(cfg) + "\n") == AXLEARN_SHA256[name][2]


def test_the_known_default_difference_is_only_the_decoder_attention_mask(configs):
    extra = [
        line
        for line in configs[NAMES[0]].debug_string().splitlines()
        if _known_extra(line)
    ]
    assert extra == ["model.decoder.attention_mask: None"] and len(KNOWN_EXTRA_LINES) == 1


def _axlearn_text(configs, name: str) -> str:
    """AXLearn's golden text of `name` (equal to ours less the known line, by its hash)."""
    text = _as_axlearn_writes_it(configs[name])
    assert _sha256(text) == AXLEARN_SHA256[name][0]
    return text


@pytest.mark.parametrize("name", NAMES)
def test_axlearn_qwen_golden_parses_fully_resolved_and_dumps_back(name, configs):
    text = _axlearn_text(configs, name)
    cfg = parse_flat_text(text, source=name, foreign=True)
    assert unresolved_values(cfg) == []
    assert cfg.debug_string() + "\n" == text
    moe = cfg.model.decoder.transformer.layer.feed_forward
    assert moe.klass is TransformerFeedForwardDropFreeMoE
    assert moe.gating.klass is TopKDropFreeGating and tuple(moe.tiling) == (128, 512, 512)
    gpu_mesh = cfg.mesh_rules[1][1].config_modifiers[0].mesh_shape
    assert {key: list(value) for key, value in gpu_mesh.items()} == {
        "ici_mesh_shape": [1, 1, 1, 8, 1, 1],
        "dcn_mesh_shape": [1, -1, 1, 1, 1, 1],
    }


def test_gpu_mesh_rule_is_a_hybrid_mesh_of_8_gpus_a_host(configs):
    rule = dict(configs[NAMES[0]].mesh_rules)[qwen._mesh_rules()[1][0]]
    shape = rule.config_modifiers[0].mesh_shape
    assert isinstance(shape, HybridMeshShape)
    assert shape.flat() == (1, -1, 1, 8, 1, 1)


def _reduced(text: str):
    """AXLearn's Qwen3 trainer from its golden text, at a CPU size: 2 layers of width 64,
    8 experts of 32 (2 a token), a 256-token vocabulary, 4 sequences of 32 a step of
    synthetic tokens, one device."""
    from axlearn.common import launch_data  # pylint: disable=import-outside-toplevel

    cfg = parse_flat_text(text, source="qwen", foreign=True)
    cfg.mesh_shape = (1, -1, 1, 1, 1, 1)
    decoder = cfg.model.decoder
    decoder.set(vocab_size=256, dim=64, eos_token_id=1, pad_token_id=0)
    decoder.transformer.num_layers = 2
    attention = decoder.transformer.layer.self_attention.attention
    attention.set(num_heads=4, hidden_dim=64)
    attention.input_linear.input_linear.num_kv_heads = 2
    moe = decoder.transformer.layer.feed_forward
    moe.set(hidden_dim=32, num_experts=8)
    moe.gating.num_experts_per_token = 2
    cfg.input.input_dispatcher.global_logical_batch_size = 4
    cfg.input.source.max_sequence_length = 32
    cfg.evalers = {}
    return launch_data.use_fake_data(cfg)


@pytest.mark.slow  # Compiles and runs a trainer (about a minute on 2 CPU cores).
@pytest.mark.parametrize("name", NAMES)
def test_axlearn_qwen_golden_trains_a_step_at_a_reduced_size(name, configs):
    cfg = _reduced(_axlearn_text(configs, name)).set(max_step=1)
    trainer = cfg.instantiate(parent=None)
    summaries = trainer.run()
    # At initialization the loss is about ln(256) = 5.55 (the z-loss adds a little).
    assert trainer.step == 1 and math.isfinite(summaries["loss"])
    assert abs(summaries["loss"] - math.log(256)) < 0.5


def test_the_gpu_rule_read_back_from_text_sets_a_hybrid_mesh(configs):
    cfg = parse_flat_text(_axlearn_text(configs, NAMES[0]), source="qwen", foreign=True)
    modifier = cfg.mesh_rules[1][1].config_modifiers[0].instantiate()
    shape = modifier(cfg).mesh_shape
    assert isinstance(shape, HybridMeshShape) and shape.flat() == (1, -1, 1, 8, 1, 1)
