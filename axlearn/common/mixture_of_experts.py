"""Mixture-of-experts feed-forward layers.

A router (`gate_weight`, [model_dim, num_experts]) scores each token against
`num_experts` gated MLPs, the experts; the gating layer picks a few experts per token
and weighs them; the layer sums the chosen experts' outputs by those weights. Both layers
are drop-in replacements for `attention.TransformerFeedForwardLayer` (same structures,
norm, residual and activation fields):

- `TransformerFeedForwardMoE`: GShard's capacity-based dispatch (`Top2Gating`). The
  tokens are cut into `num_groups` groups; in each group an expert takes at most
  `capacity` tokens, and a token routed to a full expert skips it (its residual passes
  through). Dispatch and combine are einsums with one-hot [groups, tokens, experts,
  capacity] tensors; sharding constraints move the dispatched tokens from the batch
  axes onto the 'expert' axis, where XLA's partitioner inserts the all-to-all.
- `TransformerFeedForwardDropFreeMoE`: top-k routing without capacity
  (`TopKDropFreeGating`). Each token's k copies are sorted by expert and every expert's
  rows go through a grouped matmul (`jax.lax.ragged_dot`, or on Hopper GPUs jax's Mosaic
  GPU grouped-GEMM kernels: `kernels.grouped_matmul`; or tokamax's, chosen by AXLearn's
  `gmm_backend`). On a mesh the layer runs under
  `shard_map`: each device routes its own tokens; with the experts split over the
  'expert' axis, rows travel to the device that holds their expert and back with two
  all-to-alls (expert parallelism); with the experts' weights split over FSDP axes instead,
  they are gathered, as any FSDP weight is, and no token moves (the data-parallel layout).
  Which one runs follows from the mesh and the layer's partition specs (AXLearn's
  `dim_to_mesh_axis_map`, `input_dim_to_partition_spec`, `output_dim_to_partition_spec`).
  Tested against a NumPy loop that sends every token through its top-k experts.

Both layers report `aux_loss` = load_balance_loss_weight x load-balancing loss +
router_z_loss_weight x router z-loss (+ corr_loss_weight x the experts' correlation loss)
as a module output, which `causal_lm.AuxLossMetrics` adds to the
model's loss; the unweighted losses are summaries (of the gating layer, for the router's).

Letters in the partition-spec keys name tensor dims: O outer batch, G groups, S tokens
of a group (or of a sequence), B batch, E experts, C capacity, M model dim, H hidden dim.
"""

import enum
import functools
import importlib.util
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from axlearn.common.base_layer import BaseLayer, MeshAxes, ParameterSpec, WeightWithCopy
from axlearn.common.config import (
    REQUIRED,
    ConfigError,
    InstantiableConfig,
    Required,
    config_class,
    maybe_instantiate,
)
from axlearn.common.kernels.grouped_matmul import grouped_matmul
from axlearn.common.layers import (
    Dropout,
    LayerNorm,
    StochasticDepth,
    get_activation_fn,
    residual_add,
)
from axlearn.common.module import Module, Tensor
from axlearn.common.param_init import FanAxes
from axlearn.common.sharding import (
    axis_names,
    current_mesh_axes,
    local_shape,
    maybe_shard,
    mesh_partition_spec,
)

HiddenDim = Union[int, InstantiableConfig]
_STRUCTURES = ("prenorm", "postnorm", "hybridnorm", "nonorm")


def _router_z_loss(logits: Tensor) -> Tensor:
    """mean(logsumexp(logits)^2) over tokens: keeps router logits small (ST-MoE)."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


def _expert_correlation_loss(gate_weight: Tensor) -> tuple[Tensor, Tensor]:
    """How alike the experts' router directions are: with c[e, f] the cosine between
    columns e and f of `gate_weight` [M, E], returns (0.5 x mean over e, f of
    |c[e, f] - [e == f]|, the largest such entry). Both are 0 for orthogonal columns."""
    columns = gate_weight / jnp.linalg.norm(gate_weight, axis=0, keepdims=True)
    off_identity = jnp.abs(columns.T @ columns - jnp.eye(gate_weight.shape[1]))
    return 0.5 * jnp.mean(off_identity), jnp.max(off_identity)


def _cap_logits(logits: Tensor, cap: float) -> Tensor:
    """cap * tanh(logits / cap) (cap > 0), else logits."""
    return cap * jnp.tanh(logits / cap) if cap > 0 else logits


# ----- gating -----


class BaseGating(BaseLayer):
    """Chooses experts for each token from router logits [..., num_experts] (float32)."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures BaseGating."""

        num_experts: Required[int] = REQUIRED  # Set by the MoE layer.
        # If > 0, logits = cap * tanh(logits / cap) before routing.
        gating_logit_cap: float = 0.0

    @property
    def num_experts_per_token(self) -> int:
        """How many experts a token goes through (at most)."""
        raise NotImplementedError(type(self))

    def _probabilities(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """(capped float32 logits, their softmax over experts)."""
        logits = _cap_logits(logits.astype(jnp.float32), self.config.gating_logit_cap)
        return logits, jax.nn.softmax(logits, axis=-1)


class Top2Gating(BaseGating):
    """GShard's top-2 gating with a capacity per expert and group.

    Each token's first choice is the most probable expert and its second the next one;
    their gates are renormalized to sum to one. Within a group, first choices claim
    expert slots in token order, then second choices do; an assignment past an expert's
    capacity is dropped. Load-balancing loss: num_experts^2 x mean over groups and experts
    of (fraction of the group's tokens whose first choice is the expert) x (its mean
    probability), which is 1 when routing is uniform.
    """

    @config_class
    class Config(BaseGating.Config):
        """Configures Top2Gating."""

        # Capacity (tokens an expert takes per group), as AXLearn computes it: at least
        # expert_capacity (None: 1), and at least int(factor * group_size / num_experts)
        # rounded up to a multiple of 4, with the training or the evaluation factor.
        train_capacity_factor: float = 2.0
        eval_capacity_factor: float = 2.0
        expert_capacity: Optional[int] = None
        # dtype of the one-hot expert masks and of the slot positions counted from them
        # (an int, or a float that counts group sizes exactly; bfloat16 stops at 256).
        mask_dtype: jnp.dtype = jnp.int32

    class Output(NamedTuple):
        """What Top2Gating.forward returns."""

        combine_tensor: Tensor  # [O, G, S, E, C] float32: gate of each kept assignment.
        dispatch_tensor: Tensor  # [O, G, S, E, C] bool: where each kept token goes.
        load_balance_loss: Tensor  # Scalar.
        router_z_loss: Tensor  # Scalar.

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        if cfg.num_experts < 2:
            raise ConfigError(f"{self.path()}.num_experts={cfg.num_experts}: top-2 needs >= 2")
        for name in ("train_capacity_factor", "eval_capacity_factor"):
            if getattr(cfg, name) <= 0:
                raise ConfigError(f"{self.path()}.{name} must be > 0, got {getattr(cfg, name)}")
        if cfg.expert_capacity is not None and cfg.expert_capacity < 1:
            raise ConfigError(f"{self.path()}.expert_capacity must be >= 1 or None")
        try:
            mask_dtype = jnp.dtype(cfg.mask_dtype)
        except TypeError as e:
            raise ConfigError(f"{self.path()}.mask_dtype: {cfg.mask_dtype!r} is not a dtype") from e
        if not jnp.issubdtype(mask_dtype, jnp.integer) and not jnp.issubdtype(
            mask_dtype, jnp.floating
        ):
            raise ConfigError(
                f"{self.path()}.mask_dtype: expected an integer or float dtype, got {mask_dtype}"
            )

    @property
    def num_experts_per_token(self) -> int:
        return 2

    def expert_capacity(self, group_size: int) -> int:
        """Tokens each expert takes from a group of `group_size` (see the config)."""
        cfg = self.config
        least = cfg.expert_capacity or 1
        factor = cfg.train_capacity_factor if self.is_training else cfg.eval_capacity_factor
        from_factor = int(group_size * factor / cfg.num_experts)
        if from_factor <= least:
            return least
        return -(-from_factor // 4) * 4

    def forward(self, logits: Tensor) -> Output:
        """logits [O, G, S, E] -> Top2Gating.Output."""
        num_experts, mask_dtype = self.config.num_experts, self.config.mask_dtype
        logits, probs = self._probabilities(logits)
        capacity = self.expert_capacity(logits.shape[-2])
        mask_1 = jax.nn.one_hot(jnp.argmax(probs, axis=-1), num_experts, dtype=mask_dtype)
        gate_1 = jnp.sum(probs * mask_1, axis=-1)
        probs_2 = jnp.where(mask_1 > 0, 0.0, probs)
        mask_2 = jax.nn.one_hot(jnp.argmax(probs_2, axis=-1), num_experts, dtype=mask_dtype)
        gate_2 = jnp.sum(probs_2 * mask_2, axis=-1)
        denominator = gate_1 + gate_2
        gate_1, gate_2 = gate_1 / denominator, gate_2 / denominator

        density = jnp.mean(mask_1.astype(jnp.float32), axis=-2)  # [O, G, E], before capacity.
        density_proxy = jnp.mean(probs, axis=-2)
        load_balance_loss = jnp.mean(density * density_proxy) * num_experts**2

        # Slots in token order, first choices before second choices.
        position_1 = jnp.cumsum(mask_1, axis=-2) - mask_1
        kept_1 = mask_1 * (position_1 < capacity)
        position_2 = jnp.cumsum(mask_2, axis=-2) - mask_2 + jnp.sum(kept_1, axis=-2, keepdims=True)
        kept_2 = mask_2 * (position_2 < capacity)

        def slots(kept: Tensor, position: Tensor) -> Tensor:  # [O, G, S, E, C] one-hot.
            slot = jnp.sum(kept * position, axis=-1).astype(jnp.int32)
            one_hot = jax.nn.one_hot(slot, capacity, dtype=jnp.float32)
            return kept.astype(jnp.float32)[..., None] * one_hot[..., None, :]

        slots_1, slots_2 = slots(kept_1, position_1), slots(kept_2, position_2)
        combine = gate_1[..., None, None] * slots_1 + gate_2[..., None, None] * slots_2
        router_z_loss = _router_z_loss(logits)
        self.add_summary("load_balance_loss", load_balance_loss)
        self.add_summary("router_z_loss", router_z_loss)
        for i, (kept, mask) in enumerate([(kept_1, mask_1), (kept_2, mask_2)], start=1):
            kept_fraction = jnp.sum(kept, dtype=jnp.float32) / jnp.sum(mask, dtype=jnp.float32)
            self.add_summary(f"over_capacity_{i}", 1.0 - kept_fraction)
        return self.Output(
            combine_tensor=combine,
            dispatch_tensor=(slots_1 + slots_2) > 0,
            load_balance_loss=load_balance_loss,
            router_z_loss=router_z_loss,
        )


class TopKDropFreeGating(BaseGating):
    """Top-k gating without capacity: each token goes to its `num_experts_per_token` most
    probable experts, weighted by their probabilities renormalized to sum to one (as
    Mixtral routes).

    Load-balancing loss: num_experts x sum over experts of (fraction of the k x tokens
    assignments that go to the expert) x (its mean probability), 1 when uniform.
    """

    @config_class
    class Config(BaseGating.Config):
        """Configures TopKDropFreeGating."""

        num_experts_per_token: int = 2
        # AXLearn's capacity factor, which drop-free routing has no use for: None or 0
        # (AXLearn's configs set 0). Any other value is refused, since no token is ever
        # dropped here (the capacity layer is TransformerFeedForwardMoE with Top2Gating).
        train_capacity_factor: Optional[float] = None

    class Output(NamedTuple):
        """What TopKDropFreeGating.forward returns."""

        gate_assignment: Tensor  # [..., K] int32: the chosen experts.
        expert_weights: Tensor  # [..., K] float32: their weights, summing to one.
        load_balance_loss: Tensor  # Scalar.
        router_z_loss: Tensor  # Scalar.

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        if not 1 <= cfg.num_experts_per_token <= cfg.num_experts:
            raise ConfigError(
                f"{self.path()}.num_experts_per_token={cfg.num_experts_per_token} must be in "
                f"[1, num_experts={cfg.num_experts}]"
            )
        if cfg.train_capacity_factor not in (None, 0):
            raise ConfigError(
                f"{self.path()}.train_capacity_factor={cfg.train_capacity_factor}: drop-free "
                "routing has no capacity (None or 0); for capacity use Top2Gating"
            )

    @property
    def num_experts_per_token(self) -> int:
        return self.config.num_experts_per_token

    def forward(self, logits: Tensor) -> Output:
        """logits [..., E] -> TopKDropFreeGating.Output."""
        cfg = self.config
        logits, probs = self._probabilities(logits)
        top_probs, assignment = jax.lax.top_k(probs, cfg.num_experts_per_token)
        weights = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
        num_tokens = math.prod(logits.shape[:-1])
        one_hot = jax.nn.one_hot(assignment, cfg.num_experts)
        fraction = jnp.sum(one_hot.reshape(-1, cfg.num_experts), axis=0) / (
            num_tokens * cfg.num_experts_per_token
        )
        mean_probs = jnp.mean(probs.reshape(-1, cfg.num_experts), axis=0)
        load_balance_loss = cfg.num_experts * jnp.sum(fraction * mean_probs)
        router_z_loss = _router_z_loss(logits)
        self.add_summary("load_balance_loss", load_balance_loss)
        self.add_summary("router_z_loss", router_z_loss)
        return self.Output(
            gate_assignment=assignment.astype(jnp.int32),
            expert_weights=weights,
            load_balance_loss=load_balance_loss,
            router_z_loss=router_z_loss,
        )


# ----- the layers -----


def _weight_array(weight: Union[Tensor, WeightWithCopy], dtype: jnp.dtype) -> Tensor:
    """A layer weight as an array of `dtype` whose gradient flows to the weight (a
    `WeightWithCopy`, which the trainer hands over when it sums microbatches on one
    device, is cast from its float32 weight)."""
    if isinstance(weight, WeightWithCopy):
        weight = weight.weight
    return weight.astype(dtype)


class BaseTransformerFeedForwardMoE(BaseLayer):
    """What both mixture-of-experts layers share: parameters, structure, router, losses.

    Parameters: `gate_weight` [M, E] (the router), `wi_weight` or `wi_0_weight` and
    `wi_1_weight` (gated activations) [E, M, H], `wo_weight` [E, H, M].
    """

    @config_class
    class Config(BaseLayer.Config):
        """Configures BaseTransformerFeedForwardMoE."""

        input_dim: Required[int] = REQUIRED  # Set by TransformerLayer.
        # Each expert's hidden size: an int, or a function config as for
        # TransformerFeedForwardLayer.hidden_dim.
        hidden_dim: Required[HiddenDim] = REQUIRED
        num_experts: Required[int] = REQUIRED
        # One name, or a pair for a gated unit act0(x wi_0) * act1(x wi_1).
        activation: Union[str, Sequence[str]] = "nn.relu"
        norm: BaseLayer.Config = LayerNorm.default_config()
        # On the layer's output, before the residual (the experts' hidden units have none).
        dropout: Dropout.Config = Dropout.default_config()
        stochastic_depth: StochasticDepth.Config = StochasticDepth.default_config()
        # prenorm: x + moe(norm(x)); postnorm: norm(x + moe(x));
        # hybridnorm: x + postnorm(moe(prenorm(x))); nonorm: moe(x) (no residual).
        structure: str = "prenorm"
        residual_weight: float = 1.0  # Multiplies the branch before the residual add.
        gating: Required[BaseGating.Config] = REQUIRED
        # Weights of the load-balancing loss and the router z-loss in the `aux_loss`
        # module output.
        load_balance_loss_weight: float = 0.01
        router_z_loss_weight: float = 0.0
        # Weight in `aux_loss` of the expert correlation loss (`_expert_correlation_loss`
        # of the router weight), which pushes the experts' router directions apart;
        # 0: not computed. Reported unweighted as the summary 'expert_cov_loss'.
        corr_loss_weight: float = 0
        # Partition specs of weights and activations by the letters of their dims.
        dim_to_mesh_axis_map: dict[str, Optional[MeshAxes]] = {}

    # The keys of dim_to_mesh_axis_map that the layer reads.
    _MESH_AXIS_KEYS: tuple[str, ...] = ("me", "emh", "ehm")

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        if cfg.structure not in _STRUCTURES:
            raise ConfigError(
                f"{self.path()}.structure: '{cfg.structure}' is not one of {_STRUCTURES}"
            )
        if not isinstance(cfg.num_experts, int) or cfg.num_experts < 1:
            raise ConfigError(
                f"{self.path()}.num_experts: expected a positive int, got {cfg.num_experts}"
            )
        if cfg.corr_loss_weight < 0:
            raise ConfigError(
                f"{self.path()}.corr_loss_weight must be >= 0, got {cfg.corr_loss_weight}"
            )
        missing = [key for key in self._MESH_AXIS_KEYS if key not in cfg.dim_to_mesh_axis_map]
        if missing:
            raise ConfigError(f"{self.path()}.dim_to_mesh_axis_map lacks {missing}")
        self._hidden_dim = self._resolve_hidden_dim()
        activations = [cfg.activation] if isinstance(cfg.activation, str) else list(cfg.activation)
        if len(activations) not in (1, 2):
            raise ConfigError(
                f"{self.path()}.activation: expected a name or a pair of names, "
                f"got {cfg.activation}"
            )
        self._activations = [get_activation_fn(name) for name in activations]
        if cfg.structure in ("prenorm", "postnorm"):
            self._add_child("norm", cfg.norm.clone(input_dim=cfg.input_dim))
        elif cfg.structure == "hybridnorm":
            self._add_child("prenorm", cfg.norm.clone(input_dim=cfg.input_dim))
            self._add_child("postnorm", cfg.norm.clone(input_dim=cfg.input_dim))
        self._add_child("gating", cfg.gating.clone(num_experts=cfg.num_experts))
        self._add_child("dropout", cfg.dropout)
        self._add_child("stochastic_depth", cfg.stochastic_depth)

    def _resolve_hidden_dim(self) -> int:
        cfg = self.config
        hidden_dim = cfg.hidden_dim
        if isinstance(hidden_dim, InstantiableConfig):
            if "input_dim" in hidden_dim:
                hidden_dim = hidden_dim.clone(input_dim=cfg.input_dim).instantiate()
            else:
                hidden_dim = maybe_instantiate(hidden_dim)(cfg.input_dim)
        if not isinstance(hidden_dim, int) or hidden_dim <= 0:
            raise ConfigError(
                f"{self.path()}.hidden_dim: expected a positive int, got {hidden_dim}"
            )
        return hidden_dim

    @property
    def hidden_dim(self) -> int:
        return self._hidden_dim

    def _wi_names(self) -> list[str]:
        if len(self._activations) == 1:
            return ["wi_weight"]
        return [f"wi_{i}_weight" for i in range(len(self._activations))]

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self.config
        axes = cfg.dim_to_mesh_axis_map
        experts = FanAxes(in_axis=-2, out_axis=-1, batch_axis=0)
        # AXLearn's order and (tuple) shapes, as its golden _init files list them.
        specs = dict(
            gate_weight=ParameterSpec(
                shape=(cfg.input_dim, cfg.num_experts),
                mesh_axes=axes["me"],
                fan_axes=FanAxes(in_axis=-2, out_axis=-1),
            ),
            wo_weight=ParameterSpec(
                shape=(cfg.num_experts, self._hidden_dim, cfg.input_dim),
                mesh_axes=axes["ehm"],
                fan_axes=experts,
            ),
        )
        for name in self._wi_names():
            specs[name] = ParameterSpec(
                shape=(cfg.num_experts, cfg.input_dim, self._hidden_dim),
                mesh_axes=axes["emh"],
                fan_axes=experts,
            )
        return specs

    def matmul_parameter_fraction(self, name: str) -> Optional[float]:
        """The share of parameter `name` a token multiplies by (causal_lm's FLOPs count):
        all of the router, k / num_experts of the experts; None for non-matmul parameters."""
        if name == "gate_weight":
            return 1.0
        if name in self._wi_names() or name == "wo_weight":
            return self.gating.num_experts_per_token / self.config.num_experts
        return None

    def residual_partition_spec(self) -> Optional[MeshAxes]:
        """How the residual stream [B, T, M] is split (TransformerLayer asks its
        feed-forward child); None: not known (norm kernels then stay off on a mesh)."""
        return None

    def forward(self, inputs: Tensor) -> Tensor:
        """[B, T, input_dim] -> [B, T, input_dim]."""
        cfg = self.config
        # The residual comes out of the norm too, whose backward (a kernel on GPU) then
        # sums the residual's gradient with its own.
        residual_spec = self.residual_partition_spec()
        if cfg.structure == "prenorm":
            inputs, x = self.norm.residual_and_norm(inputs, partition_spec=residual_spec)
        elif cfg.structure == "hybridnorm":
            inputs, x = self.prenorm.residual_and_norm(inputs, partition_spec=residual_spec)
        else:
            x = inputs
        y = self._dispatch_and_combine(x)
        if cfg.structure == "hybridnorm":
            y = self.postnorm(y)
        y = self.stochastic_depth(self.dropout(y))
        if cfg.residual_weight != 1.0:
            y = y * cfg.residual_weight
        if cfg.structure == "nonorm":
            return y
        y = residual_add(inputs, y, is_training=self.is_training)
        return self.norm(y) if cfg.structure == "postnorm" else y

    def _router_logits(self, x: Tensor) -> Tensor:
        """float32 router logits [..., E] of x [..., M]."""
        gate = _weight_array(self.parameters["gate_weight"], jnp.float32)
        return jnp.einsum("...m,me->...e", x.astype(jnp.float32), gate)

    def _add_aux_loss(self, load_balance_loss: Tensor, router_z_loss: Tensor) -> None:
        cfg = self.config
        self.add_module_output(
            "aux_loss",
            cfg.load_balance_loss_weight * load_balance_loss
            + cfg.router_z_loss_weight * router_z_loss
            + self._other_weighted_aux_losses(),
        )

    def _other_weighted_aux_losses(self) -> Union[float, Tensor]:
        """Weighted auxiliary losses beyond the router's: the expert correlation loss."""
        cfg = self.config
        if not cfg.corr_loss_weight:
            return 0.0
        gate_weight = _weight_array(self.parameters["gate_weight"], jnp.float32)
        corr_loss, corr_max = _expert_correlation_loss(gate_weight)
        self.add_summary("expert_cov_loss", corr_loss)
        self.add_summary("expert_cov_max", corr_max)
        return cfg.corr_loss_weight * corr_loss

    def _hidden(self, pre_activations: Sequence[Tensor]) -> Tensor:
        """act0(a0) [* act1(a1)]: the experts' hidden units."""
        h = self._activations[0](pre_activations[0])
        if len(pre_activations) == 2:
            h = h * self._activations[1](pre_activations[1])
        return h

    def _dispatch_and_combine(self, x: Tensor) -> Tensor:
        """x [B, T, M] (normalized) -> the experts' weighted outputs [B, T, M]."""
        raise NotImplementedError(type(self))


class TransformerFeedForwardMoE(BaseTransformerFeedForwardMoE):
    """Capacity-based mixture of experts (GShard); see the module doc."""

    @config_class
    class Config(BaseTransformerFeedForwardMoE.Config):
        """Configures TransformerFeedForwardMoE."""

        gating: BaseGating.Config = Top2Gating.default_config()
        # The tokens, [outer_batch, num_groups, group size], are routed a group at a time;
        # batch x seq must divide by outer_batch x num_groups. -1: as many as the mesh
        # splits the outer dim, the product of the sizes of the mesh axes that
        # dim_to_mesh_axis_map['ogsm'] gives it (AXLearn derives it so from the mesh shape).
        outer_batch: int = 1
        num_groups: Required[int] = REQUIRED

    _MESH_AXIS_KEYS = ("me", "emh", "ehm", "ogsm", "ogsec", "oegcm", "oegch")

    @classmethod
    def default_config(cls) -> Config:
        cfg = super().default_config()
        cfg.dim_to_mesh_axis_map = {
            "me": (None, None),
            "emh": ("expert", "fsdp", "model"),
            "ehm": ("expert", "model", "fsdp"),
            # Groups split like the batch; after dispatch, experts over 'expert' (the
            # all-to-all) and groups over the other batch axes.
            "ogsm": (None, ("data", "expert", "fsdp"), None, "model"),
            "ogsec": (None, ("data", "expert", "fsdp"), None, None, None),
            "oegcm": (None, "expert", ("data", "fsdp"), None, "model"),
            "oegch": (None, "expert", ("data", "fsdp"), None, "model"),
        }
        return cfg

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        if not isinstance(cfg.num_groups, int) or cfg.num_groups < 1:
            raise ConfigError(
                f"{self.path()}.num_groups: expected a positive int, got {cfg.num_groups}"
            )
        if not isinstance(cfg.outer_batch, int) or (cfg.outer_batch < 1 and cfg.outer_batch != -1):
            raise ConfigError(
                f"{self.path()}.outer_batch: expected a positive int or -1 (from the mesh), "
                f"got {cfg.outer_batch}"
            )

    def outer_batch(self) -> int:
        """The outer batch the tokens are cut into: cfg.outer_batch, or for -1 the number
        of shards of the outer dim on the current mesh (1 without a mesh)."""
        cfg = self.config
        if cfg.outer_batch != -1:
            return cfg.outer_batch
        sizes = current_mesh_axes()
        outer_axes = axis_names(cfg.dim_to_mesh_axis_map["ogsm"][0])
        return math.prod(sizes.get(name, 1) for name in outer_axes)

    def _dispatch_and_combine(self, x: Tensor) -> Tensor:
        cfg = self.config
        axes = cfg.dim_to_mesh_axis_map
        token_shape = x.shape[:-1]
        num_tokens = math.prod(token_shape)
        outer_batch = self.outer_batch()
        groups = outer_batch * cfg.num_groups
        if num_tokens % groups:
            raise ValueError(
                f"{self.path()}: {num_tokens} tokens ({token_shape}) do not split into "
                f"outer_batch x num_groups = {groups} groups"
            )
        x = x.reshape(outer_batch, cfg.num_groups, num_tokens // groups, cfg.input_dim)
        x = maybe_shard(x, axes["ogsm"])
        gating = self.gating(self._router_logits(x))
        self._add_aux_loss(gating.load_balance_loss, gating.router_z_loss)
        dispatch = maybe_shard(gating.dispatch_tensor.astype(x.dtype), axes["ogsec"])
        combine = maybe_shard(gating.combine_tensor.astype(x.dtype), axes["ogsec"])
        expert_inputs = maybe_shard(jnp.einsum("ogsec,ogsm->oegcm", dispatch, x), axes["oegcm"])
        pre_activations = [
            maybe_shard(
                jnp.einsum(
                    "oegcm,emh->oegch",
                    expert_inputs,
                    _weight_array(self.parameters[name], x.dtype),
                ),
                axes["oegch"],
            )
            for name in self._wi_names()
        ]
        h = self._hidden(pre_activations)
        wo = _weight_array(self.parameters["wo_weight"], x.dtype)
        expert_outputs = maybe_shard(jnp.einsum("oegch,ehm->oegcm", h, wo), axes["oegcm"])
        y = maybe_shard(jnp.einsum("oegcm,ogsec->ogsm", expert_outputs, combine), axes["ogsm"])
        return y.reshape(*token_shape, cfg.input_dim)


# ----- drop-free routing -----


@jax.custom_vjp
def _take_rows(x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
    """x[index] for an `index` that takes each row of x at most once (an index of len(x)
    or more gives a zero row); `inverse[j]` is where row j went (len(index) or more:
    nowhere). The backward pass is then a gather too, `dy[inverse]`, where autodiff would
    scatter-add (atomics on a GPU)."""
    del inverse
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(x, index, inverse):
    return _take_rows(x, index, inverse), inverse


def _take_rows_bwd(inverse, dy):
    return jnp.take(dy, inverse, axis=0, mode="fill", fill_value=0), None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def _inverse_permutation(permutation: Tensor) -> Tensor:
    return jnp.zeros_like(permutation).at[permutation].set(
        jnp.arange(permutation.shape[0], dtype=permutation.dtype)
    )


def _grouped_ffn(
    rows: Tensor,
    group_sizes: Tensor,
    wi: Sequence[Tensor],
    wo: Tensor,
    hidden: Callable[[Sequence[Tensor]], Tensor],
    matmul: "GroupedMatmul",
) -> Tensor:
    """The experts' MLP on `rows` [N, M] sorted by expert, `group_sizes[e]` rows for
    expert e: [N, M], zero in rows past the groups."""
    h = hidden([matmul(rows, w, group_sizes) for w in wi])
    return matmul(h.astype(rows.dtype), wo, group_sizes).astype(rows.dtype)


def _expert_parallel_ffn(
    rows: Tensor,
    experts: Tensor,
    wi: Sequence[Tensor],
    wo: Tensor,
    hidden: Callable[[Sequence[Tensor]], Tensor],
    *,
    num_experts: int,
    expert_axes: tuple[str, ...],
    num_shards: int,
    buffer_rows: int,
    matmul: "GroupedMatmul",
) -> tuple[Tensor, Tensor]:
    """`_grouped_ffn` of this device's `rows` [N, M], sorted by their `experts` [N], when
    the experts are split in `num_shards` blocks over `expert_axes` (wi, wo: this device's
    block). Returns (outputs [N, M], rows dropped for want of buffer space).

    Rows travel to their expert's device in a buffer of `buffer_rows` per destination
    (one all-to-all), are multiplied there, sorted by local expert, and come back the
    same way. A row beyond its destination's buffer gets a zero output.
    """
    num_rows, dim = rows.shape
    local_experts = num_experts // num_shards
    destination = experts // local_experts  # Nondecreasing: rows are sorted by expert.
    send_counts = jnp.bincount(destination, length=num_shards)
    starts = jnp.cumsum(send_counts) - send_counts
    num_slots = num_shards * buffer_rows
    # Buffer block p holds the rows for shard p, rows starts[p] ... starts[p] + count - 1:
    # row i goes to slot destination * buffer_rows + (i - starts[destination]), if it fits.
    position = jnp.arange(num_rows) - starts[destination]
    kept = position < buffer_rows
    slot_of_row = jnp.where(kept, destination * buffer_rows + position, num_slots)
    slot = jnp.arange(buffer_rows)
    row_of_slot = jnp.where(
        slot[None, :] < send_counts[:, None], starts[:, None] + slot[None, :], num_rows
    ).reshape(-1)
    send = _take_rows(rows, row_of_slot, slot_of_row)
    send_experts = jnp.take(
        experts % local_experts, row_of_slot, mode="fill", fill_value=local_experts
    )

    def exchange(x: Tensor) -> Tensor:
        return jax.lax.all_to_all(x, expert_axes, 0, 0, tiled=True)

    received, received_experts = exchange(send), exchange(send_experts)
    order = jnp.argsort(received_experts, stable=True)  # Empty slots (local_experts) last.
    inverse = _inverse_permutation(order)
    group_sizes = jnp.bincount(received_experts, length=local_experts)
    out = _grouped_ffn(
        _take_rows(received, order, inverse), group_sizes, wi, wo, hidden, matmul
    )
    returned = exchange(_take_rows(out, inverse, order))
    return _take_rows(returned, slot_of_row, row_of_slot), jnp.sum(~kept)


def _route_tokens(
    x: Tensor,
    assignment: Tensor,
    weights: Tensor,
    wi: Sequence[Tensor],
    wo: Tensor,
    *,
    hidden: Callable[[Sequence[Tensor]], Tensor],
    num_experts: int,
    expert_axes: tuple[str, ...],
    num_shards: int,
    model_axes: tuple[str, ...],
    capacity_factor: Optional[float],
    matmul: "GroupedMatmul",
) -> tuple[Tensor, Tensor]:
    """One device's part of the drop-free layer: its tokens x [B, S, M], their experts and
    weights [B, S, K]. Returns (outputs [B, S, M], rows dropped, shaped [1])."""
    batch_shape, dim = x.shape[:-1], x.shape[-1]
    k = assignment.shape[-1]
    experts = assignment.reshape(-1)
    order = jnp.argsort(experts, stable=True)
    inverse = _inverse_permutation(order)
    # Each token's k copies, sorted by expert.
    rows = _take_rows(jnp.repeat(x.reshape(-1, dim), k, axis=0), order, inverse)
    if num_shards == 1:
        group_sizes = jnp.bincount(experts, length=num_experts)
        out = _grouped_ffn(rows, group_sizes, wi, wo, hidden, matmul)
        dropped = jnp.zeros([], jnp.int32)
    else:
        num_rows = rows.shape[0]
        buffer_rows = num_rows
        if capacity_factor is not None:
            buffer_rows = min(num_rows, math.ceil(capacity_factor * num_rows / num_shards))
        out, dropped = _expert_parallel_ffn(
            rows,
            experts[order],
            wi,
            wo,
            hidden,
            num_experts=num_experts,
            expert_axes=expert_axes,
            num_shards=num_shards,
            buffer_rows=buffer_rows,
            matmul=matmul,
        )
    if model_axes:  # The hidden dim is split: each device holds a partial sum.
        out = jax.lax.psum(out, model_axes)
    out = _take_rows(out, inverse, order).reshape(-1, k, dim)
    y = jnp.einsum("tkm,tk->tm", out.astype(jnp.float32), weights.reshape(-1, k))
    return y.astype(x.dtype).reshape(*batch_shape, dim), dropped.reshape(1)


# (x [rows, k] sorted by group, w [groups, k, n], group_sizes [groups]) -> [rows, n], zero
# in rows past the groups.
GroupedMatmul = Callable[[Tensor, Tensor, Tensor], Tensor]


class GMMBackend(enum.Enum):
    """AXLearn's names for how TransformerFeedForwardDropFreeMoE's grouped matmuls run."""

    # Pallas kernels: jax's Mosaic GPU grouped GEMMs on a Hopper GPU where they fit
    # (grouped_matmul='mosaic_gpu'), jax.lax.ragged_dot elsewhere.
    PALLAS = "PALLAS"
    RAGGED_DOT = "RAGGED_DOT"  # jax.lax.ragged_dot (grouped_matmul='ragged_dot').
    TOKAMAX = "TOKAMAX"  # tokamax.ragged_dot (the tokamax package), tokamax_implementation.


def _tokamax_grouped_matmul(
    x: Tensor, w: Tensor, group_sizes: Tensor, *, implementation: Optional[Sequence[str]]
) -> Tensor:
    """tokamax.ragged_dot(x, w, group_sizes) with the given implementations (tried in
    order; None: tokamax's choice), zero in rows past the groups."""
    tokamax = importlib.import_module("tokamax")
    if implementation is not None:
        implementation = tuple(implementation)
    y = tokamax.ragged_dot(x, w.astype(x.dtype), group_sizes, implementation=implementation)
    in_groups = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(in_groups[:, None], y, jnp.zeros_like(y))


class TransformerFeedForwardDropFreeMoE(BaseTransformerFeedForwardMoE):
    """Top-k mixture of experts without capacity, on grouped matmuls; see the module doc.

    The config is AXLearn's, field for field. Mesh axes: the tokens follow
    input_dim_to_partition_spec['bsm'] (its model dim must be unsplit) and the layer's
    output output_dim_to_partition_spec['bsm']; the weights are stored as
    dim_to_mesh_axis_map['emh'] / ['ehm'] give them and multiplied as
    output_dim_to_partition_spec['emh'] / ['ehm'] give them: the same experts and hidden
    dims, the model dim unsplit (what the stored layout splits it over, FSDP, is gathered
    first). Experts split over mesh axes (expert parallelism) need the tokens split over
    those axes too; the hidden dim may be split over 'model' (tensor parallelism).

    `num_groups` and `outer_batch` are AXLearn's capacity-layer fields: routing without
    capacity gives the same output whatever the grouping, so the layer routes the tokens
    of each device at once and only checks them (positive; None: one group).
    """

    @config_class
    class Config(BaseTransformerFeedForwardMoE.Config):
        """Configures TransformerFeedForwardDropFreeMoE."""

        # AXLearn's default is the capacity layer's Top2Gating; the layer needs a
        # TopKDropFreeGating config here (and says so).
        gating: BaseGating.Config = Top2Gating.default_config()
        # AXLearn's capacity-layer fields (see the class doc): checked, not needed.
        outer_batch: int = 1
        num_groups: Optional[int] = None
        # Sharding of the tokens [B, S, M] the layer routes: {'bsm': spec}, model dim None.
        input_dim_to_partition_spec: dict[str, Optional[MeshAxes]] = {}
        # Sharding of the layer's output {'bsm'}, and of the expert weights as the grouped
        # matmuls take them {'emh', 'ehm'} (model dim None: gathered from FSDP).
        output_dim_to_partition_spec: dict[str, Optional[MeshAxes]] = {}
        # AXLearn's TPU grouped-matmul (megablox) tiles (tokens, model, hidden), multiples
        # of 128, or a config of a function of the matmul's (m, k, n) giving them; kept so
        # that AXLearn's configs read and dump unchanged. The GPU kernels here take their
        # own tiles (`kernels.grouped_matmul.Tiling`) and ragged_dot none: nothing here
        # reads it. None: not set.
        tiling: Optional[Union[InstantiableConfig, tuple[int, int, int]]] = None
        # AXLearn's debug mode (its Pallas kernel interpreted on the CPU): here, True runs
        # every grouped matmul as jax.lax.ragged_dot, the kernels' reference, whatever
        # `gmm_backend` / `grouped_matmul` choose.
        interpret: bool = False
        # With expert parallelism over n shards, each device sends every other at most
        # ceil(expert_parallel_capacity x its rows / n) rows and drops the rest (summary
        # 'expert_parallel_dropped'). None: room for all its rows, so nothing is dropped,
        # at n times the buffer memory and all-to-all traffic.
        expert_parallel_capacity: Optional[float] = None
        # How the experts' grouped matmuls run: 'ragged_dot' (jax.lax.ragged_dot) or
        # 'mosaic_gpu' (jax's Mosaic GPU grouped-GEMM kernels on a Hopper GPU where they
        # fit, `kernels.grouped_matmul`; ragged_dot elsewhere). XLA's ragged dot on GPUs
        # multiplies densely by every expert. None: as `gmm_backend` says.
        grouped_matmul: Optional[str] = None
        # AXLearn's choice of grouped matmul, which overrides `grouped_matmul` (see
        # GMMBackend); None with grouped_matmul None: PALLAS, as in AXLearn.
        gmm_backend: Optional[GMMBackend] = None
        # TOKAMAX only: the tokamax implementations to try in order (e.g. ['triton', 'xla']);
        # None: tokamax's default.
        tokamax_implementation: Optional[Sequence[str]] = None

    _MESH_AXIS_KEYS = ("me", "emh", "ehm")
    _GROUPED_MATMULS = ("ragged_dot", "mosaic_gpu")

    @classmethod
    def default_config(cls) -> Config:
        cfg = super().default_config()
        pspec = jax.sharding.PartitionSpec
        # AXLearn's defaults: experts unsplit, their model dim over FSDP, hidden over model.
        cfg.dim_to_mesh_axis_map = {
            "me": pspec(None, None),
            "emh": pspec(None, ("fsdp", "seq"), "model"),
            "ehm": pspec(None, "model", ("fsdp", "seq")),
        }
        cfg.input_dim_to_partition_spec = {"bsm": pspec(("data", "fsdp"), "seq", None)}
        cfg.output_dim_to_partition_spec = {
            "bsm": pspec(("data", "fsdp"), "seq", "model"),
            "emh": pspec(None, None, "model"),
            "ehm": pspec(None, "model", None),
        }
        return cfg

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        if not isinstance(self.gating, TopKDropFreeGating):
            raise ConfigError(
                f"{self.path()}.gating: expected a TopKDropFreeGating config, got "
                f"{type(self.gating).__name__} (the default, AXLearn's, is for capacity)"
            )
        if cfg.grouped_matmul is not None and cfg.grouped_matmul not in self._GROUPED_MATMULS:
            raise ConfigError(
                f"{self.path()}.grouped_matmul: '{cfg.grouped_matmul}' is not one of "
                f"{self._GROUPED_MATMULS} or None"
            )
        self._check_gmm_backend()
        if cfg.expert_parallel_capacity is not None and cfg.expert_parallel_capacity <= 0:
            raise ConfigError(f"{self.path()}.expert_parallel_capacity must be > 0 or None")
        groups = cfg.num_groups
        if groups is not None and (not isinstance(groups, int) or groups < 1):
            raise ConfigError(
                f"{self.path()}.num_groups: expected a positive int or None, got {cfg.num_groups}"
            )
        if not isinstance(cfg.outer_batch, int) or (cfg.outer_batch < 1 and cfg.outer_batch != -1):
            raise ConfigError(
                f"{self.path()}.outer_batch: expected a positive int or -1, got {cfg.outer_batch}"
            )
        self._check_tiling()
        self._check_activation_specs()

    def _check_tiling(self) -> None:
        tiling = self.config.tiling
        if tiling is None or isinstance(tiling, InstantiableConfig):
            return
        if (
            not isinstance(tiling, (tuple, list))
            or len(tiling) != 3
            or not all(isinstance(t, int) and t > 0 and t % 128 == 0 for t in tiling)
        ):
            raise ConfigError(
                f"{self.path()}.tiling: expected three positive multiples of 128 "
                f"(tokens, model, hidden), got {tiling!r}"
            )

    def _check_activation_specs(self) -> None:
        cfg = self.config
        for field, keys in (
            ("input_dim_to_partition_spec", ("bsm",)),
            ("output_dim_to_partition_spec", ("bsm", "emh", "ehm")),
        ):
            missing = [key for key in keys if key not in getattr(cfg, field)]
            if missing:
                raise ConfigError(f"{self.path()}.{field} lacks {missing}")
        bsm = cfg.input_dim_to_partition_spec["bsm"]
        if bsm is None or len(bsm) != 3 or bsm[2] is not None:
            raise ConfigError(
                f"{self.path()}.input_dim_to_partition_spec['bsm']={bsm}: expected "
                "(batch, seq, None); the model dim of the tokens cannot be split"
            )
        stored, used = cfg.dim_to_mesh_axis_map, cfg.output_dim_to_partition_spec
        for key, model_dim in (("emh", 1), ("ehm", 2)):
            spec, used_spec = tuple(stored[key]), used[key]
            if used_spec is None or len(used_spec) != 3 or used_spec[model_dim] is not None:
                raise ConfigError(
                    f"{self.path()}.output_dim_to_partition_spec['{key}']={used_spec}: expected "
                    "three entries, the model dim None (gathered)"
                )
            keep = [d for d in range(3) if d != model_dim]
            if any(axis_names(spec[d]) != axis_names(used_spec[d]) for d in keep):
                raise ConfigError(
                    f"{self.path()}.output_dim_to_partition_spec['{key}']={used_spec} must split "
                    f"the experts and hidden dims as dim_to_mesh_axis_map['{key}']={spec} does"
                )

    def _check_gmm_backend(self) -> None:
        cfg = self.config
        if cfg.gmm_backend is not None and not isinstance(cfg.gmm_backend, GMMBackend):
            raise ConfigError(
                f"{self.path()}.gmm_backend: {cfg.gmm_backend!r} is not one of "
                f"{[str(b) for b in GMMBackend]} or None"
            )
        if cfg.gmm_backend is not GMMBackend.TOKAMAX:
            if cfg.tokamax_implementation is not None:
                raise ConfigError(
                    f"{self.path()}.tokamax_implementation is set but gmm_backend is "
                    f"{cfg.gmm_backend}: it applies to GMMBackend.TOKAMAX only"
                )
            return
        if importlib.util.find_spec("tokamax") is None:
            raise ConfigError(
                f"{self.path()}.gmm_backend: GMMBackend.TOKAMAX needs tokamax, "
                "a package not installed here (pip install tokamax); or choose PALLAS or RAGGED_DOT"
            )

    def _backend(self) -> str:
        """The grouped matmul that runs: 'ragged_dot', 'mosaic_gpu' or 'tokamax'."""
        cfg = self.config
        if cfg.interpret:
            return "ragged_dot"
        backend = cfg.gmm_backend
        if backend is None and cfg.grouped_matmul is not None:
            return cfg.grouped_matmul
        return {
            None: "mosaic_gpu",
            GMMBackend.PALLAS: "mosaic_gpu",
            GMMBackend.RAGGED_DOT: "ragged_dot",
            GMMBackend.TOKAMAX: "tokamax",
        }[backend]

    def _grouped_matmul(self, *, kernels: bool) -> GroupedMatmul:
        """The configured grouped matmul; without `kernels` (several devices outside
        shard_map, where a kernel opaque to the partitioner cannot run), ragged_dot."""
        backend = self._backend() if kernels else "ragged_dot"
        if backend == "tokamax":
            return functools.partial(
                _tokamax_grouped_matmul, implementation=self.config.tokamax_implementation
            )
        return functools.partial(grouped_matmul, use_kernels=backend == "mosaic_gpu")

    def residual_partition_spec(self) -> Optional[MeshAxes]:
        """Like the tokens the layer routes: input_dim_to_partition_spec['bsm']."""
        return self.config.input_dim_to_partition_spec["bsm"]

    def _dispatch_and_combine(self, x: Tensor) -> Tensor:
        cfg = self.config
        x = maybe_shard(x, cfg.input_dim_to_partition_spec["bsm"])
        gating = self.gating(self._router_logits(x))
        self._add_aux_loss(gating.load_balance_loss, gating.router_z_loss)
        wi = [_weight_array(self.parameters[name], x.dtype) for name in self._wi_names()]
        wo = _weight_array(self.parameters["wo_weight"], x.dtype)
        route = functools.partial(
            _route_tokens,
            hidden=self._hidden,
            num_experts=cfg.num_experts,
            capacity_factor=cfg.expert_parallel_capacity,
        )
        mesh_axes = current_mesh_axes()
        token_spec = mesh_partition_spec(cfg.input_dim_to_partition_spec["bsm"])
        one_device = math.prod(mesh_axes.values()) <= 1
        if one_device or local_shape(x.shape, token_spec) is None:
            # One device, or tokens that do not split over the mesh (a few decoded ones):
            # every expert on every device, the partitioner gathering the weights (and the
            # kernels, opaque to it, only on one device).
            y, _ = route(
                x, gating.gate_assignment, gating.expert_weights, wi, wo,
                expert_axes=(), num_shards=1, model_axes=(),
                matmul=self._grouped_matmul(kernels=one_device),
            )
        else:
            y, dropped = self._sharded(route, x, gating, wi, wo, token_spec, mesh_axes)
            if cfg.expert_parallel_capacity is not None:
                num_rows = math.prod(gating.gate_assignment.shape)
                self.add_summary("expert_parallel_dropped", jnp.sum(dropped) / num_rows)
        return maybe_shard(y, cfg.output_dim_to_partition_spec["bsm"])

    def _sharded(self, route, x, gating, wi, wo, token_spec, mesh_axes):
        """`route` under shard_map: each device its tokens and its block of experts."""
        cfg = self.config
        used = cfg.output_dim_to_partition_spec
        emh, ehm = mesh_partition_spec(used["emh"]), mesh_partition_spec(used["ehm"])
        expert_axes, model_axes = axis_names(emh[0]), axis_names(emh[2])
        if axis_names(ehm[0]) != expert_axes or axis_names(ehm[1]) != model_axes:
            raise ConfigError(
                f"{self.path()}.output_dim_to_partition_spec: 'emh' {tuple(emh)} and 'ehm' "
                f"{tuple(ehm)} must split the experts and the hidden dim over the same axes"
            )
        token_axes = set(axis_names(token_spec[0])) | set(axis_names(token_spec[1]))
        if not set(expert_axes) <= token_axes:
            raise ConfigError(
                f"{self.path()}.input_dim_to_partition_spec['bsm']: the tokens must be split "
                f"over the expert axes {expert_axes} too"
            )
        num_shards = math.prod(mesh_axes[name] for name in expert_axes)
        if cfg.num_experts % num_shards:
            raise ConfigError(
                f"{self.path()}: {cfg.num_experts} experts do not split over {expert_axes} "
                f"({num_shards} shards)"
            )
        pspec = jax.sharding.PartitionSpec
        routing_spec = pspec(token_spec[0], token_spec[1], None)
        every_device = pspec(tuple(mesh_axes))
        kernels = self._backend() != "ragged_dot"
        sharded = jax.shard_map(
            functools.partial(
                route,
                expert_axes=expert_axes,
                num_shards=num_shards,
                model_axes=model_axes,
                matmul=self._grouped_matmul(kernels=True),
            ),
            in_specs=(token_spec, routing_spec, routing_spec, [emh] * len(wi), ehm),
            out_specs=(token_spec, every_device),
            # A Pallas call has no rule for varying manual axes.
            check_vma=not kernels,
        )
        return sharded(x, gating.gate_assignment, gating.expert_weights, wi, wo)


# The module outputs a scanned stack of these layers should drop (`Repeat.drop_output`
# rules): all but their aux losses, which `causal_lm.AuxLossMetrics` reads.
DROP_ALL_BUT_AUX_LOSS = r"module_outputs/(?!.*/aux_loss$).*"
