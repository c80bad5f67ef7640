"""FlashAttention: grouped-query attention through a fused attention kernel.

On GPU the kernel is cuDNN's flash attention (`jax.nn.dot_product_attention`), where its
shapes and dtypes allow, and XLA's attention elsewhere: `GroupedQueryAttention`'s
automatic choice. What FlashAttention adds are sharding constraints on the kernel's
inputs and output, and the TPU kernel settings of AXLearn's configs (`tpu_block_size`,
`backend_overrides`), which are kept so that such configs read and dump unchanged, and
which nothing on GPU or CPU reads.

`FlashBlockSizeModifier` sets the block sizes of every FlashAttention in a trainer config.
"""

from typing import Any, Optional

from axlearn.common.attention import GroupedQueryAttention
from axlearn.common.config import ConfigBase, ConfigError, config_class
from axlearn.common.module import Tensor
from axlearn.common.sharding import maybe_shard
from axlearn.common.trainer_config_modifier import ConfigModifier

# The einsum-style names of the kernel's tensors: b batch, t query and s key positions,
# n heads, h head dim.
_INPUT_NAMES = ("btnh", "bsnh", "bnts")
_OUTPUT_NAMES = ("btnh", "bnts")


class FlashAttention(GroupedQueryAttention):
    """GroupedQueryAttention with its kernel's inputs and output sharded as configured."""

    @config_class
    class Config(GroupedQueryAttention.Config):
        """Configures FlashAttention."""

        # Block size of the TPU kernel. TPU only: the GPU and CPU kernels ignore it.
        tpu_block_size: int = 512
        # Sharding of the kernel's inputs: 'btnh' the queries [B,T,N,H], 'bsnh' the keys
        # and values [B,S,K,H]. ('bnts', AXLearn's attention-bias sharding, is accepted;
        # the kernels here build the mask inside, so it constrains nothing.)
        mha_dim_to_partition_spec: dict[str, Any] = {}
        # Sharding of the kernel's output: 'btnh' the context [B,T,N,H] ('bnts' as above).
        output_dim_to_partition_spec: dict[str, Any] = {}
        # Per-backend kernel settings (e.g. {'gpu_block_size': 64}, splash-attention block
        # sizes on TPU). The cuDNN and XLA kernels used here take none of them.
        backend_overrides: Optional[dict[str, Any]] = None

    def __init__(self, cfg: Config, *, parent):
        super().__init__(cfg, parent=parent)
        for field, names in (
            ("mha_dim_to_partition_spec", _INPUT_NAMES),
            ("output_dim_to_partition_spec", _OUTPUT_NAMES),
        ):
            unknown = sorted(set(getattr(cfg, field)) - set(names))
            if unknown:
                raise ConfigError(
                    f"{self.path()}.{field}: unknown tensor names {unknown}; use {names}"
                )

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
        cfg = self.config
        inputs = cfg.mha_dim_to_partition_spec
        q = maybe_shard(q, inputs.get("btnh"))
        k, v = (maybe_shard(t, inputs.get("bsnh")) for t in (k, v))
        context = super()._attend(q, k, v, **kwargs)
        return maybe_shard(context, cfg.output_dim_to_partition_spec.get("btnh"))


def flash_attention_configs(cfg: ConfigBase) -> list[ConfigBase]:
    """Every FlashAttention config of a trainer config's model (of `cfg` itself if it has
    no model; a trainer's mesh rules are left alone)."""
    found = []

    def enter(path: str, value: Any) -> bool:
        if isinstance(value, ConfigBase) and "klass" in value:
            klass = value.klass
            if isinstance(klass, type) and issubclass(klass, FlashAttention):
                found.append(value)
        return True

    root = cfg.model if isinstance(cfg, ConfigBase) and "model" in cfg else cfg
    root.visit(lambda path, value: None, enter)
    return found


class FlashBlockSizeModifier(ConfigModifier):
    """Sets the kernel block sizes of every FlashAttention of a trainer config: the TPU
    block size, and the GPU one as a backend override (which the cuDNN kernel ignores)."""

    @config_class
    class Config(ConfigModifier.Config):
        """Configures FlashBlockSizeModifier."""

        tpu_block_size: int = 512
        gpu_block_size: Optional[int] = None  # None: left as it is.

    def __call__(self, cfg):
        modifier = self.config
        for attention in flash_attention_configs(cfg):
            attention.tpu_block_size = modifier.tpu_block_size
            if modifier.gpu_block_size is not None:
                overrides = dict(attention.backend_overrides or {})
                overrides["gpu_block_size"] = modifier.gpu_block_size
                attention.backend_overrides = overrides
        return cfg
