"""axlearn.experiments.trainer_config_utils: AXLearn's TPU attention modifiers set the
kernel settings on TPU hosts and leave the config alone, saying so, elsewhere."""

import logging
import textwrap

import pytest

from axlearn.common.config import parse_flat_text
from axlearn.common.flash_attention.layer import FlashAttention
from axlearn.experiments import trainer_config_utils
from axlearn.experiments.trainer_config_utils import (
    SplashAttentionConfigModifier,
    V6eFlashConfigModifier,
    V7xFlashConfigModifier,
)
from tests.trainer_script import tiny_trainer_config


def _trainer_with_flash():
    cfg = tiny_trainer_config(trainer_dir=None, max_step=1)
    layer = cfg.model.decoder.transformer.layer
    flash = FlashAttention.default_config().set(
        num_heads=layer.self_attention.attention.num_heads, backend_overrides={"keep": 1}
    )
    layer.self_attention.attention = flash
    return cfg


def _flash(cfg):
    return cfg.model.decoder.transformer.layer.self_attention.attention


def _splash():
    return SplashAttentionConfigModifier.default_config().set(
        splash_block_q=2048, splash_block_kv=1024, splash_block_q_dkv=512, splash_block_kv_dq=256
    )


def test_block_size_defaults_are_axlearns():
    assert V6eFlashConfigModifier.default_config().tpu_block_size == 1024
    assert V7xFlashConfigModifier.default_config().tpu_block_size == 2048


def test_on_a_tpu_host_they_set_the_block_sizes_and_splash_overrides(monkeypatch):
    monkeypatch.setattr(trainer_config_utils, "_backend", lambda: "tpu")
    cfg = V7xFlashConfigModifier.default_config().instantiate()(_trainer_with_flash())
    cfg = _splash().instantiate()(cfg)
    assert _flash(cfg).tpu_block_size == 2048
    assert _flash(cfg).backend_overrides == {
        "keep": 1,
        "splash_block_q": 2048,
        "splash_block_kv": 1024,
        "splash_block_q_dkv": 512,
        "splash_block_kv_dq": 256,
    }


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("modifier", [V6eFlashConfigModifier, V7xFlashConfigModifier, None])
def test_off_tpu_they_leave_the_config_unchanged_and_say_so(monkeypatch, caplog, backend, modifier):
    monkeypatch.setattr(trainer_config_utils, "_backend", lambda: backend)
    modifier_cfg = _splash() if modifier is None else modifier.default_config()
    before = _trainer_with_flash().debug_string()
    with caplog.at_level(logging.WARNING, logger=trainer_config_utils.__name__):
        after = modifier_cfg.instantiate()(_trainer_with_flash()).debug_string()
    assert after == before
    name = type(modifier_cfg).__qualname__.split(".")[0]
    assert [r.getMessage() for r in caplog.records] == [
        f"{name} sets TPU attention kernel settings: not applied on {backend}, the config is "
        "unchanged"
    ]


def test_axlearn_golden_lines_of_the_tpu_modifiers_parse_and_instantiate(monkeypatch):
    text = textwrap.dedent(
        """\
        rule[0].klass: 'axlearn.experiments.trainer_config_utils.V7xFlashConfigModifier'
        rule[0].tpu_block_size: 2048
        rule[1].klass: 'axlearn.experiments.trainer_config_utils.SplashAttentionConfigModifier'
        rule[1].splash_block_kv_compute: 1024
        rule[1].splash_block_q: 4096
        """
    )
    v7x, splash = parse_flat_text(text)["rule"]
    monkeypatch.setattr(trainer_config_utils, "_backend", lambda: "tpu")
    cfg = splash.instantiate()(v7x.instantiate()(_trainer_with_flash()))
    assert _flash(cfg).tpu_block_size == 2048
    assert _flash(cfg).backend_overrides == {
        "keep": 1, "splash_block_kv_compute": 1024, "splash_block_q": 4096
    }
