"""Conversion between our Mixtral-shaped causal LM and Hugging Face's MixtralForCausalLM.

A Mixtral is a Llama (`hf_llama`) whose feed-forward layers are mixtures of experts:
`TransformerFeedForwardDropFreeMoE` with a SwiGLU expert and softmax top-k routing,
renormalized over the chosen experts (`TopKDropFreeGating`), as Mixtral routes. Attention,
norms, embeddings and head convert as hf_llama converts them; the experts map as (per
layer i; E experts of hidden size F):

  mlp.gate.weight [E, D]                .../feed_forward/gate_weight [D, E]
  mlp.experts.gate_up_proj [E, 2F, D]   .../feed_forward/wi_0_weight (gate, silu) and
                                        wi_1_weight (up) [E, D, F]
  mlp.experts.down_proj [E, D, F]       .../feed_forward/wo_weight [E, F, D]
  post_attention_layernorm.weight [D]   .../feed_forward/norm/scale

transformers 4.x names them block_sparse_moe.gate.weight and, per expert e,
block_sparse_moe.experts.{e}.w1 (gate) and w3 (up) [F, D] and w2 (down) [D, F]; both
layouts are read, and `params_to_hf` writes the installed transformers' layout.

Mixtral's router loss weighs the fraction of tokens that pick an expert (k per token);
ours weighs the fraction of the k x tokens assignments, so our load_balance_loss_weight
is k x router_aux_loss_coef.

Usage:
    cfg = mixtral_config_from_hf(hf_model.config)
    params = params_from_hf(hf_model.state_dict(), cfg)
    hf_model.load_state_dict(params_to_hf(params, cfg))
"""

from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from axlearn.common.attention import TransformerFeedForwardLayer
from axlearn.common.causal_lm import Model, metrics_config
from axlearn.common.config import ConfigError
from axlearn.common import hf_checkpoint, hf_llama
from axlearn.common.hf_llama import (
    LlamaDims,
    _hf_dict,
    _layer_to_hf,
    llama_config_from_hf,
    llama_dims,
    llama_model_config,
)
from axlearn.common.layers import RMSNorm
from axlearn.common.mixture_of_experts import (
    DROP_ALL_BUT_AUX_LOSS,
    TopKDropFreeGating,
    TransformerFeedForwardDropFreeMoE,
)

# Module outputs that AuxLossMetrics adds to the loss.
AUX_LOSS_REGEX = ".*/aux_loss"
_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def _with_experts(
    cfg: Model.Config, *, num_experts: int, num_experts_per_token: int, router_aux_loss_coef: float
) -> Model.Config:
    """A Llama-shaped `cfg` with each SwiGLU feed-forward layer made a Mixtral MoE."""
    cfg = cfg.clone()
    transformer = cfg.decoder.transformer
    dense = transformer.layer.feed_forward
    transformer.layer.feed_forward = TransformerFeedForwardDropFreeMoE.default_config().set(
        hidden_dim=dense.hidden_dim,
        activation=dense.activation,
        norm=dense.norm,
        num_experts=num_experts,
        gating=TopKDropFreeGating.default_config().set(num_experts_per_token=num_experts_per_token),
        load_balance_loss_weight=num_experts_per_token * router_aux_loss_coef,
        router_z_loss_weight=0.0,
    )
    if "repeat" in transformer.keys():
        transformer.repeat.drop_output.rules = [DROP_ALL_BUT_AUX_LOSS]
    cfg.metrics = metrics_config(aux_loss_regex=AUX_LOSS_REGEX)
    return cfg


def mixtral_model_config(
    *,
    num_experts: int,
    num_experts_per_token: int = 2,
    router_aux_loss_coef: float = 0.001,
    rope_theta: float = 1e6,
    **llama_kwargs,
) -> Model.Config:
    """A float32 Mixtral-shaped Model config: `hf_llama.llama_model_config(**llama_kwargs)`
    (hidden_dim: each expert's) with mixture-of-experts feed-forward layers."""
    return _with_experts(
        llama_model_config(rope_theta=rope_theta, **llama_kwargs),
        num_experts=num_experts,
        num_experts_per_token=num_experts_per_token,
        router_aux_loss_coef=router_aux_loss_coef,
    )


def mixtral_config_from_hf(hf_config: Any) -> Model.Config:
    """Our Model config equivalent to a transformers MixtralConfig."""
    for field, expected in (("sliding_window", None), ("router_jitter_noise", 0.0)):
        value = getattr(hf_config, field, expected)
        if value != expected:
            raise ConfigError(
                f"MixtralConfig.{field}={value!r} is not supported (need {expected!r})"
            )
    return _with_experts(
        # The attention and dense parts read as a Llama's; the experts are added below.
        llama_config_from_hf(dict(_hf_dict(hf_config), model_type="llama")),
        num_experts=hf_config.num_local_experts,
        num_experts_per_token=hf_config.num_experts_per_tok,
        router_aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.001)),
    )


def _llama_view(cfg: Model.Config) -> Model.Config:
    """`cfg` with a dense SwiGLU in place of each MoE layer, for hf_llama's checks."""
    moe = cfg.decoder.transformer.layer.feed_forward
    view = cfg.clone()
    ff = TransformerFeedForwardLayer.default_config().set(
        hidden_dim=moe.hidden_dim, activation=moe.activation, norm=moe.norm, structure=moe.structure
    )
    ff.linear1.bias = False
    ff.linear2.bias = False
    view.decoder.transformer.layer.feed_forward = ff
    return view


def mixtral_dims(cfg: Model.Config) -> tuple[LlamaDims, int, int]:
    """(Llama dims, num_experts, experts per token) of a Mixtral-shaped `cfg`; ConfigError
    naming the field where it is not one."""
    path = "decoder.transformer.layer.feed_forward"
    if isinstance(cfg.decoder.transformer.layer, (list, tuple)):
        raise ConfigError(
            "decoder.transformer.layer: a list of per-layer configs; Mixtral repeats one layer"
        )
    moe = cfg.decoder.transformer.layer.feed_forward
    if moe.klass is not TransformerFeedForwardDropFreeMoE:
        raise ConfigError(
            f"{path}: Mixtral needs TransformerFeedForwardDropFreeMoE, got {moe.klass}"
        )
    checks = {
        "gating.klass": (moe.gating.klass, TopKDropFreeGating),
        "gating.gating_logit_cap": (moe.gating.gating_logit_cap, 0.0),
        "residual_weight": (moe.residual_weight, 1.0),
        "norm.klass": (moe.norm.klass, RMSNorm),
    }
    for field, (value, expected) in checks.items():
        if value != expected:
            raise ConfigError(f"{path}.{field} is {value!r}; Mixtral needs {expected!r}")
    return llama_dims(_llama_view(cfg)), moe.num_experts, moe.gating.num_experts_per_token


def hf_config_from_mixtral_config(cfg: Model.Config) -> Any:
    """A transformers MixtralConfig equivalent to our Mixtral-shaped `cfg`."""
    from transformers import MixtralConfig  # pylint: disable=import-outside-toplevel

    dims, num_experts, top_k = mixtral_dims(cfg)
    attention = cfg.decoder.transformer.layer.self_attention.attention
    return MixtralConfig(
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
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        router_aux_loss_coef=cfg.decoder.transformer.layer.feed_forward.load_balance_loss_weight
        / top_k,
        sliding_window=None,
    )


# ----- weights -----


def _experts_from_hf(sd: dict[str, np.ndarray], i: int, num_experts: int) -> dict[str, np.ndarray]:
    """Layer i's MoE weights (ours) from either HF layout."""
    fused = f"model.layers.{i}.mlp."
    if fused + "gate.weight" in sd:
        gate_up = sd[fused + "experts.gate_up_proj"]  # [E, 2F, D]
        hidden = gate_up.shape[1] // 2
        return dict(
            gate_weight=sd[fused + "gate.weight"].T,
            wi_0_weight=gate_up[:, :hidden].transpose(0, 2, 1),
            wi_1_weight=gate_up[:, hidden:].transpose(0, 2, 1),
            wo_weight=sd[fused + "experts.down_proj"].transpose(0, 2, 1),
        )
    legacy = f"model.layers.{i}.block_sparse_moe."
    if legacy + "gate.weight" not in sd:
        raise KeyError(f"The HF state dict has neither {fused}gate.weight nor {legacy}gate.weight")

    def experts(name: str) -> np.ndarray:  # [E, out, in] -> [E, in, out]
        return np.stack([sd[f"{legacy}experts.{e}.{name}.weight"].T for e in range(num_experts)])

    return dict(
        gate_weight=sd[legacy + "gate.weight"].T,
        wi_0_weight=experts("w1"),
        wi_1_weight=experts("w3"),
        wo_weight=experts("w2"),
    )


def _experts_to_hf(ff: dict[str, Any], i: int, *, fused: bool) -> dict[str, np.ndarray]:
    """Layer i's HF MoE entries from our feed_forward parameters."""
    if fused:
        prefix = f"model.layers.{i}.mlp."
        gate_up = np.concatenate([ff["wi_0_weight"], ff["wi_1_weight"]], axis=2)  # [E, D, 2F]
        return {
            prefix + "gate.weight": ff["gate_weight"].T,
            prefix + "experts.gate_up_proj": gate_up.transpose(0, 2, 1),
            prefix + "experts.down_proj": ff["wo_weight"].transpose(0, 2, 1),
        }
    prefix = f"model.layers.{i}.block_sparse_moe."
    out = {prefix + "gate.weight": ff["gate_weight"].T}
    for e in range(ff["gate_weight"].shape[1]):
        out[f"{prefix}experts.{e}.w1.weight"] = ff["wi_0_weight"][e].T
        out[f"{prefix}experts.{e}.w3.weight"] = ff["wi_1_weight"][e].T
        out[f"{prefix}experts.{e}.w2.weight"] = ff["wo_weight"][e].T
    return out


def _dense_placeholders(dims: LlamaDims) -> dict[str, np.ndarray]:
    """Zero-stride stand-ins for a dense MLP's HF weights, which hf_llama's layer
    conversion reads and the MoE replaces (no memory is allocated for them)."""
    up = np.broadcast_to(np.float32(0), (dims.hidden_dim, dims.dim))
    return dict(zip(_DENSE_MLP, (up, up, up.T)))


def params_from_hf(state_dict: dict[str, Any], cfg: Model.Config) -> dict[str, Any]:
    """Our parameter tree (jax arrays of cfg.dtype, default float32) from an HF Mixtral
    state dict (either layout)."""
    dims, num_experts, _ = mixtral_dims(cfg)
    sd = {name: hf_checkpoint.to_float32(value) for name, value in state_dict.items()}
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not dims.tied:
        expected.add("lm_head.weight")
    missing = sorted(expected - set(sd))
    if missing:
        raise KeyError(f"The HF state dict lacks {missing} for a {dims}")
    placeholders = _dense_placeholders(dims)
    layers = []
    for i in range(dims.num_layers):
        prefix = f"model.layers.{i}."
        layer_sd = dict(sd, **{prefix + name: value for name, value in placeholders.items()})
        layer = _layer_from_hf(layer_sd, i, dims)
        layer["feed_forward"] = dict(
            norm=layer["feed_forward"]["norm"], **_experts_from_hf(sd, i, num_experts)
        )
        layers.append(layer)
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
    return hf_checkpoint.map_views(lambda x: jnp.asarray(x, dtype=dtype), dict(decoder=decoder))


def installed_layout_is_fused() -> bool:
    """Whether the installed transformers keeps a Mixtral layer's experts in fused
    tensors (5.x: mlp.experts.gate_up_proj) rather than one module per expert (4.x)."""
    from transformers.models.mixtral import (  # pylint: disable=import-outside-toplevel
        modeling_mixtral,
    )

    return not hasattr(modeling_mixtral, "MixtralBlockSparseTop2MLP")


def params_to_hf(
    params: dict[str, Any],
    cfg: Model.Config,
    *,
    framework: str = "pt",
    fused: Optional[bool] = None,
) -> dict:
    """An HF MixtralForCausalLM state dict from our parameters.

    framework 'pt': float32 torch tensors (for `load_state_dict`); 'np': numpy arrays.
    fused: the experts' layout (see the module doc); None: the installed transformers'.
    """
    dims, _, _ = mixtral_dims(cfg)
    if fused is None:
        fused = installed_layout_is_fused()
    placeholders = _dense_placeholders(dims)
    dense = dict(
        linear1_0=dict(weight=placeholders[_DENSE_MLP[0]].T),
        linear1_1=dict(weight=placeholders[_DENSE_MLP[1]].T),
        linear2=dict(weight=placeholders[_DENSE_MLP[2]].T),
    )

    def layer_to_hf(layer: dict[str, Any], i: int, dims: LlamaDims) -> dict[str, Any]:
        # A Llama layer's entries with placeholder MLP weights, which the experts replace.
        ff = layer["feed_forward"]
        entries = _layer_to_hf(dict(layer, feed_forward=dict(dense, norm=ff["norm"])), i, dims)
        for name in _DENSE_MLP:
            del entries[f"model.layers.{i}.{name}"]
        entries.update(_experts_to_hf(ff, i, fused=fused))
        return entries

    return hf_llama.params_to_hf(
        params, _llama_view(cfg), framework=framework, layer_to_hf=layer_to_hf
    )


# ----- dense Llama layers in and out of a state dict (the non-expert parts) -----


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


def _stack_layers(layers: list[dict[str, Any]]) -> dict[str, Any]:
    if isinstance(layers[0], dict):
        return {key: _stack_layers([layer[key] for layer in layers]) for key in layers[0]}
    return np.stack(layers)
