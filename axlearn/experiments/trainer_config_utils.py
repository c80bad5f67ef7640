"""Config modifiers that AXLearn's experiments apply on TPU meshes.

They set FlashAttention's TPU kernel settings (`tpu_block_size`, splash-attention block
sizes as `backend_overrides`), so that the mesh rules of AXLearn's configs apply here
unchanged; the GPU and CPU kernels read none of these settings.
"""

from typing import Optional

from axlearn.common.config import config_class
from axlearn.common.flash_attention.layer import FlashBlockSizeModifier, flash_attention_configs
from axlearn.common.trainer_config_modifier import ConfigModifier


class V6eFlashConfigModifier(FlashBlockSizeModifier):
    """FlashAttention block size for TPU v6e."""


class V7xFlashConfigModifier(FlashBlockSizeModifier):
    """FlashAttention block size for TPU v7x."""


class SplashAttentionConfigModifier(ConfigModifier):
    """Sets TPU splash-attention block sizes of every FlashAttention (backend_overrides)."""

    @config_class
    class Config(ConfigModifier.Config):
        """Configures SplashAttentionConfigModifier."""

        splash_block_q: Optional[int] = None  # Query block; None: the kernel's default.
        splash_block_kv_compute: Optional[int] = None  # Key/value compute block; None: default.

    def __call__(self, cfg):
        sizes = {k: v for k, v in self.config.items() if k.startswith("splash_") and v}
        for attention in flash_attention_configs(cfg):
            attention.backend_overrides = {**(attention.backend_overrides or {}), **sizes}
        return cfg
