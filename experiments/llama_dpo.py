"""Preference tuning (DPO, `axlearn.common.dpo`) of Llama-shaped models.

`as_dpo(cfg, ...)` turns any trainer config of a causal LM into its DPO trainer: the
model becomes a `DPOModel` whose policy is the config's model (its mesh rules' config
paths follow it under `model.policy`), the reference a frozen copy of the starting
weights (frozen by the learner's `update_rules`: no optimizer state), the input pairs.

- `llama_dpo`: a Llama to align: start it from any Hugging Face Llama with
  `--init_from_hf=DIR` (its sizes and weights replace the recipe's 1B model; a fine-tuned
  trainer directory goes through `python -m axlearn.common.hf_llama export` first, in
  float32 for exact weights). Sigmoid DPO, beta 0.1, AdamW at 1e-6; 64 pairs of 2 x 2,048
  tokens a step. Its input is synthetic pairs until `--data_dir` names pair shards.
- `gpt_1b_dpo`: gpt_1b's model and mesh rules under DPO on synthetic pairs of 2 x 2,048
  tokens: the benchmark of DPO against gpt_1b's SFT step.
- `llama_dpo_lora`: `llama_dpo` with LoRA r16, alpha 32 on all seven linear maps
  (`llama_ft.lora_modifier`): only the adapters train (AdamW at 5e-6), the base is frozen
  in bfloat16 and left out of checkpoints, and the reference is the policy with its
  adapters switched off (`reference='adapters_disabled'`): no second copy of the weights.
- `llama_dpo_test`, `llama_dpo_lora_test`: tiny Llamas under DPO (the second with LoRA
  r4 on the seven maps, float32) on synthetic pairs; they train on the CPU.
"""

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from axlearn.common import dpo
from axlearn.common.config import ConfigBase
from axlearn.common.input_fake import FakePairInput
from axlearn.common.trainer import SpmdTrainer
from axlearn.experiments.text.gpt import c4
from axlearn.experiments.text.gpt import common
from experiments import gpt, llama_ft

PAIR_LENGTH = 2048  # Tokens of each side of a pair (prompt and response).


def _retarget(value: Any) -> Any:
    """`value` (a mesh rule's modifier config, a path, a dict of paths) with its config
    paths under 'model.' moved to 'model.policy.'."""
    if isinstance(value, str):
        return "model.policy." + value[len("model.") :] if value.startswith("model.") else value
    if isinstance(value, dict):
        return {_retarget(key): _retarget(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_retarget(item) for item in value)
    if isinstance(value, ConfigBase):
        for name in value.keys():
            if name != "klass":
                setattr(value, name, _retarget(getattr(value, name)))
    return value


def as_dpo(
    cfg: SpmdTrainer.Config,
    *,
    pairs: ConfigBase,
    learning_rate: float,
    max_step: int,
    reference: str = "frozen_copy",
    loss_type: str = "sigmoid",
    beta: float = 0.1,
) -> SpmdTrainer.Config:
    """The DPO trainer of a causal-LM trainer config `cfg` (see the module docstring):
    `pairs` its input, AdamW at `learning_rate` (10% warmup, cosine to 0) for `max_step`
    steps, `cfg`'s learner update rules kept for the policy (a LoRA config's: then
    reference='adapters_disabled'; 'frozen_copy' is refused, `dpo.check_lora_reference`);
    the LM's evalers are dropped (their batches are not pairs)."""
    cfg = cfg.clone()
    # The LM's own update rules (a LoRA modifier's) now name parameters under 'policy/'.
    policy_rules = [
        (regex if regex.startswith(".*") else "policy/" + regex, update)
        for regex, update in cfg.learner.update_rules or ()
    ]
    cfg.model = dpo.DPOModel.default_config().set(
        policy=cfg.model, reference=reference, loss_type=loss_type, beta=beta
    )
    dpo.check_lora_reference(cfg.model, path="model")  # LoRA: reference='adapters_disabled'.
    cfg.learner = c4.adamw_learner_config(
        peak_lr=learning_rate,
        weight_decay=0.0,
        max_step=max_step,
        warmup_steps=max(max_step // 10, 1),
        alpha=0.0,
        b2=0.999,
    )
    rules = [dpo.REFERENCE_UPDATE_RULE] if reference == "frozen_copy" else []
    cfg.learner.update_rules = (rules + policy_rules) or None
    cfg.input = pairs
    cfg.evalers = {}
    cfg.max_step = max_step
    cfg.checkpointer = common.checkpointer_config(
        every_n_steps=max(max_step // 4, 1), max_step=max_step, keep_last_n=2
    )
    cfg.mesh_rules = [(selector, _retarget(rule)) for selector, rule in cfg.mesh_rules or ()]
    return cfg


def _pairs(*, global_batch_size: int, length: int, vocab_size: int) -> FakePairInput.Config:
    return FakePairInput.default_config().set(
        global_batch_size=global_batch_size,
        max_sequence_length=length,
        vocab_size=vocab_size,
        is_training=True,
    )


def llama_dpo_trainer() -> SpmdTrainer.Config:
    """DPO of a Llama (gpt_1b's Llama-shaped model until --init_from_hf replaces it)."""
    vocab_size = gpt.SIZES["1B"].vocab_size
    cfg = as_dpo(
        gpt.gpt_trainer("1B"),
        pairs=_pairs(global_batch_size=64, length=PAIR_LENGTH, vocab_size=vocab_size),
        learning_rate=1e-6,
        max_step=1000,
    )
    # A fine-tuning batch: the single-host GPU and CPU rules (clusters split it too thin).
    single_host = ("gpu-h", "gpu-(h", common.CPU)
    cfg.mesh_rules = [rule for rule in cfg.mesh_rules if rule[0].startswith(single_host)]
    return cfg.set(name="llama_dpo")


def llama_dpo_lora_trainer() -> SpmdTrainer.Config:
    """LoRA DPO of a Llama: the adapters train, the reference is the base without them."""
    vocab_size = gpt.SIZES["1B"].vocab_size
    cfg = as_dpo(
        llama_ft.lora_modifier().instantiate()(gpt.gpt_trainer("1B")),
        pairs=_pairs(global_batch_size=64, length=PAIR_LENGTH, vocab_size=vocab_size),
        learning_rate=5e-6,
        max_step=1000,
        reference="adapters_disabled",
    )
    single_host = ("gpu-h", "gpu-(h", common.CPU)
    cfg.mesh_rules = [rule for rule in cfg.mesh_rules if rule[0].startswith(single_host)]
    return cfg.set(name="llama_dpo_lora")


def gpt_1b_dpo_trainer() -> SpmdTrainer.Config:
    """gpt_1b under DPO on synthetic pairs of 2 x 2,048 tokens (benchmarks)."""
    size = gpt.SIZES["1B"]
    cfg = as_dpo(
        gpt.gpt_trainer("1B"),
        # gpt_1b's rows of 4,096 tokens as pairs of 2 x 2,048: the same tokens a step.
        pairs=_pairs(global_batch_size=size.global_batch_size, length=PAIR_LENGTH,
                     vocab_size=size.vocab_size),
        learning_rate=1e-6,
        max_step=size.max_step,
    )
    return cfg.set(name="gpt_1b_dpo")


def _tiny_lm_trainer() -> SpmdTrainer.Config:
    """A tiny Llama's LM trainer on the CPU (float32), its input synthetic pairs."""
    model = common.model_config(
        dim=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=64, vocab_size=128,
        rope_theta=10000.0, stack="stack", qk_norm=False,
    )
    base = common.trainer_config(
        model=model,
        learner=c4.adamw_learner_config(peak_lr=1e-3, weight_decay=0.0, max_step=100),
        train_input=_pairs(global_batch_size=8, length=32, vocab_size=128),
        evalers={},
        max_step=100,
        mesh_shape=common.mesh_shape_from_axes(fsdp=-1),
        mesh_rules=[(common.CPU, common.mesh_shape_from_axes(fsdp=-1))],
        checkpointer=common.checkpointer_config(every_n_steps=50, max_step=100, keep_last_n=1),
        summary_every_n_steps=10,
        train_dtype=jnp.float32,  # bf16 is emulated (slow) on CPUs.
    )
    return base


def llama_dpo_test_trainer() -> SpmdTrainer.Config:
    """A tiny Llama under DPO on synthetic pairs; trains on the CPU."""
    base = _tiny_lm_trainer()
    cfg = as_dpo(
        base, pairs=base.input, learning_rate=1e-3, max_step=100, beta=0.5
    )
    return cfg.set(name="llama_dpo_test")


def llama_dpo_lora_test_trainer() -> SpmdTrainer.Config:
    """A tiny Llama under LoRA DPO (r4 on the seven maps, all float32); trains on the CPU."""
    modifier = llama_ft.lora_modifier().set(rank=4, alpha=8.0, base_dtype=jnp.float32)
    base = modifier.instantiate()(_tiny_lm_trainer())
    cfg = as_dpo(
        base, pairs=base.input, learning_rate=1e-2, max_step=100, beta=0.5,
        reference="adapters_disabled",
    )
    return cfg.set(name="llama_dpo_lora_test")


def named_trainer_configs() -> dict[str, Callable[[], SpmdTrainer.Config]]:
    return {
        "llama_dpo": llama_dpo_trainer,
        "gpt_1b_dpo": gpt_1b_dpo_trainer,
        "llama_dpo_test": llama_dpo_test_trainer,
        "llama_dpo_lora": llama_dpo_lora_trainer,
        "llama_dpo_lora_test": llama_dpo_lora_test_trainer,
    }


# One line each for `--list_configs`, which prints it beside the parameter count.
DESCRIPTIONS = {
    "llama_dpo": "DPO (sigmoid, beta 0.1, frozen reference copy) of a Llama: "
    "--init_from_hf=DIR for its model and weights; pairs of 2 x 2,048 tokens.",
    "gpt_1b_dpo": "gpt_1b under DPO on synthetic pairs of 2 x 2,048 tokens (benchmarks "
    "against gpt_1b).",
    "llama_dpo_test": "A tiny Llama under DPO on synthetic pairs; trains on the CPU.",
    "llama_dpo_lora": "LoRA DPO (r16 on the seven linear maps, reference: the base with "
    "the adapters off) of a Llama: --init_from_hf=DIR; pairs of 2 x 2,048 tokens.",
    "llama_dpo_lora_test": "A tiny Llama under LoRA DPO on synthetic pairs; trains on the CPU.",
}

