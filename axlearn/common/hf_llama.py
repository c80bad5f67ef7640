"""Conversion between our Llama-shaped causal LM and Hugging Face's LlamaForCausalLM.

A Llama-shaped `causal_lm.Model` config (from `llama_model_config`) has: grouped-query
attention with one fused projection (`FusedGroupedQKVLinear`, weight [D, N + 2K, H]) under
rotary embeddings that rotate halves (our `apply_rotary_position_embeddings` pairs
(x[i], x[i + H/2]), as HF's `rotate_half` does, so q/k weights need no permutation), no
biases, a SwiGLU feed-forward (linear1_0 = gate with silu, linear1_1 = up, linear2 = down),
pre-norm RMSNorm everywhere, and a tied or untied LM head.

Weight layouts: HF's torch Linear stores [out, in]; ours store [in, out]. The HF names
map to ours as (per layer i; `layer` below is `transformer/repeat/layer` with a leading
stacked axis, or `transformer/layer{i}` for a StackedTransformerLayer):

  model.embed_tokens.weight [V, D]             decoder/emb/token_emb/weight [V, D]
  self_attn.{q,k,v}_proj.weight [N*H|K*H, D]   .../attention/i_proj/i_proj/qkv_proj/weight [D, N+2K, H]
  self_attn.o_proj.weight [D, N*H]             .../attention/o_proj/weight [D, N, H]
  mlp.gate_proj / up_proj.weight [F, D]        .../feed_forward/linear1_0 / linear1_1/weight [D, F]
  mlp.down_proj.weight [D, F]                  .../feed_forward/linear2/weight [F, D]
  input_layernorm.weight [D]                   .../self_attention/norm/scale
  post_attention_layernorm.weight [D]          .../feed_forward/norm/scale
  model.norm.weight [D]                        decoder/output_norm/scale
  lm_head.weight [V, D]                        decoder/lm_head/weight [D, V] (untied only)

Usage:
    cfg = llama_config_from_hf(hf_model.config)
    params = params_from_hf(hf_model.state_dict(), cfg)
    hf_model.load_state_dict(params_to_hf(params, cfg))
"""

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from axlearn.common.attention import (
    FusedGroupedQKVLinear,
    GroupedQueryAttention,
    RepeatedTransformerLayer,
    RoFormerQKVLinear,
    StackedTransformerLayer,
    TransformerLayer,
)
from axlearn.common.causal_lm import Model
from axlearn.common.config import ConfigError
from axlearn.common.layers import Linear, RMSNorm
from axlearn.common.param_init import default_initializer_config


@dataclasses.dataclass(frozen=True)
class LlamaDims:
    """The sizes that determine every weight shape of a Llama-shaped model."""

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_dim: int
    tied: bool
    repeated: bool  # RepeatedTransformerLayer (stacked params) vs StackedTransformerLayer.


def llama_model_config(
    *,
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    hidden_dim: int,
    head_dim: Optional[int] = None,
    rope_theta: float = 10000.0,
    norm_eps: float = 1e-5,
    tie_word_embeddings: bool = False,
    repeated: bool = True,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
) -> Model.Config:
    """A float32 Llama-shaped Model config (see the module doc for its structure)."""
    head_dim = head_dim or dim // num_heads
    norm = RMSNorm.default_config().set(eps=norm_eps)
    stack = RepeatedTransformerLayer if repeated else StackedTransformerLayer
    transformer = stack.default_config().set(
        num_layers=num_layers, layer=TransformerLayer.default_config()
    )
    layer = transformer.layer
    layer.self_attention.norm = norm.clone()
    attention = GroupedQueryAttention.default_config().set(
        num_heads=num_heads, hidden_dim=num_heads * head_dim, causal=True
    )
    fused = FusedGroupedQKVLinear.default_config().set(num_kv_heads=num_kv_heads)
    fused.layer.bias = False
    attention.input_linear = RoFormerQKVLinear.default_config().set(
        input_linear=fused, rotary_value=False
    )
    attention.input_linear.rope_pos_emb_layer.theta = rope_theta
    attention.output_linear.bias = False
    layer.self_attention.attention = attention
    ff = layer.feed_forward
    ff.set(hidden_dim=hidden_dim, activation=("nn.silu", "linear"), norm=norm.clone())
    ff.linear1.bias = False
    ff.linear2.bias = False
    cfg = Model.default_config().set(
        name="model", dtype=jnp.float32, param_init=default_initializer_config()
    )
    cfg.decoder.set(
        vocab_size=vocab_size,
        dim=dim,
        transformer=transformer,
        output_norm=norm.clone(),
        lm_head=None if tie_word_embeddings else Linear.default_config().set(bias=False),
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
    )
    return cfg


def _hf_rope_theta(hf_config: Any) -> float:
    """rope_theta from either a transformers 4.x config or a 5.x `rope_parameters` dict."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(hf_config, "rope_scaling", None)
    if rope_type != "default" or (scaling and scaling.get("rope_type", "default") != "default"):
        raise ConfigError(f"Only default RoPE is supported, got rope_type '{rope_type}' / {scaling}")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def _first_token_id(value: Any, default: int) -> int:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return default if value is None else int(value)


def llama_config_from_hf(hf_config: Any) -> Model.Config:
    """Our Model config equivalent to a transformers LlamaConfig."""
    for field, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        value = getattr(hf_config, field, expected)
        if value != expected:
            raise ConfigError(f"LlamaConfig.{field}={value!r} is not supported (need {expected!r})")
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    return llama_model_config(
        vocab_size=hf_config.vocab_size,
        dim=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        hidden_dim=hf_config.intermediate_size,
        head_dim=head_dim,
        rope_theta=_hf_rope_theta(hf_config),
        norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        pad_token_id=_first_token_id(getattr(hf_config, "pad_token_id", None), 0),
        eos_token_id=_first_token_id(getattr(hf_config, "eos_token_id", None), 1),
    )


def hf_config_from_llama_config(cfg: Model.Config) -> Any:
    """A transformers LlamaConfig equivalent to our Llama-shaped `cfg`."""
    from transformers import LlamaConfig  # pylint: disable=import-outside-toplevel

    dims = llama_dims(cfg)
    attention = _attention_config(cfg)
    return LlamaConfig(
        vocab_size=dims.vocab_size,
        hidden_size=dims.dim,
        intermediate_size=dims.hidden_dim,
        num_hidden_layers=dims.num_layers,
        num_attention_heads=dims.num_heads,
        num_key_value_heads=dims.num_kv_heads,
        head_dim=dims.head_dim,
        rms_norm_eps=cfg.decoder.output_norm.eps,
        rope_theta=attention.input_linear.rope_pos_emb_layer.theta,
        tie_word_embeddings=dims.tied,
        pad_token_id=cfg.decoder.pad_token_id,
        eos_token_id=cfg.decoder.eos_token_id,
        attention_bias=False,
        mlp_bias=False,
    )


def _attention_config(cfg: Model.Config) -> Any:
    return cfg.decoder.transformer.layer.self_attention.attention


def llama_dims(cfg: Model.Config) -> LlamaDims:
    """Checks that `cfg` is Llama-shaped and returns its sizes (ConfigError otherwise)."""
    decoder = cfg.decoder
    transformer = decoder.transformer
    if transformer.klass not in (RepeatedTransformerLayer, StackedTransformerLayer):
        raise ConfigError(
            "decoder.transformer: expected RepeatedTransformerLayer or StackedTransformerLayer, "
            f"got {transformer.klass.__name__}"
        )
    layer = transformer.layer
    attention = layer.self_attention.attention
    rope = attention.input_linear
    if rope.klass is not RoFormerQKVLinear or rope.input_linear.klass is not FusedGroupedQKVLinear:
        raise ConfigError(
            "decoder.transformer.layer.self_attention.attention.input_linear: expected "
            "RoFormerQKVLinear over FusedGroupedQKVLinear (see hf_llama.llama_model_config)"
        )
    checks = {
        "self_attention.attention.input_linear.rotary_value": (rope.rotary_value, False),
        "self_attention.attention.input_linear.input_linear.layer.bias": (
            rope.input_linear.layer.bias,
            False,
        ),
        "self_attention.attention.output_linear.bias": (attention.output_linear.bias, False),
        "self_attention.attention.query_scale.norm": (attention.query_scale.norm, None),
        "self_attention.attention.key_scale.norm": (attention.key_scale.norm, None),
        "self_attention.structure": (layer.self_attention.structure, "prenorm"),
        "feed_forward.activation": (tuple(layer.feed_forward.activation), ("nn.silu", "linear")),
        "feed_forward.linear1.bias": (layer.feed_forward.linear1.bias, False),
        "feed_forward.linear2.bias": (layer.feed_forward.linear2.bias, False),
        "feed_forward.structure": (layer.feed_forward.structure, "prenorm"),
    }
    for path, (value, expected) in checks.items():
        if value != expected:
            raise ConfigError(
                f"decoder.transformer.layer.{path} is {value!r}; Llama needs {expected!r}"
            )
    for path, norm in (
        ("decoder.output_norm", decoder.output_norm),
        ("decoder.transformer.layer.self_attention.norm", layer.self_attention.norm),
        ("decoder.transformer.layer.feed_forward.norm", layer.feed_forward.norm),
    ):
        if norm is None or norm.klass is not RMSNorm:
            raise ConfigError(f"{path}: Llama needs RMSNorm")
    if not isinstance(layer.feed_forward.hidden_dim, int):
        raise ConfigError("decoder.transformer.layer.feed_forward.hidden_dim must be an int")
    if decoder.lm_head is not None and decoder.lm_head.bias:
        raise ConfigError("decoder.lm_head.bias must be False for Llama")
    hidden = attention.hidden_dim or decoder.dim
    return LlamaDims(
        vocab_size=decoder.vocab_size,
        dim=decoder.dim,
        num_layers=transformer.num_layers,
        num_heads=attention.num_heads,
        num_kv_heads=rope.input_linear.num_kv_heads,
        head_dim=hidden // attention.num_heads,
        hidden_dim=layer.feed_forward.hidden_dim,
        tied=decoder.lm_head is None,
        repeated=transformer.klass is RepeatedTransformerLayer,
    )


def _to_numpy(value: Any) -> np.ndarray:
    """A float32 numpy copy of a torch tensor, jax array or numpy array."""
    if hasattr(value, "detach"):  # torch.Tensor (bfloat16 has no numpy dtype: go via float).
        value = value.detach().to("cpu").float().numpy()
    return np.asarray(value, dtype=np.float32)


def _layer_from_hf(sd: dict[str, np.ndarray], i: int, dims: LlamaDims) -> dict[str, Any]:
    """Our parameters of transformer layer i from the HF state dict."""
    prefix = f"model.layers.{i}."
    d, n, k, h = dims.dim, dims.num_heads, dims.num_kv_heads, dims.head_dim

    def heads(name: str, num: int) -> np.ndarray:  # [num*H, D] -> [D, num, H]
        return sd[prefix + name].T.reshape(d, num, h)

    qkv = np.concatenate(
        [heads("self_attn.q_proj.weight", n), heads("self_attn.k_proj.weight", k),
         heads("self_attn.v_proj.weight", k)],
        axis=1,
    )
    return dict(
        self_attention=dict(
            norm=dict(scale=sd[prefix + "input_layernorm.weight"]),
            attention=dict(
                i_proj=dict(i_proj=dict(qkv_proj=dict(weight=qkv))),
                o_proj=dict(weight=sd[prefix + "self_attn.o_proj.weight"].reshape(d, n, h)),
            ),
        ),
        feed_forward=dict(
            norm=dict(scale=sd[prefix + "post_attention_layernorm.weight"]),
            linear1_0=dict(weight=sd[prefix + "mlp.gate_proj.weight"].T),
            linear1_1=dict(weight=sd[prefix + "mlp.up_proj.weight"].T),
            linear2=dict(weight=sd[prefix + "mlp.down_proj.weight"].T),
        ),
    )


def _layer_to_hf(layer: dict[str, Any], i: int, dims: LlamaDims) -> dict[str, np.ndarray]:
    """The HF state-dict entries of transformer layer i from our layer parameters."""
    prefix = f"model.layers.{i}."
    d, n, k, h = dims.dim, dims.num_heads, dims.num_kv_heads, dims.head_dim
    attention = layer["self_attention"]["attention"]
    qkv = attention["i_proj"]["i_proj"]["qkv_proj"]["weight"]
    ff = layer["feed_forward"]
    return {
        prefix + "input_layernorm.weight": layer["self_attention"]["norm"]["scale"],
        prefix + "self_attn.q_proj.weight": qkv[:, :n].reshape(d, n * h).T,
        prefix + "self_attn.k_proj.weight": qkv[:, n : n + k].reshape(d, k * h).T,
        prefix + "self_attn.v_proj.weight": qkv[:, n + k :].reshape(d, k * h).T,
        prefix + "self_attn.o_proj.weight": attention["o_proj"]["weight"].reshape(d, n * h),
        prefix + "post_attention_layernorm.weight": ff["norm"]["scale"],
        prefix + "mlp.gate_proj.weight": ff["linear1_0"]["weight"].T,
        prefix + "mlp.up_proj.weight": ff["linear1_1"]["weight"].T,
        prefix + "mlp.down_proj.weight": ff["linear2"]["weight"].T,
    }


def _stack_layers(layers: list[dict[str, Any]]) -> dict[str, Any]:
    if isinstance(layers[0], dict):
        return {key: _stack_layers([layer[key] for layer in layers]) for key in layers[0]}
    return np.stack(layers)


def _unstack_layer(stacked: dict[str, Any], i: int) -> dict[str, Any]:
    if isinstance(stacked, dict):
        return {key: _unstack_layer(value, i) for key, value in stacked.items()}
    return stacked[i]


def params_from_hf(state_dict: dict[str, Any], cfg: Model.Config) -> dict[str, Any]:
    """Our parameter tree (jax arrays of cfg.dtype, default float32) from an HF state dict."""
    dims = llama_dims(cfg)
    sd = {name: _to_numpy(value) for name, value in state_dict.items()}
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.input_layernorm.weight" for i in range(dims.num_layers)}
    if not dims.tied:
        expected.add("lm_head.weight")
    missing = sorted(expected - set(sd))
    if missing:
        raise KeyError(f"The HF state dict lacks {missing} for a {dims}")
    layers = [_layer_from_hf(sd, i, dims) for i in range(dims.num_layers)]
    if dims.repeated:
        transformer = dict(repeat=dict(layer=_stack_layers(layers)))
    else:
        transformer = {f"layer{i}": layer for i, layer in enumerate(layers)}
    decoder = dict(
        emb=dict(token_emb=dict(weight=sd["model.embed_tokens.weight"])),
        transformer=transformer,
        output_norm=dict(scale=sd["model.norm.weight"]),
    )
    if not dims.tied:
        decoder["lm_head"] = dict(weight=sd["lm_head.weight"].T)
    dtype = cfg.dtype or jnp.float32
    return _map_leaves(lambda x: jnp.asarray(x, dtype=dtype), dict(decoder=decoder))


def params_to_hf(params: dict[str, Any], cfg: Model.Config, *, framework: str = "pt") -> dict:
    """An HF LlamaForCausalLM state dict from our parameters.

    framework 'pt': float32 torch tensors (for `load_state_dict`); 'np': numpy arrays.
    A tied model gets `lm_head.weight` equal to the token table, as HF expects.
    """
    if framework not in ("pt", "np"):
        raise ValueError(f"framework must be 'pt' or 'np', got {framework!r}")
    dims = llama_dims(cfg)
    decoder = _map_leaves(_to_numpy, params["decoder"])
    transformer = decoder["transformer"]
    sd = {"model.embed_tokens.weight": decoder["emb"]["token_emb"]["weight"]}
    for i in range(dims.num_layers):
        layer = (
            _unstack_layer(transformer["repeat"]["layer"], i)
            if dims.repeated
            else transformer[f"layer{i}"]
        )
        sd.update(_layer_to_hf(layer, i, dims))
    sd["model.norm.weight"] = decoder["output_norm"]["scale"]
    sd["lm_head.weight"] = (
        sd["model.embed_tokens.weight"] if dims.tied else decoder["lm_head"]["weight"].T
    )
    # Own, writable, contiguous copies: torch cannot wrap read-only (jax-backed) buffers.
    sd = {name: np.array(value, dtype=np.float32, order="C") for name, value in sd.items()}
    if framework == "np":
        return sd
    import torch  # pylint: disable=import-outside-toplevel

    return {name: torch.from_numpy(value) for name, value in sd.items()}


def _map_leaves(fn, tree: Any) -> Any:
    if isinstance(tree, dict):
        return {key: _map_leaves(fn, value) for key, value in tree.items()}
    return fn(tree)
