"""Config modifiers that AXLearn's experiments apply on TPU meshes.

They set FlashAttention's TPU kernel settings: the block size (`tpu_block_size`) and
splash attention's block sizes (`backend_overrides`), as AXLearn's do. Their configs read,
dump and instantiate everywhere, so that AXLearn's mesh rules load unchanged; applied to a
trainer config they act on a TPU host only. On a GPU or CPU host, where no kernel reads
these settings, applying one logs a line saying so and leaves the config unchanged.
"""

import logging
from typing import Optional

import jax

from axlearn.common.config import ConfigBase, config_class
from axlearn.common.flash_attention.layer import FlashBlockSizeModifier, flash_attention_configs
from axlearn.common.trainer_config_modifier import ConfigModifier

_log = logging.getLogger(__name__)


def _backend() -> str:
    """The platform of this process's devices: 'tpu', 'gpu' or 'cpu'."""
    return jax.default_backend()


def _applies_here(modifier: ConfigModifier) -> bool:
    """Whether a TPU modifier applies on this host; if not, logs one line saying so."""
    backend = _backend()
    if backend == "tpu":
        return True
    _log.warning(
        "%s sets TPU attention kernel settings: not applied on %s, the config is unchanged",
        type(modifier).__name__,
        backend,
    )
    return False


class _TpuFlashConfigModifier(FlashBlockSizeModifier):
    """FlashBlockSizeModifier that applies on TPU hosts only."""

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        return super().__call__(cfg) if _applies_here(self) else cfg


class V6eFlashConfigModifier(_TpuFlashConfigModifier):
    """FlashAttention block size for TPU v6e."""

    @config_class
    class Config(_TpuFlashConfigModifier.Config):
        """Configures V6eFlashConfigModifier."""

        tpu_block_size: int = 1024


class V7xFlashConfigModifier(_TpuFlashConfigModifier):
    """FlashAttention block size for TPU v7x."""

    @config_class
    class Config(_TpuFlashConfigModifier.Config):
        """Configures V7xFlashConfigModifier."""

        tpu_block_size: int = 2048


class SplashAttentionConfigModifier(ConfigModifier):
    """Sets TPU splash attention's block sizes in every FlashAttention's backend_overrides
    (the fields that are set; None leaves the kernel's default)."""

    @config_class
    class Config(ConfigModifier.Config):
        """Configures SplashAttentionConfigModifier."""

        splash_block_q: Optional[int] = None  # Forward: query block.
        splash_block_kv: Optional[int] = None  # Forward: key/value block.
        splash_block_kv_compute: Optional[int] = None  # Forward: key/value compute block.
        splash_block_q_dkv: Optional[int] = None  # dK/dV backward: query block.
        splash_block_kv_dkv: Optional[int] = None  # dK/dV backward: key/value block.
        splash_block_kv_dkv_compute: Optional[int] = None  # dK/dV: key/value compute block.
        splash_block_q_dq: Optional[int] = None  # dQ backward: query block.
        splash_block_kv_dq: Optional[int] = None  # dQ backward: key/value block.

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        if not _applies_here(self):
            return cfg
        sizes = {
            key: value
            for key, value in self.config.items()
            if key.startswith("splash_") and value is not None
        }
        for attention in flash_attention_configs(cfg):
            attention.backend_overrides = {**(attention.backend_overrides or {}), **sizes}
        return cfg
