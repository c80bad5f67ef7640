"""Preference tuning: DPO and its variants as a model that wraps a causal LM.

`DPOModel` scores each preference pair (a prompt with a chosen and a rejected response)
by the summed log-probability of each response's tokens under the policy (a
`causal_lm.Model`), log pi(y | x) = sum_t w_t log p(y_t | x, y_<t), where the pair
batch's weights w are 1 on response tokens only, and turns the pair into a loss
(`preference_loss`, Rafailov et al. 2023; Azar et al. 2023; Meng et al. 2024):

    sigmoid (DPO): d = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r))
                   loss = -(1 - ls) log sigmoid(beta d) - ls log sigmoid(-beta d)
    ipo:           d = the same log-ratios, each divided by its response's token count
                   loss = (d - 1 / (2 beta))^2
    simpo:         d = log pi(y_c) / |y_c| - log pi(y_r) / |y_r| - gamma / beta
                   loss = -(1 - ls) log sigmoid(beta d) - ls log sigmoid(-beta d)

(ls: `label_smoothing`, the conservative DPO of Mitchell 2023; gamma: `simpo_gamma`.)
The log-probabilities of the reference come from `reference`:

- 'frozen_copy': a second copy of the policy's weights as the `reference` child,
  initialized to the policy's starting weights (`initialize_parameters_recursively`, or
  `PolicyWeights` for loaded weights) and run under stop_gradient. It must be frozen by the
  learner's `update_rules` (`REFERENCE_UPDATE_RULE`): then it has no optimizer state.
  Refused for a LoRA policy (`check_lora_reference`): its reference is 'adapters_disabled'.
- 'batch': `reference_chosen_logps` / `reference_rejected_logps` [B] in the batch
  (computed ahead, e.g. by `DPOModel.reference_log_probs` over the pairs once).
- 'adapters_disabled': the policy itself inside `lora.adapters_disabled()` (the frozen
  base of a LoRA policy: no second copy of the weights).
- 'none': reference-free (every reference log-probability is 0); SimPO needs it.

Summaries, as trl's DPOTrainer logs them: 'loss', 'rewards/chosen', 'rewards/rejected'
(beta x log-ratio; SimPO: beta x the length-normalized log-probability), 'rewards/margins'
(chosen - rejected), 'rewards/accuracies' (share of pairs with chosen > rejected),
'logps/chosen', 'logps/rejected' (summed policy log-probabilities), each a mean over pairs.

Pair batches (one pair a row, not packed): `chosen_input_ids`, `chosen_target_labels`,
`chosen_target_weights` and the same three for `rejected_`, each [B, T].
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp

from axlearn.common.base_layer import BaseLayer
from axlearn.common.causal_lm import matmul_parameter_count
from axlearn.common.config import (
    REQUIRED,
    Configurable,
    ConfigError,
    InstantiableConfig,
    Required,
    config_class,
)
from axlearn.common.module import Module, Tensor
from axlearn.common.summary import WeightedScalar

LOSS_TYPES = ("sigmoid", "ipo", "simpo")
REFERENCES = ("frozen_copy", "batch", "adapters_disabled", "none")
# The learner update rule that freezes the reference copy ('frozen_copy').
REFERENCE_UPDATE_RULE = ("reference/.*", "no_update")
SIDES = ("chosen", "rejected")
# Summaries `DPOModel.forward` adds, as trl names them.
METRIC_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def preference_loss(
    *,
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> tuple[Tensor, Tensor, Tensor]:
    """(per-pair loss, chosen rewards, rejected rewards), each [B], of summed response
    log-probabilities [B] and response token counts [B] (the module docstring's formulas;
    a count below 1 counts as 1)."""
    chosen_lengths = jnp.maximum(chosen_lengths, 1.0)
    rejected_lengths = jnp.maximum(rejected_lengths, 1.0)
    chosen_ratio = chosen_logps - reference_chosen_logps
    rejected_ratio = rejected_logps - reference_rejected_logps

    def smoothed_sigmoid(delta):
        return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(
            beta * delta
        ) - label_smoothing * jax.nn.log_sigmoid(-beta * delta)

    if loss_type == "sigmoid":
        losses = smoothed_sigmoid(chosen_ratio - rejected_ratio)
        chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
    elif loss_type == "ipo":
        delta = chosen_ratio / chosen_lengths - rejected_ratio / rejected_lengths
        losses = jnp.square(delta - 1.0 / (2.0 * beta))
        chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
    elif loss_type == "simpo":
        chosen_mean = chosen_logps / chosen_lengths
        rejected_mean = rejected_logps / rejected_lengths
        losses = smoothed_sigmoid(chosen_mean - rejected_mean - simpo_gamma / beta)
        chosen_rewards, rejected_rewards = beta * chosen_mean, beta * rejected_mean
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    stop = jax.lax.stop_gradient
    return losses, stop(chosen_rewards), stop(rejected_rewards)


class DPOModel(BaseLayer):
    """A causal LM (`policy`) trained on preference pairs (see the module docstring)."""

    # The child that holds the language model: trainer_dir, export and lm-eval read it.
    language_model_field = "policy"

    @config_class
    class Config(BaseLayer.Config):
        """Configures DPOModel."""

        policy: Required[InstantiableConfig] = REQUIRED  # A causal_lm.Model config.
        # Where reference log-probabilities come from: one of REFERENCES.
        reference: str = "frozen_copy"
        # 'frozen_copy': the dtype the reference weights are stored in; None: the policy's.
        reference_dtype: Optional[jnp.dtype] = None
        loss_type: str = "sigmoid"  # One of LOSS_TYPES.
        beta: float = 0.1  # Inverse temperature of the implicit reward (IPO: its tau).
        # Probability that a pair's labels are flipped (sigmoid and simpo); 0: plain DPO.
        label_smoothing: float = 0.0
        simpo_gamma: float = 0.5  # SimPO's target reward margin (loss_type 'simpo').

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        path = self.path()
        if cfg.reference not in REFERENCES:
            raise ConfigError(f"{path}.reference must be one of {REFERENCES}, got {cfg.reference!r}")
        if cfg.loss_type not in LOSS_TYPES:
            raise ConfigError(f"{path}.loss_type must be one of {LOSS_TYPES}, got {cfg.loss_type!r}")
        if not cfg.beta > 0:
            raise ConfigError(f"{path}.beta must be > 0, got {cfg.beta!r}")
        if not 0 <= cfg.label_smoothing < 0.5:
            raise ConfigError(f"{path}.label_smoothing must be in [0, 0.5), got {cfg.label_smoothing!r}")
        if cfg.loss_type == "ipo" and cfg.label_smoothing:
            raise ConfigError(f"{path}.label_smoothing: IPO has none; set it to 0")
        if cfg.loss_type == "simpo" and cfg.reference != "none":
            raise ConfigError(
                f"{path}.reference={cfg.reference!r}: SimPO is reference-free; set it to 'none'"
            )
        if cfg.reference_dtype is not None and cfg.reference != "frozen_copy":
            raise ConfigError(f"{path}.reference_dtype is only for reference='frozen_copy'")
        check_lora_reference(cfg, path=path)
        self._add_child("policy", cfg.policy)
        if cfg.reference == "frozen_copy":
            reference = cfg.policy.clone()
            if cfg.reference_dtype is not None:
                reference.dtype = cfg.reference_dtype
            self._add_child("reference", reference)

    @classmethod
    def init_params_config(cls, source: InstantiableConfig) -> InstantiableConfig:
        """The trainer's `init_params` for a DPOModel whose policy starts from `source` (an
        `init_params` config of the language model; `launch_trainer --init_from_hf`)."""
        return PolicyWeights.default_config().set(source=source)

    def initialize_parameters_recursively(
        self, prng_key: Tensor, *, prefix: str = ""
    ) -> dict[str, Any]:
        """The policy's parameters drawn as usual; the reference copy equal to them."""
        params = super().initialize_parameters_recursively(prng_key, prefix=prefix)
        if "reference" in params:
            params["reference"] = copy_as_reference(params["policy"], self.reference_specs())
        return params

    def reference_specs(self) -> Optional[Any]:
        """The reference copy's parameter specs ('frozen_copy'), else None."""
        if "reference" not in self.children:
            return None
        return self.reference.create_parameter_specs_recursively()

    def _pair_batch(self, input_batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor]:
        """(the chosen rows then the rejected rows as one LM batch [2B, T], their weights)."""
        for side in SIDES:
            for key in ("input_ids", "target_labels", "target_weights"):
                if f"{side}_{key}" not in input_batch:
                    raise KeyError(
                        f"{self.path()}: the batch has no '{side}_{key}' (pair batches carry "
                        f"{{chosen,rejected}}_{{input_ids,target_labels,target_weights}}); "
                        f"it has {sorted(input_batch)}"
                    )
        both = lambda key: jnp.concatenate(  # noqa: E731
            [input_batch[f"{side}_{key}"] for side in SIDES], axis=0
        )
        labels = both("target_labels")
        weights = both("target_weights").astype(jnp.float32) * (labels >= 0)
        return dict(input_ids=both("input_ids"), target_labels=labels), weights

    @staticmethod
    def _sequence_logps(token_logps: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        """Per-side (summed log-probabilities [2, B], token counts [2, B])."""
        summed = jnp.sum(jnp.where(weights > 0, token_logps, 0.0) * weights, axis=-1)
        return summed.reshape(2, -1), jnp.sum(weights, axis=-1).reshape(2, -1)

    def reference_log_probs(self, input_batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """{'reference_chosen_logps', 'reference_rejected_logps'} [B] of the reference
        (not 'batch'): what a batch carries for reference='batch'."""
        lm_batch, weights = self._pair_batch(input_batch)
        logps, _ = self._sequence_logps(self._reference_token_logps(lm_batch), weights)
        logps = jax.lax.stop_gradient(logps)
        return dict(reference_chosen_logps=logps[0], reference_rejected_logps=logps[1])

    def _reference_token_logps(self, lm_batch: dict[str, Tensor]) -> Tensor:
        reference = self.config.reference
        if reference == "frozen_copy":
            return self.reference.target_log_probs(lm_batch)
        if reference == "adapters_disabled":
            # pylint: disable-next=import-outside-toplevel
            from axlearn.common import lora  # Only LoRA runs need it.

            with lora.adapters_disabled():
                return self.policy.target_log_probs(lm_batch)
        if reference == "none":
            return jnp.zeros(lm_batch["target_labels"].shape, jnp.float32)
        raise ValueError(f"{self.path()}: reference={reference!r} reads its log-probs from the batch")

    def forward(self, input_batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Returns (the mean loss over pairs, aux) for a pair batch; aux holds
        'chosen_logps', 'rejected_logps', 'chosen_rewards', 'rejected_rewards' [B]."""
        cfg = self.config
        lm_batch, weights = self._pair_batch(input_batch)
        logps, lengths = self._sequence_logps(self.policy.target_log_probs(lm_batch), weights)
        if cfg.reference == "batch":
            keys = ("reference_chosen_logps", "reference_rejected_logps")
            missing = [key for key in keys if key not in input_batch]
            if missing:
                raise KeyError(
                    f"{self.path()}.reference='batch': the batch has no {missing}; compute "
                    "them ahead (DPOModel.reference_log_probs) or use reference='frozen_copy'"
                )
            reference = jnp.stack([input_batch[key].astype(jnp.float32) for key in keys])
        else:
            reference, _ = self._sequence_logps(self._reference_token_logps(lm_batch), weights)
        reference = jax.lax.stop_gradient(reference)
        losses, chosen_rewards, rejected_rewards = preference_loss(
            chosen_logps=logps[0],
            rejected_logps=logps[1],
            reference_chosen_logps=reference[0],
            reference_rejected_logps=reference[1],
            chosen_lengths=lengths[0],
            rejected_lengths=lengths[1],
            loss_type=cfg.loss_type,
            beta=cfg.beta,
            label_smoothing=cfg.label_smoothing,
            simpo_gamma=cfg.simpo_gamma,
        )
        loss = jnp.mean(losses)
        num_pairs = jnp.asarray(losses.shape[0], jnp.float32)
        margins = chosen_rewards - rejected_rewards
        values = {
            "rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
            "rewards/margins": margins,
            "rewards/accuracies": (margins > 0).astype(jnp.float32),
            "logps/chosen": jax.lax.stop_gradient(logps[0]),
            "logps/rejected": jax.lax.stop_gradient(logps[1]),
        }
        self.add_summary("loss", WeightedScalar(loss, num_pairs))
        for name in METRIC_NAMES:
            self.add_summary(name, WeightedScalar(jnp.mean(values[name]), num_pairs))
        aux = dict(
            chosen_logps=logps[0],
            rejected_logps=logps[1],
            chosen_rewards=chosen_rewards,
            rejected_rewards=rejected_rewards,
        )
        return loss, aux

    def model_flops_per_token(self, seq_len: int) -> float:
        """The policy's training FLOPs a token plus, with a reference model run in the step,
        its forward pass (2 x matmul parameters + attention: a third of the policy's).

        A 'frozen_copy' reference is frozen, and `perf.StepAccounting` takes 2 FLOPs a token
        off each frozen matmul parameter (no weight gradient): its count here is 4 a token
        so that 2 (its forward alone) remain."""
        flops = self.policy.model_flops_per_token(seq_len)
        if self.config.reference in ("frozen_copy", "adapters_disabled"):
            flops *= 4.0 / 3.0
        if self.config.reference == "frozen_copy":
            flops += 2.0 * matmul_parameter_count(self.reference_specs())
        return flops


def check_lora_reference(cfg: DPOModel.Config, *, path: str = "model") -> None:
    """A ConfigError (one line, naming `path`.reference) for a LoRA policy (one with
    `lora` layers, as `lora.LoraConfigModifier` makes it) under reference='frozen_copy':
    that would build a second full copy of the frozen base, where 'adapters_disabled'
    runs the base itself with the adapters off."""
    if cfg.reference != "frozen_copy":
        return
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import lora  # Only LoRA runs need it.

    adapted = sorted(lora.lora_layer_configs(cfg.policy))
    if adapted:
        raise ConfigError(
            f"{path}.reference='frozen_copy': the policy has LoRA adapters ({path}.policy."
            f"{adapted[0]}, ...), so a frozen copy would duplicate its whole frozen base; "
            "use reference='adapters_disabled' (the policy's base with the adapters off)"
        )


def copy_as_reference(policy_params: Any, reference_specs: Any, shardings: Any = None) -> Any:
    """A copy of the policy's parameters in the reference's dtypes (and `shardings`)."""
    is_spec = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")  # noqa: E731
    dtypes = jax.tree.map(lambda spec: spec.dtype, reference_specs, is_leaf=is_spec)

    def copy(params):
        return jax.tree.map(lambda p, dtype: jnp.array(p, dtype=dtype, copy=True), params, dtypes)

    if shardings is None:
        return copy(policy_params)
    return jax.jit(copy, out_shardings=shardings)(policy_params)


class PolicyWeights(Configurable):
    """The initial parameters of a fresh `DPOModel` run (`SpmdTrainer.Config.init_params`):
    the policy's from `source` (an init_params config of the language model, e.g.
    `hf_llama.HfLlamaWeights`), the frozen reference copy equal to them."""

    @config_class
    class Config(Configurable.Config):
        """Configures PolicyWeights."""

        source: Required[InstantiableConfig] = REQUIRED  # Loads the policy's parameters.

    def load(self, *, model_config: Any, param_specs: Any, shardings: Any) -> Any:
        """The parameters of `model_config` (a DPOModel config) in `param_specs`' shapes and
        dtypes, placed by `shardings`."""
        source = self.config.source.instantiate()
        params = dict(
            policy=source.load(
                model_config=model_config.policy,
                param_specs=param_specs["policy"],
                shardings=shardings["policy"],
            )
        )
        if "reference" in param_specs:
            params["reference"] = copy_as_reference(
                params["policy"], param_specs["reference"], shardings["reference"]
            )
        return params
