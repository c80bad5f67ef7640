"""Reading AXLearn's own golden configs: every value form they hold parses, and each file
dumps back to the same text.

The files (apple/axlearn's `c4_trainer` goldens) are kept beside the repository, in
shared/axlearn_goldens/ (or where AXLEARN_GOLDENS says, `tests.reference_spec.shared_path`);
the tests that need them skip where they are absent.
"""

import enum
import logging
import math
from typing import Optional

import pytest

from axlearn.common.config import (
    REQUIRED,
    ConfigError,
    Configurable,
    Required,
    UnknownFieldError,
    config_class,
    format_value,
    import_name,
    register_configurable,
)
from axlearn.common.golden_text import (
    EnumText,
    UnresolvedConfig,
    parse_flat_text,
    read_value,
    unresolved_values,
)
from tests.reference_spec import shared_path

GOLDENS_ENV = "AXLEARN_GOLDENS"
GOLDENS_DIR = shared_path(GOLDENS_ENV, "axlearn_goldens")
# The ten trainer configs (the _init and _regularizer files are not config text).
GOLDEN_NAMES = sorted(
    p.name
    for p in (GOLDENS_DIR.glob("*.txt") if GOLDENS_DIR else ())
    if not p.stem.endswith(("_init", "_regularizer"))
)


def golden_text(name: str) -> str:
    if GOLDENS_DIR is None:
        pytest.skip(f"shared/axlearn_goldens not found (set {GOLDENS_ENV} to its path)")
    return (GOLDENS_DIR / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", GOLDEN_NAMES or ["<absent>"])
def test_axlearn_golden_parses_and_dumps_back_identically(name):
    text = golden_text(name)
    cfg = parse_flat_text(text, source=name, foreign=True)
    assert cfg.debug_string() + "\n" == text


# ----- instantiating and training from the text -----

# The model families: Fuji (dense) and Envy (Switch-style mixture of experts, dense and
# expert layers alternating); their "-test" sizes train on the CPU.
FAMILIES = ("fuji-", "envy-")
MODEL_NAMES = [name for name in GOLDEN_NAMES if name.startswith(FAMILIES)]
TEST_SIZE_NAMES = [
    name for name in MODEL_NAMES if name.startswith(tuple(f"{family}test" for family in FAMILIES))
]
ENVY_NAMES = [name for name in MODEL_NAMES if name.startswith("envy-")]


def _without_missing_metrics(text: str) -> str:
    """`text` less its `model.metrics` lines where causal_lm's loss metrics are not here
    yet (they come with the MoE issue); the rest of the file is what is tested."""
    try:
        import_name("axlearn.common.causal_lm.CompositeLossMetrics")
        return text
    except ConfigError:
        return "\n".join(line for line in text.splitlines() if not line.startswith("model.metrics"))


def _synthetic_trainer_config(name: str):
    """The golden's trainer config, on synthetic batches of its shape, on one mesh axis."""
    from axlearn.common import launch_data  # pylint: disable=import-outside-toplevel

    cfg = parse_flat_text(_without_missing_metrics(golden_text(name)), source=name, foreign=True)
    # Mesh rules apply only on the hardware they name (FP8's modifier is not here yet).
    assert [path for path, _ in unresolved_values(cfg) if not path.startswith("mesh_rules")] == []
    cfg = launch_data.use_fake_data(cfg)
    cfg.mesh_shape = (1, -1, 1, 1, 1, 1)  # The goldens' meshes are for 8+ devices.
    return cfg


def _text_value(text: str, key: str) -> str:
    """The value written on the `key: value` line of a golden's text."""
    values = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith(f"{key}: ")]
    assert len(values) == 1, (key, values)
    return values[0]


def _synthetic_trainer(name: str):
    """(the golden's synthetic trainer config, the trainer built from it)."""
    cfg = _synthetic_trainer_config(name)
    return cfg, cfg.instantiate(parent=None)


@pytest.mark.parametrize("name", MODEL_NAMES or ["<absent>"])
def test_golden_instantiates_on_synthetic_data(name):
    cfg, trainer = _synthetic_trainer(name)
    specs = trainer.model_param_specs["decoder"]["emb"]["token_emb"]["weight"]
    assert list(specs.shape) == [cfg.model.decoder.vocab_size, cfg.model.decoder.dim]


def test_fuji_test_v3_regularizer_golden_equals_ours():
    from axlearn.common import golden_config  # pylint: disable=import-outside-toplevel

    cfg = _synthetic_trainer_config("fuji-test-v3.txt")
    assert golden_config.regularizer_text(cfg) + "\n" == golden_text("fuji-test-v3_regularizer.txt")


@pytest.mark.parametrize("name", ENVY_NAMES or ["<absent>"])
def test_envy_golden_alternates_dense_and_expert_layers(name):
    text = golden_text(name)
    _, trainer = _synthetic_trainer(name)
    stage = trainer.model_param_specs["decoder"]["transformer"]["repeat"]["layer"]
    repeats = int(_text_value(text, "model.decoder.transformer.num_layers"))
    dim = int(_text_value(text, "model.decoder.dim"))
    moe = "model.decoder.transformer.layer.layer[1].feed_forward"
    experts = int(_text_value(text, f"{moe}.num_experts"))
    assert "gate_weight" not in stage["layer0"]["feed_forward"]
    assert list(stage["layer1"]["feed_forward"]["gate_weight"].shape) == [repeats, dim, experts]


@pytest.mark.slow  # Compiles and runs a trainer.
@pytest.mark.parametrize("name", TEST_SIZE_NAMES or ["<absent>"])
def test_test_size_golden_trains_five_steps_from_its_text(name, caplog):
    text = golden_text(name)
    cfg = _synthetic_trainer_config(name)
    cfg.set(max_step=5, vlog=1)
    trainer = cfg.instantiate(parent=None)
    with caplog.at_level(logging.INFO, logger="axlearn.common.trainer"):
        summaries = trainer.run()
    assert trainer.step == 5 and math.isfinite(summaries["loss"])
    batch = _text_value(text, "input.input_dispatcher.global_logical_batch_size")
    seq_len = _text_value(text, "input.source.max_sequence_length")
    assert f"Step 5: batch {{'input_ids': ({batch}, {seq_len})" in caplog.text


def test_the_ten_axlearn_goldens_are_present():
    if GOLDENS_DIR is None:
        pytest.skip("shared/axlearn_goldens not found")
    assert len(GOLDEN_NAMES) == 10


# ----- value forms -----


def test_partition_spec_reads_as_a_jax_partition_spec_and_writes_back():
    from jax.sharding import PartitionSpec  # pylint: disable=import-outside-toplevel

    for text, want in [
        ("PartitionSpec(('data', 'expert', 'fsdp'),)", PartitionSpec(("data", "expert", "fsdp"))),
        (
            "PartitionSpec(('data', 'fsdp'), None, 'model')",
            PartitionSpec(("data", "fsdp"), None, "model"),
        ),
        ("PartitionSpec(None, None)", PartitionSpec(None, None)),
        ("PartitionSpec()", PartitionSpec()),
    ]:
        value = read_value(text)
        assert isinstance(value, PartitionSpec) and value == want
        assert format_value(value) == text


def test_numbers_strings_and_containers_read_as_python_literals():
    assert read_value("-1") == -1 and read_value("1e-08") == 1e-08
    assert read_value("'<n>'") == "<n>" and read_value("'\\n'") == "\n"
    assert read_value("[1, (None, 'a')]") == [1, (None, "a")]
    assert read_value("inf") == math.inf and read_value("-inf") == -math.inf
    assert math.isnan(read_value("nan"))


def test_calls_and_names_other_than_partition_spec_are_refused():
    with pytest.raises(ValueError, match="not a literal"):
        read_value("os.system('true')")
    with pytest.raises(ConfigError, match=r"<text>:1: cannot read value"):
        parse_flat_text("x: open('f')")


class Backend(enum.Enum):
    TOKAMAX = "TOKAMAX"
    XLA = "XLA"


class WithEnum(Configurable):
    @config_class
    class Config(Configurable.Config):
        backend: Backend = Backend.XLA
        other: Optional[int] = None
        dim: Required[int] = REQUIRED


def test_enum_values_write_and_read_as_python_enum_reprs():
    cfg = WithEnum.default_config().set(backend=Backend.TOKAMAX, dim=2)
    text = cfg.debug_string()
    assert "backend: <Backend.TOKAMAX: 'TOKAMAX'>" in text.splitlines()
    parsed = parse_flat_text(text)
    assert parsed.backend is Backend.TOKAMAX and parsed.debug_string() == text


def test_an_enum_of_an_unknown_type_is_kept_as_text_and_blocks_instantiation():
    text = "\n".join(
        [
            "dim: 2",
            "klass: 'tests.test_axlearn_goldens.WithEnum'",
            "other: <GMMBackend.TOKAMAX: 'TOKAMAX'>",
        ]
    )
    with pytest.raises(ConfigError, match="GMMBackend"):
        parse_flat_text(text)
    cfg = parse_flat_text(text, source="f.txt", foreign=True)
    assert isinstance(cfg.other, EnumText) and cfg.debug_string() == text
    with pytest.raises(ConfigError, match=r"f.txt:3: other: enum GMMBackend"):
        cfg.instantiate()


def test_tuple_dict_keys_read_and_write_back():
    text = "\n".join(
        [
            "fn: 'tests.test_axlearn_goldens.rank_table'",
            "table[(None, 1)]: PartitionSpec(('data', 'fsdp'),)",
            "table[(None, 2)]: PartitionSpec(('data', 'fsdp'), 'seq')",
        ]
    )
    cfg = parse_flat_text(text)
    assert list(cfg.table) == [(None, 1), (None, 2)]
    assert cfg.debug_string() == text
    assert cfg.instantiate() == 2


@register_configurable
def rank_table(table: dict) -> int:
    return len(table)


# ----- names and fields this library lacks -----

_UNKNOWN_CLASS_TEXT = "\n".join(
    [
        "child.klass: 'axlearn.common.no_such_module.Missing'",
        "child.size: None",
        "child.spec: PartitionSpec('data',)",
        "dim: 2",
        "klass: 'tests.test_axlearn_goldens.Parent'",
    ]
)


class Parent(Configurable):
    @config_class
    class Config(Configurable.Config):
        child: Optional[Configurable.Config] = None
        dim: Required[int] = REQUIRED
        scale: float = 1.0

    def __init__(self, cfg):
        super().__init__(cfg)
        self.child = cfg.child.instantiate()


def test_a_name_that_does_not_import_raises_by_default():
    missing = "'axlearn.common.no_such_module.Missing'"
    with pytest.raises(ConfigError, match=rf"<text>:1: child.klass: {missing}"):
        parse_flat_text(_UNKNOWN_CLASS_TEXT.replace("scale", "x"))


def test_a_foreign_unknown_class_dumps_back_and_fails_to_instantiate_naming_path_and_class():
    # `scale` is absent from the text, so in a complete dump it was None.
    cfg = parse_flat_text(_UNKNOWN_CLASS_TEXT, source="g.txt", foreign=True)
    assert isinstance(cfg.child, UnresolvedConfig) and cfg.scale is None
    assert cfg.debug_string() == _UNKNOWN_CLASS_TEXT
    with pytest.raises(
        ConfigError, match=r"g.txt:1: child.klass: 'axlearn.common.no_such_module.Missing' does"
    ):
        cfg.instantiate()
    assert [path for path, _ in unresolved_values(cfg)] == ["child"]


def test_a_foreign_field_the_class_lacks_dumps_back_and_fails_to_instantiate():
    text = "dim: 2\nklass: 'tests.test_axlearn_goldens.Parent'\nscale: 1.0\nvlog: 3"
    with pytest.raises(UnknownFieldError, match=r"<text>:4: vlog: .*has no field 'vlog'"):
        parse_flat_text(text)
    cfg = parse_flat_text(text, source="h.txt", foreign=True)
    assert isinstance(cfg, Parent.Config) and cfg.debug_string() == text
    with pytest.raises(ConfigError, match=r"h.txt:4: <root>: .*Parent has no field\(s\) 'vlog'"):
        cfg.instantiate()


def test_a_field_left_out_of_foreign_text_reads_as_none_but_keeps_its_default_otherwise():
    text = "dim: 2\nklass: 'tests.test_axlearn_goldens.Parent'"
    assert parse_flat_text(text).scale == 1.0
    foreign = parse_flat_text(text, foreign=True)
    assert foreign.scale is None and foreign.debug_string() == text
