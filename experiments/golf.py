"""golf_baseline: a speedrun-style small GPT in the same config language as the GPT sizes.

The model: 9 pre-norm layers of width 512, 8 query heads sharing 4 key/value heads
(head dim 64, RoPE, RMS QK-norm), a plain 2x MLP (hidden 1024) with ReLU^2, a 1024-token
vocabulary, embeddings tied with the LM head and logits soft-capped at 30. Sequences of
1024 tokens, 512 rows a step (524,288 tokens), Muon for the hidden matrices and AdamW for
the rest.

Data: token shards (`axlearn.common.input_tokens`) made with a 1024-id vocabulary, by
default under `data/golf/` relative to the working directory:

    python -m axlearn.common.input_tokens build --vocab=<1024-id sentencepiece model> \\
        --output=data/golf/train TRAIN_FILES...
    python -m axlearn.common.input_tokens build --vocab=<same model> \\
        --output=data/golf/validation VALIDATION_FILES...

Point elsewhere with `--config_override=input.paths="['/data/fw/train-*.tok']"` (and
`evalers['validation'].input.paths=...`), or train on synthetic batches with
`--data_dir=FAKE`. The evaler reports loss and bits per byte over the whole validation set.

On one 80 GB GPU it runs with layers unrolled, no remat and unmasked cuDNN attention
(attend_across_documents): a whole step's activations fit, and recomputing them would
only cost speed. Parameters and optimizer state are negligible (17M parameters).
"""

from collections.abc import Callable

from axlearn.common.attention import build_remat_spec
from axlearn.common.input_tokens import TokenShardInput
from axlearn.common.layers import OneHotGradEmbedding
from axlearn.common.quantization import QuantizationAwareTrainingModifier
from axlearn.common.trainer import SpmdTrainer
from axlearn.experiments.text.gpt import common

# Default shard locations (globs, relative to the working directory).
TRAIN_SHARDS = "data/golf/train-*.tok"
VALIDATION_SHARDS = "data/golf/validation-*.tok"

VOCAB_SIZE = 1024
MAX_SEQUENCE_LENGTH = 1024
GLOBAL_BATCH_SIZE = 512  # 512 x 1024 = 524,288 tokens a step.
MAX_STEP = 20_000

# Single-host GPU rules by GPU count: the rows each GPU holds decide the remat (see above).
_SAVE_PROJECTIONS = build_remat_spec()
SINGLE_HOST_REMAT = (
    ((1,), None),  # 512 rows: fits 80 GB without remat.
    ((2, 4, 8), None),  # 256 rows or fewer: everything fits without recomputation.
)


def _shard_input(paths: str, *, is_training: bool) -> TokenShardInput.Config:
    return TokenShardInput.default_config().set(
        is_training=is_training,
        paths=[paths],
        global_batch_size=GLOBAL_BATCH_SIZE,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        model_vocab_size=VOCAB_SIZE,  # Rejects shards whose ids do not fit the model.
        shuffle=is_training,  # Evaluation reads the validation set once, in order.
    )


def mesh_rules() -> list[tuple[str, object]]:
    """Data parallel everywhere: at 17M parameters, sharding them would only add traffic."""
    data_parallel = common.mesh_shape_from_axes(data=-1)
    rules = [
        common.fleet_mesh_rule(fleet, data_parallel, global_batch_size=GLOBAL_BATCH_SIZE)
        for fleet in (
            common.TPU_V4,
            common.TPU_V5E,
            common.GPU_H100_CLUSTER,
            common.GPU_A100_CLUSTER,
            common.TPU_V5P,
        )
    ]
    for gpu_counts, remat_spec in SINGLE_HOST_REMAT:
        rules.append(
            (
                common.GPU_SINGLE_HOST.selector(gpu_counts),
                common.single_host_gpu_rule(
                    remat_spec, mesh_shape=data_parallel, unrolled_layers=True
                ),
            )
        )
    rules.append((common.CPU, data_parallel))
    return [rule for rule in rules if rule is not None]


def golf_baseline() -> SpmdTrainer.Config:
    """The baseline trainer (see the module docstring)."""
    model = common.model_config(
        dim=512,
        num_layers=9,
        num_heads=8,
        num_kv_heads=4,
        hidden_dim=1024,
        vocab_size=VOCAB_SIZE,
        activation="squared_relu",
        rope_theta=10000.0,
        qk_norm=True,
        z_loss_scale=0.0,  # The soft cap already bounds the logits.
        remat_spec=_SAVE_PROJECTIONS,
        logits_soft_cap=30.0,
        attend_across_documents=True,  # Speedrun style; lets cuDNN run unmasked.
        # The dead-neuron and value-RMS summaries reduce over every MLP activation: a cost
        # in every step for a diagnostic.
        extra_ffn_summaries=False,
    )
    # Real text's frequent tokens serialize the table gradient's scatter-add on a GPU.
    model.decoder.emb.token_emb.set(klass=OneHotGradEmbedding)
    return common.trainer_config(
        model=model,
        learner=common.muon_learner_config(max_step=MAX_STEP),
        train_input=_shard_input(TRAIN_SHARDS, is_training=True),
        evalers={
            "validation": common.evaler_config(
                input_cfg=_shard_input(VALIDATION_SHARDS, is_training=False),
                every_n_steps=1000,
                max_step=MAX_STEP,
            )
        },
        max_step=MAX_STEP,
        mesh_shape=common.mesh_shape_from_axes(data=-1),
        mesh_rules=mesh_rules(),
        checkpointer=common.checkpointer_config(
            every_n_steps=1000, max_step=MAX_STEP, keep_last_n=3
        ),
        name="golf_baseline",
    )


def golf_baseline_qat() -> SpmdTrainer.Config:
    """golf_baseline trained with int6 fake quantization of its weights (straight-through
    gradients), for a smaller round-trip loss of its quantized artifact."""
    cfg = QuantizationAwareTrainingModifier.default_config().set(quantize="int6").instantiate()(
        golf_baseline()
    )
    cfg.name = "golf_baseline_qat"
    return cfg


def named_trainer_configs() -> dict[str, Callable[[], SpmdTrainer.Config]]:
    return {"golf_baseline": golf_baseline, "golf_baseline_qat": golf_baseline_qat}


# One line each for `--list_configs`, which prints it beside the parameter count.
DESCRIPTIONS = {
    "golf_baseline": "A speedrun-style GPT (9 layers of width 512, 1,024-id vocabulary) on "
    "token shards under data/golf/, with Muon for the hidden matrices.",
    "golf_baseline_qat": "golf_baseline trained with int6 fake quantization of its weights "
    "(straight-through gradients): a smaller loss through its quantized artifact.",
}
