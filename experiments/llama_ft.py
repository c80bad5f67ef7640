"""Fine-tuning a Llama: full-parameter SFT and LoRA, for any Llama that `--init_from_hf`
names (the model is then the Hugging Face directory's, its weights the starting point).

- `llama_sft`: every parameter trains (AdamW, cosine decay from 2e-5).
- `llama_lora`: LoRA rank 16, alpha 32 on all seven linear maps of each layer (q, k, v,
  o, gate, up, down; `lora.LoraConfigModifier`); everything else is frozen in bfloat16
  with no optimizer state (AdamW from 2e-4 on the adapters only).
- `llama3_sft`, `llama3_lora`: the same at Llama 3 / 3.1 8B's shape.

Without `--init_from_hf` the model is the Llama-2-7B shape (d 4096, 32 layers, 32 heads,
FFN 11008, vocabulary 32000) or, for the `llama3_` configs, Llama-3-8B's (8 KV heads,
FFN 14336, vocabulary 128,256, RoPE theta 500,000, an untied head), with random weights:
what the benchmarks run. Data comes from `--data_dir` (token shards, e.g. chat shards
with their loss masks); sequences of 4,096, packed documents attend within themselves only.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Optional

import jax.numpy as jnp

from axlearn.common import lora
from axlearn.common.attention import build_remat_spec
from axlearn.common.config import config_for_function
from axlearn.common.learner import Learner
from axlearn.common.optimizers import adamw_optimizer, skip_and_clip_by_global_norm
from axlearn.common.schedule import cosine_with_linear_warmup
from axlearn.common.trainer import SpmdTrainer
from axlearn.experiments.text.gpt import common

SEQ_LEN = 4096
GLOBAL_BATCH_SIZE = 8  # Rows of SEQ_LEN tokens a step of full-parameter SFT.
# LoRA's step: 4 rows with nothing recomputed (80 GiB at Llama 2 7B's shape, 92 at Llama
# 3 8B's, on one H200) ran 4% faster than 8 rows recomputing the MLP, and than 2
# microbatches of 4 (docs/performance.md).
LORA_GLOBAL_BATCH_SIZE = 4
MAX_STEP = 2000
# LoRA on every linear map of a Llama layer, as PEFT names them.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _learner(*, learning_rate: float, max_step: int, warmup_steps: int) -> Learner.Config:
    """AdamW under a linear warmup and cosine decay to 10%, clipped at global norm 1
    (steps with a non-finite or 100-times norm are skipped)."""
    adamw = config_for_function(adamw_optimizer).set(
        learning_rate=config_for_function(cosine_with_linear_warmup).set(
            peak_lr=learning_rate, max_step=max_step, warmup_steps=warmup_steps, alpha=0.1
        ),
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        weight_decay=0.0,
    )
    return Learner.default_config().set(
        optimizer=config_for_function(skip_and_clip_by_global_norm).set(
            inner=adamw, drop_norm=100, max_norm=1, eps=1e-8
        ),
    )


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """What differs between the two shapes (both: d 4096, 32 layers, 32 heads)."""

    num_kv_heads: int
    hidden_dim: int
    vocab_size: int
    rope_theta: float
    untied_lm_head: bool  # An LM head of its own instead of the token table's.


LLAMA2_7B = LlamaShape(32, hidden_dim=11008, vocab_size=32000, rope_theta=1e4, untied_lm_head=False)
LLAMA3_8B = LlamaShape(8, hidden_dim=14336, vocab_size=128256, rope_theta=5e5, untied_lm_head=True)


def _trainer(
    *,
    learning_rate: float,
    shape: LlamaShape,
    global_batch_size: int,
    remat_spec: Optional[dict[str, Any]],
    stack: str = "repeat",
) -> SpmdTrainer.Config:
    """`remat_spec`: the layers' rematerialization (None: nothing recomputed); `stack`:
    the layers under a scan ('repeat') or unrolled ('stack')."""
    model = common.model_config(
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=shape.num_kv_heads,
        hidden_dim=shape.hidden_dim,
        vocab_size=shape.vocab_size,
        rope_theta=shape.rope_theta,
        lm_head=common.untied_lm_head() if shape.untied_lm_head else None,
        qk_norm=False,
        z_loss_scale=0.0,
        remat_spec=remat_spec,
        stack=stack,
        extra_ffn_summaries=False,
        attend_across_documents=None,  # Packed documents do not see each other.
    )
    eval_input = common.tfds_text_eval_input(
        dataset_name="c4/en:3.0.1",
        split="validation",
        max_sequence_length=SEQ_LEN,
        sentencepiece_model_name="bpe_32k_c4.model",
        global_batch_size=global_batch_size,
    )
    return common.trainer_config(
        model=model,
        learner=_learner(learning_rate=learning_rate, max_step=MAX_STEP, warmup_steps=50),
        train_input=common.tfds_train_input(
            dataset_name="c4/en:3.0.1", global_batch_size=global_batch_size
        ),
        evalers={
            "validation": common.evaler_config(
                input_cfg=eval_input, every_n_steps=500, max_step=MAX_STEP
            )
        },
        max_step=MAX_STEP,
        # FSDP over every device the host has: one H200 or eight.
        mesh_shape=common.mesh_shape_from_axes(fsdp=-1),
        mesh_rules=[(".*", common.mesh_shape_from_axes(fsdp=-1))],
        checkpointer=common.checkpointer_config(
            every_n_steps=500, max_step=MAX_STEP, keep_last_n=2
        ),
        summary_every_n_steps=25,
    )


def llama_sft_trainer(shape: LlamaShape = LLAMA2_7B) -> SpmdTrainer.Config:
    """Full-parameter SFT of the --init_from_hf Llama (default: the Llama-2-7B shape)."""
    return _trainer(
        learning_rate=2e-5,
        shape=shape,
        global_batch_size=GLOBAL_BATCH_SIZE,
        remat_spec=build_remat_spec(),  # The attention's projections saved, the MLP recomputed.
    )


def lora_modifier() -> lora.LoraConfigModifier.Config:
    """LoRA r16, alpha 32, no dropout on the seven linear maps; a bfloat16 frozen base."""
    return lora.LoraConfigModifier.default_config().set(
        target_modules=list(LORA_TARGETS),
        rank=16,
        alpha=32.0,
        dropout=0.0,
        base_dtype=jnp.bfloat16,
        adapter_dtype=jnp.float32,
    )


def llama_lora_trainer(
    shape: LlamaShape = LLAMA2_7B, stack: str = "stack"
) -> SpmdTrainer.Config:
    """LoRA r16 on all seven linear maps of the --init_from_hf Llama, base frozen in bf16.
    `stack`: the layers unrolled ('stack': 24% faster than under a scan at Llama 2 7B's
    shape on one H200, docs/performance.md) or under a scan ('repeat')."""
    cfg = _trainer(
        learning_rate=2e-4,
        shape=shape,
        global_batch_size=LORA_GLOBAL_BATCH_SIZE,
        remat_spec=None,
        stack=stack,
    )
    return lora_modifier().instantiate()(cfg)


DESCRIPTIONS = {
    "llama_sft": "Full-parameter SFT of an --init_from_hf Llama (default: Llama-2-7B's shape)",
    "llama_lora": "LoRA r16 on all seven linear maps of an --init_from_hf Llama, bf16 base",
    "llama3_sft": "llama_sft at Llama 3 8B's shape (GQA 32/8, vocabulary 128,256)",
    "llama3_lora": "llama_lora at Llama 3 8B's shape (GQA 32/8, vocabulary 128,256)",
}


def named_trainer_configs() -> dict[str, Callable[[], SpmdTrainer.Config]]:
    return {
        "llama_sft": llama_sft_trainer,
        "llama_lora": llama_lora_trainer,
        "llama3_sft": functools.partial(llama_sft_trainer, LLAMA3_8B),
        # Under the scan: unrolled layers are measured at Llama 2's shape only.
        "llama3_lora": functools.partial(llama_lora_trainer, LLAMA3_8B, stack="repeat"),
    }
