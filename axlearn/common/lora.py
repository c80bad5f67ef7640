"""Low-rank adaptation (LoRA, https://arxiv.org/abs/2106.09685) under AXLearn's names.

A LoRA layer holds the layer it adapts (child `layer`, frozen in training) and an
adapter (child `adapter`) beside it: y = layer(x) + (alpha / rank) * up(down(dropout(x))),
where `down` maps the input to `rank` dims and `up` (initialized to zero, so a fresh
adapter leaves the layer's function unchanged) maps back to the output.

    LoraLinear                 replaces a Linear (feed-forward, lm head, ...)
    LoraMultiheadOutputLinear  replaces attention's output projection [D, N, H]
    LoraFusedQKVLinear         replaces a fused QKV projection (FusedQKVLinear, or
                               FusedGroupedQKVLinear as in our Llama), with adapters on
                               any of query, key and value (`enable_lora`)

Parameter paths, as AXLearn's: `<layer path>/layer/...` (the base) and
`<layer path>/adapter/lora_down/weight`, `.../adapter/lora_up/weight`. The fused
adapter's down projection is one weight [D, s, rank] for its s enabled projections (one
matmul over the input); its up weight is [rank, heads of the enabled projections,
per_head_dim] (query heads, then key heads, then value heads): AXLearn's
[s, rank, N, H] cannot hold grouped key/value heads.

`LoraConfigModifier` puts adapters on the layers a trainer config names (PEFT's Llama
module names or regexes over config paths), freezes everything else through the
learner's `update_rules` (frozen parameters: no gradients, no optimizer state) and stores
the frozen parameters in `base_dtype` (bfloat16) while the adapters stay float32.

`adapters_disabled()` is a trace-time switch: inside it every LoRA layer computes its
base layer alone (a frozen reference model without a second copy of the weights).
"""

import contextlib
import re
import threading
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp

from axlearn.common.attention import (
    BaseQKVLinear,
    FusedGroupedQKVLinear,
    FusedQKVLinear,
    QKV,
    MultiheadOutputLinear,
)
from axlearn.common.base_layer import (
    BaseLayer,
    MeshAxes,
    ParameterSpec,
    WeightWithCopy,
    weight_einsum,
)
from axlearn.common.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    ConfigModifier,
    Required,
    config_class,
)
from axlearn.common.layers import Dropout, Linear
from axlearn.common.module import Module, Tensor
from axlearn.common.param_init import FanAxes, constant_initializer
from axlearn.common.sharding import maybe_shard
from axlearn.common.utils import flatten_with_paths, unflatten_paths

# ----- the trace-time switch -----

_STATE = threading.local()


@contextlib.contextmanager
def adapters_disabled():
    """Inside this context (while a function is traced), every LoRA layer computes its
    frozen base layer alone, as if its adapter were zero."""
    previous = getattr(_STATE, "disabled", False)
    _STATE.disabled = True
    try:
        yield
    finally:
        _STATE.disabled = previous


def adapters_are_disabled() -> bool:
    """Whether `adapters_disabled()` is in effect."""
    return getattr(_STATE, "disabled", False)


# ----- adapters -----


class _BaseLoraAdapter(BaseLayer):
    """The common fields of LoRA adapters: (alpha / rank) * up(down(dropout(x)))."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures an adapter."""

        input_dim: Required[int] = REQUIRED  # Set by the LoRA layer.
        output_dim: Required[int] = REQUIRED  # Set by the LoRA layer.
        rank: Required[int] = REQUIRED  # Inner dim of the adapter; > 0.
        alpha: Required[float] = REQUIRED  # The adapter's output is scaled by alpha / rank.
        # Dropout on the adapter's input (not on the base layer's).
        dropout: Dropout.Config = Dropout.default_config().set(rate=0.0)

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        if not isinstance(cfg.rank, int) or isinstance(cfg.rank, bool) or cfg.rank < 1:
            raise ConfigError(f"{self.path()}.rank must be an int >= 1, got {cfg.rank!r}")
        if cfg.rank > min(cfg.input_dim, cfg.output_dim):
            raise ConfigError(
                f"{self.path()}.rank {cfg.rank} exceeds the layer's smaller dim "
                f"({cfg.input_dim} in, {cfg.output_dim} out)"
            )
        self._add_child("lora_dropout", cfg.dropout)

    @property
    def scaling(self) -> float:
        cfg = self.config
        return cfg.alpha / cfg.rank


def _zero_up(shape, mesh_axes, fan_axes) -> ParameterSpec:
    return ParameterSpec(
        shape=shape, mesh_axes=mesh_axes, fan_axes=fan_axes, initializer=constant_initializer(0.0)
    )


class LoraLinearAdapter(_BaseLoraAdapter):
    """The adapter of a Linear: lora_down [input_dim, rank], lora_up [rank, output_dim]."""

    def __init__(self, cfg: _BaseLoraAdapter.Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        self._add_child(
            "lora_down",
            Linear.default_config().set(
                input_dim=cfg.input_dim, output_dim=cfg.rank, bias=False,
                param_partition_spec=(None, None),
            ),
        )
        self._add_child("lora_up", _ZeroLinear.default_config().set(
            input_dim=cfg.rank, output_dim=cfg.output_dim, bias=False,
            param_partition_spec=(None, None),
        ))

    def forward(self, x: Tensor) -> Tensor:
        z = self.lora_down(self.lora_dropout(x)) * jnp.asarray(self.scaling, x.dtype)
        return self.lora_up(z)


class _ZeroLinear(Linear):
    """A Linear whose weight starts at zero (an adapter's up projection)."""

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        specs = super()._create_layer_parameter_specs()
        weight = specs["weight"]
        specs["weight"] = _zero_up(weight.shape, weight.mesh_axes, weight.fan_axes)
        return specs


class LoraDownMultiheadLinear(BaseLayer):
    """[..., num_heads, per_head_dim] -> [..., rank]; weight [rank, N, H] (AXLearn's)."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures LoraDownMultiheadLinear."""

        model_dim: Required[int] = REQUIRED  # The rank.
        num_heads: Required[int] = REQUIRED
        per_head_dim: Required[int] = REQUIRED

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self.config
        return dict(
            weight=ParameterSpec(
                shape=(cfg.model_dim, cfg.num_heads, cfg.per_head_dim),
                mesh_axes=(None, None, None),
                fan_axes=FanAxes(in_axis=(1, 2), out_axis=0),
            )
        )

    def forward(self, x: Tensor) -> Tensor:
        return weight_einsum("...nh,rnh->...r", x, self.parameters["weight"])


class LoraMultiheadOutputAdapter(_BaseLoraAdapter):
    """The adapter of attention's output projection: lora_down [rank, N, H] (from the
    heads), lora_up [rank, output_dim]."""

    @config_class
    class Config(_BaseLoraAdapter.Config):
        """Configures LoraMultiheadOutputAdapter."""

        num_heads: Required[int] = REQUIRED  # Set by the LoRA layer.

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        if cfg.input_dim % cfg.num_heads:
            raise ConfigError(
                f"{self.path()}: input_dim {cfg.input_dim} is not a multiple of "
                f"num_heads {cfg.num_heads}"
            )
        self._add_child(
            "lora_down",
            LoraDownMultiheadLinear.default_config().set(
                model_dim=cfg.rank, num_heads=cfg.num_heads,
                per_head_dim=cfg.input_dim // cfg.num_heads,
            ),
        )
        self._add_child("lora_up", _ZeroLinear.default_config().set(
            input_dim=cfg.rank, output_dim=cfg.output_dim, bias=False,
            param_partition_spec=(None, None),
        ))

    def forward(self, x: Tensor) -> Tensor:
        z = self.lora_down(self.lora_dropout(x)) * jnp.asarray(self.scaling, x.dtype)
        return self.lora_up(z)


_QKV_NAMES = ("query", "key", "value")


class LoraDownFusedLinear(BaseLayer):
    """The fused adapter's down projection: [..., D] -> [..., s, rank]; weight [D, s, rank]."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures LoraDownFusedLinear."""

        input_dim: Required[int] = REQUIRED  # Feature dim.
        num_enabled: Required[int] = REQUIRED  # Projections with an adapter (1 to 3).
        output_dim: Required[int] = REQUIRED  # The rank.

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self.config
        return dict(
            weight=ParameterSpec(
                shape=(cfg.input_dim, cfg.num_enabled, cfg.output_dim),
                mesh_axes=(None, None, None),
                fan_axes=FanAxes(in_axis=0, out_axis=2, batch_axis=1),
            )
        )

    def forward(self, x: Tensor) -> Tensor:
        return weight_einsum("...d,dsr->...sr", x, self.parameters["weight"])


class LoraUpFusedLinear(BaseLayer):
    """The fused adapter's up projection: weight [rank, heads, H], where `heads` lists the
    heads of each enabled projection in turn (its `head_counts`)."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures LoraUpFusedLinear."""

        input_dim: Required[int] = REQUIRED  # The rank.
        head_counts: Required[Sequence[int]] = REQUIRED  # Heads of each enabled projection.
        per_head_dim: Required[int] = REQUIRED

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self.config
        return dict(
            weight=_zero_up(
                (cfg.input_dim, sum(cfg.head_counts), cfg.per_head_dim),
                (None, None, None),
                FanAxes(in_axis=0, out_axis=(1, 2)),
            )
        )

    def forward(self, z: Tensor) -> tuple[Tensor, ...]:
        """z [..., s, rank] -> one [..., heads_i, H] per enabled projection."""
        weight = self.parameters["weight"]
        outputs, start = [], 0
        for i, count in enumerate(self.config.head_counts):
            part = _heads_slice(weight, start, count)
            outputs.append(weight_einsum("...r,rnh->...nh", z[..., i, :], part))
            start += count
        return tuple(outputs)


def _heads_slice(weight: Any, start: int, count: int) -> Any:
    """weight[:, start:start + count] of a weight or of a `WeightWithCopy`'s two halves."""
    if isinstance(weight, WeightWithCopy):
        return WeightWithCopy(*(_heads_slice(w, start, count) for w in weight))
    return weight[:, start : start + count]


class LoraFusedQKVAdapter(_BaseLoraAdapter):
    """The adapter of a fused QKV projection: one down projection for the enabled
    projections, then one up projection each (see the module doc for the weights)."""

    @config_class
    class Config(_BaseLoraAdapter.Config):
        """Configures LoraFusedQKVAdapter."""

        # Which of query, key, value get an adapter: {'query': bool, 'key': ..., 'value': ...}.
        enable_lora: Required[dict[str, bool]] = REQUIRED
        num_heads: Required[int] = REQUIRED  # Query heads; set by the LoRA layer.
        num_kv_heads: Optional[int] = None  # Key/value heads; None: num_heads.

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        enable = cfg.enable_lora
        if not isinstance(enable, dict) or set(enable) != set(_QKV_NAMES) or not all(
            isinstance(v, bool) for v in enable.values()
        ):
            raise ConfigError(
                f"{self.path()}.enable_lora must map each of {_QKV_NAMES} to a bool, got "
                f"{enable!r}"
            )
        if not any(enable.values()):
            raise ConfigError(f"{self.path()}.enable_lora enables none of {_QKV_NAMES}")
        if cfg.output_dim % cfg.num_heads:
            raise ConfigError(
                f"{self.path()}: output_dim {cfg.output_dim} is not a multiple of "
                f"num_heads {cfg.num_heads}"
            )
        kv_heads = cfg.num_kv_heads or cfg.num_heads
        heads = dict(query=cfg.num_heads, key=kv_heads, value=kv_heads)
        self._enabled = tuple(name for name in _QKV_NAMES if enable[name])
        self._add_child(
            "lora_down",
            LoraDownFusedLinear.default_config().set(
                input_dim=cfg.input_dim, num_enabled=len(self._enabled), output_dim=cfg.rank
            ),
        )
        self._add_child(
            "lora_up",
            LoraUpFusedLinear.default_config().set(
                input_dim=cfg.rank,
                head_counts=[heads[name] for name in self._enabled],
                per_head_dim=cfg.output_dim // cfg.num_heads,
            ),
        )

    @property
    def enabled(self) -> tuple[str, ...]:
        """The names of the projections with an adapter, in order."""
        return self._enabled

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        """{name: [..., heads, H]} for each enabled projection."""
        z = self.lora_down(self.lora_dropout(x)) * jnp.asarray(self.scaling, x.dtype)
        return dict(zip(self._enabled, self.lora_up(z)))


# ----- LoRA layers -----


class LoraLinear(BaseLayer):
    """LoRA's replacement of a Linear: layer(x) + adapter(x)."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures LoraLinear."""

        input_dim: Required[int] = REQUIRED  # Set by the parent, as a Linear's.
        output_dim: Required[int] = REQUIRED
        layer: Linear.Config = Linear.default_config()  # The adapted (frozen) layer.
        adapter: LoraLinearAdapter.Config = LoraLinearAdapter.default_config()
        # Sharding constraint on the sum (the Linear's output_partition_spec, which the
        # modifier moves here; the layer's own is then None). None: none.
        output_partition_spec: Optional[MeshAxes] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        dims = dict(input_dim=cfg.input_dim, output_dim=cfg.output_dim)
        self._add_child("layer", cfg.layer.clone(**dims))
        self._add_child("adapter", cfg.adapter.clone(**dims))

    def forward(self, x: Tensor) -> Tensor:
        y = self.layer(x)
        if not adapters_are_disabled():
            y = y + self.adapter(x).astype(y.dtype)
        return maybe_shard(y, self.config.output_partition_spec)


class LoraMultiheadOutputLinear(BaseLayer):
    """LoRA's replacement of attention's MultiheadOutputLinear: layer(x) + adapter(x)."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures LoraMultiheadOutputLinear."""

        model_dim: Required[int] = REQUIRED  # Set by the attention layer.
        num_heads: Required[int] = REQUIRED
        per_head_dim: Required[int] = REQUIRED
        layer: MultiheadOutputLinear.Config = MultiheadOutputLinear.default_config()
        adapter: LoraMultiheadOutputAdapter.Config = LoraMultiheadOutputAdapter.default_config()

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        self._add_child(
            "layer",
            cfg.layer.clone(
                model_dim=cfg.model_dim, num_heads=cfg.num_heads, per_head_dim=cfg.per_head_dim
            ),
        )
        self._add_child(
            "adapter",
            cfg.adapter.clone(
                input_dim=cfg.num_heads * cfg.per_head_dim,
                output_dim=cfg.model_dim,
                num_heads=cfg.num_heads,
            ),
        )

    def forward(self, x: Tensor) -> Tensor:
        y = self.layer(x)
        if adapters_are_disabled():
            return y
        return y + self.adapter(x).astype(y.dtype)


class LoraFusedQKVLinear(BaseQKVLinear):
    """LoRA's replacement of a fused QKV projection (FusedQKVLinear or
    FusedGroupedQKVLinear, self-attention only): each enabled projection's output gains
    its adapter's."""

    @config_class
    class Config(BaseQKVLinear.Config):
        """Configures LoraFusedQKVLinear."""

        # The adapted (frozen) projection: FusedGroupedQKVLinear or FusedQKVLinear.
        layer: BaseQKVLinear.Config = FusedQKVLinear.default_config()
        adapter: LoraFusedQKVAdapter.Config = LoraFusedQKVAdapter.default_config()

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        if cfg.layer.klass not in (FusedQKVLinear, FusedGroupedQKVLinear):
            raise ConfigError(
                f"{self.path()}.layer: expected FusedQKVLinear or FusedGroupedQKVLinear, got "
                f"{cfg.layer.klass.__name__}"
            )
        self._add_child(
            "layer",
            cfg.layer.clone(
                query_dim=cfg.query_dim, key_dim=cfg.key_dim, value_dim=cfg.value_dim,
                num_heads=cfg.num_heads, per_head_dim=cfg.per_head_dim,
                cache_dtype=cfg.cache_dtype,
            ),
        )
        self._add_child(
            "adapter",
            cfg.adapter.clone(
                input_dim=cfg.query_dim,
                output_dim=cfg.num_heads * cfg.per_head_dim,
                num_heads=cfg.num_heads,
                num_kv_heads=self.layer.num_kv_heads,
            ),
        )

    @property
    def num_kv_heads(self) -> int:
        return self.layer.num_kv_heads

    @property
    def cache_dtype(self) -> Optional[jnp.dtype]:
        return self._config.cache_dtype or self.layer.cache_dtype

    def forward(
        self,
        query: Tensor,
        *,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        query_positions: Optional[Tensor] = None,
        key_positions: Optional[Tensor] = None,
    ) -> QKV:
        del query_positions, key_positions  # Not rotary.
        if key is not None or value is not None:
            raise ValueError(f"{self.path()}: LoRA on a fused projection is for self-attention")
        proj = self.layer(query)
        if adapters_are_disabled():
            return proj
        deltas = self.adapter(query)
        return QKV(
            *(
                p + deltas[name].astype(p.dtype) if name in deltas else p
                for name, p in zip(_QKV_NAMES, proj)
            )
        )


LORA_LAYERS = (LoraLinear, LoraMultiheadOutputLinear, LoraFusedQKVLinear)
# The base class each LoRA layer adapts.
_WRAPS = {Linear: LoraLinear, MultiheadOutputLinear: LoraMultiheadOutputLinear}

# ----- the config modifier -----

_ATTENTION = "decoder.transformer.layer.self_attention.attention"
_FEED_FORWARD = "decoder.transformer.layer.feed_forward"
# PEFT's (Hugging Face's) Llama module names -> (our config path below the model, which
# of a fused projection's outputs).
PEFT_LLAMA_MODULES = {
    "q_proj": (f"{_ATTENTION}.input_linear.input_linear", "query"),
    "k_proj": (f"{_ATTENTION}.input_linear.input_linear", "key"),
    "v_proj": (f"{_ATTENTION}.input_linear.input_linear", "value"),
    "o_proj": (f"{_ATTENTION}.output_linear", None),
    "gate_proj": (f"{_FEED_FORWARD}.linear1", None),
    "up_proj": (f"{_FEED_FORWARD}.linear1", None),
    "down_proj": (f"{_FEED_FORWARD}.linear2", None),
}
# The regex of adapter parameters (the only ones that train).
ADAPTER_PARAM_REGEX = r".*/adapter/lora_(down|up)/weight"


class LoraConfigModifier(ConfigModifier):
    """Puts LoRA adapters on the named layers of a trainer config's model and trains
    only them.

    Each target is one of PEFT's Llama module names (q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj) or a regex that fully matches a layer's config path
    below `model` (e.g. 'decoder.transformer.layer.feed_forward.linear2'); a target that
    matches nothing is an error. gate_proj and up_proj share one config (the feed-forward's
    `linear1`), so they are targeted together. The learner's `update_rules` become
    [(ADAPTER_PARAM_REGEX, 'all'), ('.*', 'no_update')]: the rest is frozen; and the
    trainer's `checkpoint_frozen_params` False: checkpoints do not write the frozen base,
    which a restore takes from its source (the --init_from_hf directory, or param_init).
    """

    @config_class
    class Config(ConfigModifier.Config):
        """Configures LoraConfigModifier."""

        target_modules: Required[Sequence[str]] = REQUIRED  # PEFT Llama names or regexes.
        rank: Required[int] = REQUIRED  # The adapters' rank.
        alpha: Required[float] = REQUIRED  # Adapter outputs are scaled by alpha / rank.
        dropout: float = 0.0  # Dropout rate on the adapters' inputs.
        # Dtype of every parameter outside the adapters (all frozen); None: model.dtype.
        base_dtype: Optional[jnp.dtype] = jnp.bfloat16
        adapter_dtype: jnp.dtype = jnp.float32  # Dtype of the adapters' weights.

    def __call__(self, cfg):
        self.apply_to_model(cfg.model)
        cfg.learner.update_rules = [(ADAPTER_PARAM_REGEX, "all"), (".*", "no_update")]
        # Checkpoints hold the adapters and their optimizer state; a restore reads the
        # frozen base from its source again, checked by fingerprint.
        cfg.checkpoint_frozen_params = False
        return cfg

    def apply_to_model(self, model: ConfigBase) -> ConfigBase:
        """Puts the adapters on `model` (a model config, changed in place); returns it."""
        mcfg = self.config
        layers = _layer_configs(model)
        wanted: dict[str, set] = {}  # Config path -> enabled fused outputs (or {None}).
        names = set(mcfg.target_modules)
        if ("gate_proj" in names) != ("up_proj" in names):
            raise ConfigError(
                "LoraConfigModifier.target_modules: gate_proj and up_proj share one config "
                f"({_FEED_FORWARD}.linear1); name both or neither"
            )
        for target in mcfg.target_modules:
            if target in PEFT_LLAMA_MODULES:
                path, output = PEFT_LLAMA_MODULES[target]
                if path not in layers:
                    raise ConfigError(
                        f"LoraConfigModifier.target_modules: {target} is model.{path}, which "
                        "this model does not have"
                    )
                wanted.setdefault(path, set()).add(output)
                continue
            try:
                regex = re.compile(target)
            except re.error as e:
                raise ConfigError(f"LoraConfigModifier.target_modules: bad regex {target!r}: {e}")
            matched = [p for p in layers if regex.fullmatch(p) and _adaptable(layers[p])]
            if not matched:
                raise ConfigError(
                    f"LoraConfigModifier.target_modules: {target!r} matches no Linear, "
                    "MultiheadOutputLinear or fused QKV projection below model"
                )
            for path in matched:
                wanted.setdefault(path, set()).update(_QKV_NAMES if _is_fused(layers[path])
                                                      else {None})
        if mcfg.base_dtype is not None:
            model.dtype = mcfg.base_dtype
        for path, outputs in sorted(wanted.items()):
            _set_path(model, path, self._wrap(layers[path], outputs, path))
        return model

    def _wrap(self, layer: ConfigBase, outputs: set, path: str) -> ConfigBase:
        mcfg = self.config
        adapter = dict(
            rank=mcfg.rank, alpha=float(mcfg.alpha), dtype=mcfg.adapter_dtype,
            dropout=Dropout.default_config().set(rate=mcfg.dropout),
        )
        if _is_fused(layer):
            wrapped = LoraFusedQKVLinear.default_config().set(layer=layer)
            enable = {name: name in outputs for name in _QKV_NAMES}
            wrapped.adapter.set(enable_lora=enable, **adapter)
            return wrapped
        klass = _WRAPS.get(layer.klass)
        if klass is None:
            raise ConfigError(f"LoraConfigModifier: model.{path} is a {layer.klass.__name__}")
        wrapped = klass.default_config().set(layer=layer)
        wrapped.adapter.set(**adapter)
        if klass is LoraLinear:
            wrapped.output_partition_spec = layer.output_partition_spec
            layer.output_partition_spec = None
        return wrapped


def _is_fused(layer: ConfigBase) -> bool:
    return getattr(layer, "klass", None) in (FusedQKVLinear, FusedGroupedQKVLinear)


def _adaptable(layer: ConfigBase) -> bool:
    return _is_fused(layer) or getattr(layer, "klass", None) in _WRAPS


def _layer_configs(model: ConfigBase) -> dict[str, ConfigBase]:
    """Config path below the model ('decoder.x.y') -> every layer config there."""
    found = {}

    def enter(path: str, value: Any) -> bool:
        if isinstance(value, BaseLayer.Config):
            if getattr(value, "klass", None) in LORA_LAYERS:
                raise ConfigError(f"LoraConfigModifier: model.{path} has adapters already")
            found[path] = value
        return True

    model.visit(lambda *_: None, enter)
    return found


def _set_path(cfg: ConfigBase, path: str, value: ConfigBase) -> None:
    *parents, last = path.split(".")
    for name in parents:
        cfg = getattr(cfg, name)
    setattr(cfg, last, value)


# ----- LoRA configs and parameters -----


def lora_layer_configs(model: ConfigBase) -> dict[str, ConfigBase]:
    """Config path below the model -> every LoRA layer config in `model`."""
    found = {}

    def enter(path: str, value: Any) -> bool:
        if getattr(value, "klass", None) in LORA_LAYERS:
            found[path] = value
            return False
        return True

    model.visit(lambda *_: None, enter)
    return found


def base_model_config(model: ConfigBase) -> ConfigBase:
    """`model` with each LoRA layer config replaced by its base layer's config."""
    model = model.clone()
    for path, value in lora_layer_configs(model).items():
        _set_path(model, path, value.layer)
    return model


def with_lora_layers(model: ConfigBase, lora_layers: dict[str, ConfigBase]) -> ConfigBase:
    """`model` with the layer at each path of `lora_layers` (from `lora_layer_configs` of
    a model of the same structure) wrapped again in that LoRA layer config."""
    model = model.clone()
    for path, value in lora_layers.items():
        node = model
        for name in path.split("."):
            if not isinstance(node, ConfigBase) or name not in node.keys():
                raise ConfigError(f"model.{path}: no such layer to put the adapter on")
            node = getattr(node, name)
        _set_path(model, path, value.clone(layer=node))
    return model


def _lora_modules(module: Module, params: Any, prefix: str = ""):
    """(param path, LoRA module, its params) for each LoRA layer below `module`."""
    if isinstance(module, LORA_LAYERS):
        yield prefix, module, params
        return
    for name, child in module.children.items():
        if isinstance(params, dict) and name in params:
            yield from _lora_modules(child, params[name], f"{prefix}{name}/")


def lora_modules(model: Module, params: Any) -> list[tuple[str, Module, Any]]:
    """(param path prefix 'decoder/.../', LoRA layer, its parameter subtree) for each LoRA
    layer of the instantiated `model`; subtrees may carry leading stacked (layer) axes."""
    return list(_lora_modules(model, params))


def adapter_deltas(module: Module, params: Any) -> dict[str, Tensor]:
    """The float32 weight change each adapter of a LoRA layer makes, in the base layer's
    weight layout (leading stacked axes kept): {'weight': ...} for a Linear or an output
    projection; {'query'|'key'|'value': [..., D, heads, H]} for a fused projection."""
    adapter = params["adapter"]
    down = jnp.asarray(adapter["lora_down"]["weight"], jnp.float32)
    up = jnp.asarray(adapter["lora_up"]["weight"], jnp.float32)
    scale = module.adapter.scaling
    if isinstance(module, LoraLinear):
        return dict(weight=scale * jnp.einsum("...ir,...ro->...io", down, up))
    if isinstance(module, LoraMultiheadOutputLinear):
        # Base weight [D, N, H]; down [r, N, H], up [r, D].
        return dict(weight=scale * jnp.einsum("...rnh,...rd->...dnh", down, up))
    counts = module.adapter.lora_up.config.head_counts
    deltas, start = {}, 0
    for i, (name, count) in enumerate(zip(module.adapter.enabled, counts)):
        part = up[..., start : start + count, :]
        deltas[name] = scale * jnp.einsum("...dr,...rnh->...dnh", down[..., i, :], part)
        start += count
    return deltas


def merged_params(model: Module, params: Any) -> Any:
    """The parameters of `base_model_config(model)`: each LoRA layer's base weights with
    its adapter merged in (float32, whatever the base's dtype: the sum is not rounded to
    bf16), the adapters dropped."""
    params = jax.tree.map(lambda x: x, params)  # A copy of the dict structure.
    for path, module, sub in lora_modules(model, params):
        base = dict(sub["layer"])
        deltas = adapter_deltas(module, sub)
        if isinstance(module, LoraFusedQKVLinear):
            base = _merge_fused(module, base, deltas)
        else:
            weight = base["weight"]
            base["weight"] = jnp.asarray(weight, jnp.float32) + deltas["weight"]
        node = params
        *parents, last = path.rstrip("/").split("/")
        for name in parents:
            node = node[name]
        node[last] = base
    return params


def _merge_fused(module: LoraFusedQKVLinear, base: dict, deltas: dict) -> dict:
    n, k = module.config.num_heads, module.num_kv_heads
    proj = dict(base["qkv_proj"])
    weight = jnp.asarray(proj["weight"], jnp.float32)
    if module.layer.config.klass is FusedGroupedQKVLinear:  # [..., D, N + 2K, H]
        starts = dict(query=(0, n), key=(n, k), value=(n + k, k))
        for name, delta in deltas.items():
            a, size = starts[name]
            weight = weight.at[..., a : a + size, :].add(delta)
    else:  # FusedQKVLinear: [..., 3, D, N, H]
        for name, delta in deltas.items():
            weight = weight.at[..., _QKV_NAMES.index(name), :, :, :].add(delta)
    proj["weight"] = weight
    return dict(base, qkv_proj=proj)


def base_param_paths(model: Module, tree: Any) -> dict[str, Optional[str]]:
    """For each '/'-path of `tree` (the LoRA model's parameters or specs): the path of the
    same parameter in `base_model_config`'s model, or None for an adapter parameter."""
    prefixes = [path for path, _, _ in lora_modules(model, tree)]
    out = {}
    for path, _ in flatten_with_paths(tree, is_leaf=lambda x: hasattr(x, "shape")):
        out[path] = path
        for prefix in prefixes:
            if path.startswith(prefix + "layer/"):
                out[path] = prefix + path[len(prefix + "layer/"):]
            elif path.startswith(prefix + "adapter/"):
                out[path] = None
    return out


def join_params(model: Module, tree: Any, base: dict[str, Any], adapters: dict[str, Any]) -> Any:
    """The LoRA model's parameter tree shaped like `tree` from flat {base path: array}
    (the base model's) and {adapter path: array}."""
    flat = {}
    for path, base_path in base_param_paths(model, tree).items():
        flat[path] = adapters[path] if base_path is None else base[base_path]
    return unflatten_paths(flat)


def initial_adapters(
    model: Module, paths: Sequence[str], shardings: dict[str, Any], *, seed: int = 0
) -> dict[str, Any]:
    """{path: array} of the adapter parameters at `paths` as the model's param_init draws
    them with key PRNGKey(seed) (lora_up zero), each placed by `shardings[path]`; only
    these are computed (XLA drops the rest of the initialization)."""

    def init(key):
        flat = dict(flatten_with_paths(model.initialize_parameters_recursively(key)))
        return {path: flat[path] for path in paths}

    return jax.jit(init, out_shardings={path: shardings[path] for path in paths})(
        jax.random.PRNGKey(seed)
    )
