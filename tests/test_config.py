"""Specification of axlearn.common.config."""

import dataclasses
import json
import math
import subprocess
import sys
from collections.abc import Sequence
import typing
from typing import Any, ClassVar, Optional, Union

import numpy as np
import pytest

from axlearn.common import config as config_lib
from axlearn.common.config import (
    REQUIRED,
    ConfigError,
    Configurable,
    MissingRequiredFieldsError,
    Required,
    UnknownFieldError,
    apply_overrides,
    config_class,
    config_for_class,
    config_for_function,
    describe_annotation,
    get_recursively,
    maybe_instantiate,
    register_configurable,
    maybe_set_config,
    set_recursively,
)
from axlearn.common.golden_text import parse_flat_text


@register_configurable
def scaled_sum(a: int, b: float = 2.0, *, scale: float = 1.0) -> float:
    return (a + b) * scale


@register_configurable
def optional_args(x: Optional[float], y: Optional[float] = None):
    return (x, y)


class Point:
    def __init__(self, x: int, y: int = 0):
        self.x, self.y = x, y


class Leaf(Configurable):
    @config_class
    class Config(Configurable.Config):
        dim: Required[int] = REQUIRED  # Width.
        eps: float = 1e-5
        dtype: Optional[type] = None

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg)
        self.kwargs = kwargs


class Tree(Configurable):
    @config_class
    class Config(Configurable.Config):
        leaf: Leaf.Config = Leaf.default_config()
        leaves: list = []
        rules: dict = {}
        spec: tuple = ((("expert", "fsdp", "seq"), "model"), None)
        fn: Optional[config_lib.InstantiableConfig] = None
        name: Required[str] = REQUIRED


def test_set_returns_config_for_chaining():
    cfg = Leaf.default_config().set(dim=3).set(eps=0.1)
    assert (cfg.dim, cfg.eps) == (3, 0.1)


def test_default_config_klass_is_the_class():
    assert Leaf.default_config().klass is Leaf


def test_clone_is_deep_and_applies_kwargs():
    cfg = Tree.default_config()
    clone = cfg.clone(name="x")
    clone.leaf.dim = 7
    assert cfg.leaf.dim is REQUIRED and clone.name == "x"


def test_assigning_config_or_list_copies_it():
    leaf = Leaf.default_config().set(dim=1)
    items = [1, 2]
    cfg = Tree.default_config().set(leaf=leaf, leaves=items)
    leaf.dim = 2
    items.append(3)
    assert cfg.leaf.dim == 1 and cfg.leaves == [1, 2]


def test_defaults_are_not_shared_between_instances():
    a, b = Tree.default_config(), Tree.default_config()
    a.leaves.append(1)
    assert b.leaves == []


def test_unknown_field_on_set_names_class_and_suggests():
    with pytest.raises(UnknownFieldError, match=r"Leaf.Config has no field 'epss' \(did you mean: eps\?\)"):
        Leaf.default_config().set(epss=1)


def test_unknown_field_on_attribute_access_and_construction():
    with pytest.raises(UnknownFieldError, match="did you mean: dim"):
        _ = Leaf.default_config().dims
    with pytest.raises(UnknownFieldError, match="has no field 'bogus'"):
        Leaf.Config(bogus=1)
    with pytest.raises(UnknownFieldError, match="did you mean: eps"):
        Leaf.default_config().clone(esp=1)


def test_missing_required_fields_are_all_listed_by_path():
    cfg = Tree.default_config().set(fn=config_for_function(scaled_sum))
    with pytest.raises(MissingRequiredFieldsError) as e:
        cfg.instantiate(config_path="model.decoder")
    assert "model.decoder.fn.a" in str(e.value)
    assert "model.decoder.name" in str(e.value)


def test_instantiate_passes_kwargs():
    obj = Leaf.default_config().set(dim=2).instantiate(extra=1)
    assert isinstance(obj, Leaf) and obj.kwargs == {"extra": 1} and obj.config.dim == 2


def test_config_for_function_fields_from_signature():
    cfg = config_for_function(scaled_sum)
    assert list(cfg.fields()) == ["fn", "a", "b", "scale"]  # Declaration order.
    assert cfg.a is REQUIRED and cfg.b == 2.0
    assert cfg.set(a=1, scale=3.0).instantiate() == 9.0


def test_config_for_class_fields_from_constructor():
    cfg = config_for_class(Point).set(x=4)
    point = cfg.instantiate()
    assert (point.x, point.y) == (4, 0) and cfg.klass is Point


def test_maybe_instantiate_and_maybe_set_config():
    assert maybe_instantiate(3) == 3
    assert maybe_instantiate(config_for_function(scaled_sum).set(a=0)) == 2.0
    cfg = maybe_set_config(Leaf.default_config(), dim=5, not_a_field=1)
    assert cfg.dim == 5


def test_visit_reaches_every_leaf():
    seen = {}
    Tree.default_config().visit(lambda path, value: seen.setdefault(path, value))
    assert seen["spec[0][0][1]"] == "fsdp" and seen["leaf.eps"] == 1e-5 and seen["leaves"] == []


def test_get_and_set_recursively_by_path():
    cfg = Tree.default_config().set(rules={".*w": Leaf.default_config()})
    set_recursively(cfg, "rules['.*w'].dim", 9)
    set_recursively(cfg, "spec[0][1]", "data")
    set_recursively(cfg, ["leaf", "eps"], 0.5)
    assert get_recursively(cfg, "rules['.*w'].dim") == 9
    assert cfg.spec[0][1] == "data" and cfg.leaf.eps == 0.5
    with pytest.raises(UnknownFieldError, match=r"leaf \(Leaf.Config\) has no field 'epz'"):
        get_recursively(cfg, "leaf.epz")
    with pytest.raises(ConfigError, match="out of range"):
        get_recursively(cfg, "spec[5]")


SPEC_LIKE_TEXT = """\
fn.a: 1
fn.b: 2.0
fn.fn: 'tests.test_config.scaled_sum'
fn.scale: 1.0
klass: 'tests.test_config.Tree'
leaf.dim: 8
leaf.dtype: 'jax.numpy.bfloat16'
leaf.eps: 1e-08
leaf.klass: 'tests.test_config.Leaf'
leaves[0][0]: '.*attention/o_proj/weight'
leaves[0][1]: 0.25
leaves[1].eps: 1e-05
leaves[1].klass: 'tests.test_config.Leaf'
name: 'gpt_trainer'
rules['.*weight$'].fn: 'tests.test_config.optional_args'
rules['.*weight$'].x: None
spec[0][0][0]: 'expert'
spec[0][0][1]: 'fsdp'
spec[0][0][2]: 'seq'
spec[0][1]: 'model'
spec[1]: None"""


def _spec_like_tree():
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    return Tree.default_config().set(
        name="gpt_trainer",
        leaf=Leaf.default_config().set(dim=8, eps=1e-8, dtype=jnp.bfloat16),
        leaves=[(".*attention/o_proj/weight", 0.25), Leaf.default_config()],
        rules={".*weight$": config_for_function(optional_args).set(x=None)},
        fn=config_for_function(scaled_sum).set(a=1),
    )


def test_debug_string_matches_golden_format_exactly():
    assert _spec_like_tree().debug_string() == SPEC_LIKE_TEXT


def test_none_is_printed_only_when_it_differs_from_the_default():
    flat = _spec_like_tree().to_flat_dict()
    assert "rules['.*weight$'].x" in flat  # REQUIRED parameter set to None.
    assert "rules['.*weight$'].y" not in flat  # None default.
    assert "leaves[1].dim" not in flat  # Still REQUIRED.


def test_empty_containers_print_as_literals():
    text = Tree.default_config().debug_string()
    assert "leaves: []" in text and "rules: {}" in text


def test_parse_round_trips_byte_for_byte():
    cfg = parse_flat_text(SPEC_LIKE_TEXT)
    assert cfg.debug_string() == SPEC_LIKE_TEXT
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    assert cfg.leaf.dtype is jnp.bfloat16  # Resolved by import, not left a string.
    assert cfg.fn.fn is scaled_sum


def test_parse_error_names_the_line():
    bad = SPEC_LIKE_TEXT.replace("tests.test_config.Leaf'", "tests.test_config.Nope'", 1)
    with pytest.raises(ConfigError, match=r"<text>:9: leaf.klass: 'tests.test_config.Nope' does"):
        parse_flat_text(bad)
    with pytest.raises(UnknownFieldError, match=r"<text>:\d+: leaf.epz: .*did you mean: eps"):
        parse_flat_text(SPEC_LIKE_TEXT.replace("leaf.eps:", "leaf.epz:"))


def test_apply_overrides_literals_and_type_checks():
    cfg = _spec_like_tree()
    apply_overrides(
        cfg, ["leaf.eps=3e-4", "fn.b=3", "spec[0][1]='data'", "leaf.dtype=jax.numpy.float32"]
    )
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    assert cfg.leaf.eps == 3e-4 and cfg.fn.b == 3.0 and isinstance(cfg.fn.b, float)
    assert cfg.spec[0][1] == "data" and cfg.leaf.dtype is jnp.float32
    with pytest.raises(ConfigError, match=r"leaf.eps: expected a number, got 'big' \(a str\)"):
        apply_overrides(cfg, ["leaf.eps='big'"])
    with pytest.raises(UnknownFieldError, match="did you mean: eps"):
        apply_overrides(cfg, ["leaf.epsilon=1.0"])
    with pytest.raises(ConfigError, match="not of the form"):
        apply_overrides(cfg, ["leaf.eps"])


def test_an_override_that_is_no_literal_where_a_number_stands_names_the_field():
    cfg = _spec_like_tree()
    with pytest.raises(config_lib.InvalidConfigValueError) as error:
        apply_overrides(cfg, ["fn.b=-1e9x"])
    assert str(error.value) == "fn.b=-1e9x: fn.b holds a number (2.0); '-1e9x' is not one"
    assert cfg.fn.b == 2.0


def test_to_dict_is_json_serializable():
    data = json.loads(_spec_like_tree().to_json())
    assert data["leaf"]["dtype"] == "jax.numpy.bfloat16" and data["leaf"]["dim"] == 8
    assert data["fn"]["fn"] == "tests.test_config.scaled_sum"


def test_names_in_private_modules_render_as_the_public_name_of_the_same_object(monkeypatch):
    monkeypatch.setenv(config_lib.TRUSTED_PACKAGES_ENV, "tests,concurrent.futures")
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    from concurrent.futures import _base  # pylint: disable=import-outside-toplevel

    # Future lives in concurrent.futures._base and is concurrent.futures.Future.
    assert _base.Future.__module__ == "concurrent.futures._base"
    assert config_lib.qualified_name(concurrent.futures.Future) == "concurrent.futures.Future"
    # A name the package does not expose keeps its private path, which text cannot name.
    name = config_lib.qualified_name(_base._AcquireFutures)  # pylint: disable=protected-access
    assert name == "concurrent.futures._base._AcquireFutures"
    with pytest.raises(config_lib.UntrustedNameError, match="is in a private module"):
        config_lib.import_name(name)
    # A private name of a public module is left as it is.
    assert config_lib.qualified_name(_private_helper) == "tests.test_config._private_helper"
    # The public name round-trips through golden text, once registered.
    register_configurable(concurrent.futures.Future)
    text = config_for_class(concurrent.futures.Future).debug_string()
    assert text == "klass: 'concurrent.futures.Future'"
    assert parse_flat_text(text).klass is concurrent.futures.Future


def _private_helper():
    pass


def test_importing_config_does_not_import_jax():
    code = "import sys, axlearn.common.config, axlearn.common.golden_text; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_field_without_default_must_be_given_to_the_constructor():
    # AXLearn's attrs rule: `dim: int` is a keyword argument the constructor requires.
    @config_class
    class Norm(config_lib.ConfigBase):
        dtype: Any = np.float32

    @config_class
    class LayerNorm(Norm):
        dim: int

    cfg = LayerNorm(dim=16)  # pylint: disable=unexpected-keyword-arg
    assert (cfg.dim, cfg.dtype, cfg.clone(dim=8).dim) == (16, np.float32, 8)
    with pytest.raises(config_lib.MissingFieldArgumentError, match=r"LayerNorm\(\) .*: dim") as e:
        LayerNorm()
    assert isinstance(e.value, TypeError) and isinstance(e.value, ConfigError)


def test_field_redefined_without_a_value_has_no_default():
    @config_class
    class Base(config_lib.ConfigBase):
        scale: int = 1

    @config_class
    class Child(Base):
        scale: float

    child = Child(scale=0.5)  # pylint: disable=unexpected-keyword-arg
    assert Base().scale == 1 and child.scale == 0.5
    with pytest.raises(config_lib.MissingFieldArgumentError, match="scale"):
        Child()


def test_dict_entries_keep_insertion_order_and_fields_sort_by_name():
    """A remat spec written as {'prevent_cse': ..., 'policy': ...} reads in that order."""
    cfg = Tree.default_config().set(
        name="x", rules={"prevent_cse": False, "policy": config_for_function(optional_args).set(x=1.0)}
    )
    keys = list(cfg.to_flat_dict())
    assert keys.index("rules['prevent_cse']") < keys.index("rules['policy'].fn")
    top_level = [k.split(".")[0].split("[")[0] for k in keys]
    assert top_level == sorted(top_level)


# ----- AXLearn's config API: errors, validators, order, to_dict, freezing, copies -----


def test_every_error_class_is_also_a_config_error_and_axlearns_builtin():
    expected_bases = {
        config_lib.UnknownFieldError: AttributeError,
        config_lib.UnknownKeyError: KeyError,
        config_lib.MissingConfigClassDecoratorError: TypeError,
        config_lib.InvalidConfigClassError: TypeError,
        config_lib.InvalidConfigNameError: ValueError,
        config_lib.InvalidConfigValueError: TypeError,
        config_lib.NonConfigFieldError: ValueError,
        config_lib.RequiredFieldMissingError: ValueError,
        config_lib.FrozenConfigError: RuntimeError,
    }
    for cls, builtin in expected_bases.items():
        assert issubclass(cls, ConfigError) and issubclass(cls, builtin), cls
    assert issubclass(MissingRequiredFieldsError, config_lib.RequiredFieldMissingError)


def test_config_class_without_decorator_raises_missing_decorator_error():
    class Undecorated(config_lib.ConfigBase):
        num_layers: int = 10

    with pytest.raises(config_lib.MissingConfigClassDecoratorError, match="@config_class"):
        Undecorated()


def test_config_class_on_a_non_config_class_raises_invalid_config_class_error():
    with pytest.raises(config_lib.InvalidConfigClassError, match="ConfigBase"):

        @config_class
        class NotAConfig:  # pylint: disable=unused-variable
            num_layers: int = 10


@pytest.mark.parametrize("name", ["_num_layers", "NumLayers", "9lives"])
def test_field_names_must_be_lower_snake_case(name):
    namespace = {"__annotations__": {name: int}, name: 1}
    with pytest.raises(config_lib.InvalidConfigNameError, match=name):
        config_class(type("Bad", (config_lib.ConfigBase,), namespace))
    config_lib.validate_config_field_name("num_layers_2")  # A valid name passes.


def test_unannotated_class_attribute_raises_non_config_field_error():
    with pytest.raises(config_lib.NonConfigFieldError, match="foo"):

        @config_class
        class Bad(config_lib.ConfigBase):  # pylint: disable=unused-variable
            foo = 10

    @config_class
    class WithMethod(config_lib.ConfigBase):
        x: int = 1

        def doubled(self) -> int:  # Methods are not fields, and are allowed.
            return 2 * self.x

    assert WithMethod().doubled() == 2


class _Opaque:
    """A value no validator accepts."""


def test_a_value_no_validator_accepts_is_refused_on_assignment():
    cfg = Tree.default_config()
    with pytest.raises(config_lib.InvalidConfigValueError, match="_Opaque"):
        cfg.rules = _Opaque()


@pytest.mark.parametrize(
    "value, key",
    [([1, _Opaque()], "rules[1]"), ({"k": (_Opaque(),)}, "rules['k'][0]"), ({_Opaque()}, "rules[")],
)
def test_container_items_are_checked_when_the_config_is_written_as_text(value, key):
    # AXLearn accepts a container whatever its items; they are checked, by path, where the
    # config becomes text (debug_string, which the launcher writes before it builds).
    cfg = Tree.default_config().set(name="t")
    cfg.rules = value  # Accepted (a copy, as every assigned container).
    assert type(cfg.rules) is type(value) and len(cfg.rules) == len(value)
    with pytest.raises(config_lib.InvalidConfigValueError, match=r"_Opaque") as error:
        cfg.debug_string()
    assert str(error.value).startswith(f"{key}")


def test_a_default_no_validator_accepts_is_refused_when_a_config_is_constructed():
    @config_class
    class BadDefault(config_lib.ConfigBase):
        rules: object = _Opaque()

    with pytest.raises(config_lib.InvalidConfigValueError, match="BadDefault.rules"):
        BadDefault()


def test_a_validator_registered_after_the_class_admits_its_default():
    class Budget:
        value = 0

    @config_class
    class WithBudget(config_lib.ConfigBase):
        budget: object = Budget()

    with pytest.raises(config_lib.InvalidConfigValueError, match="WithBudget.budget"):
        WithBudget()

    def check(budget):
        if budget.value <= 0:
            raise config_lib.InvalidConfigValueError("budget must be positive")

    config_lib.register_validator(match_fn=lambda v: isinstance(v, Budget), validate_fn=check)
    with pytest.raises(config_lib.InvalidConfigValueError, match="budget must be positive"):
        WithBudget()
    Budget.value = 1
    assert isinstance(WithBudget().budget, Budget)


def test_register_validator_admits_a_new_value_type():
    class Token:
        def __init__(self, text):
            self.text = text

    def check(token):
        if not token.text:
            raise config_lib.InvalidConfigValueError("empty token")

    cfg = Tree.default_config()
    with pytest.raises(config_lib.InvalidConfigValueError, match="register_validator"):
        cfg.rules = Token("a")
    config_lib.register_validator(match_fn=lambda v: isinstance(v, Token), validate_fn=check)
    cfg.rules = [Token("a")]
    assert cfg.rules[0].text == "a"
    cfg.rules = {"k": Token("")}  # An item: checked when written as text.
    with pytest.raises(config_lib.InvalidConfigValueError, match=r"rules\['k'\]: empty token"):
        cfg.debug_string()


def test_a_subclass_may_catch_the_key_error_of_an_unknown_field():
    # AXLearn's ConfigBase.__getattr__ raises KeyError; ours raises an UnknownFieldError
    # that is also one.
    @config_class
    class Lenient(config_lib.ConfigBase):
        a: int = 1

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except KeyError:
                return "default"

    assert Lenient().b == "default"
    with pytest.raises(UnknownFieldError, match="has no field 'x'") as error:
        _ = Tree.default_config().x
    assert isinstance(error.value, KeyError) and str(error.value).startswith("Tree.Config")


def test_config_for_function_refuses_a_parameter_named_fn_or_underscore():
    def takes_fn(fn, x=1):
        return fn(x)

    with pytest.raises(ConfigError, match="takes_fn should not have a 'fn' parameter"):
        config_for_function(takes_fn)
    with pytest.raises(ConfigError, match="should not have a '_' parameter"):
        config_for_function(lambda _: 1)


def test_a_positional_only_parameter_is_refused_at_instantiate():
    def power(base, exp, /, mod=None):
        return pow(base, exp, mod)

    for fn in (power, math.pow):
        cfg = config_for_function(fn).set(**{name: 2 for name in ("base", "exp", "x", "y")
                                             if name in config_for_function(fn)})
        with pytest.raises(config_lib.UnsupportedParameterError, match="POSITIONAL_ONLY") as e:
            cfg.instantiate()
        assert isinstance(e.value, NotImplementedError)


def test_required_field_missing_error_on_instantiate():
    with pytest.raises(config_lib.RequiredFieldMissingError, match="a"):
        config_for_function(scaled_sum).instantiate()


def test_unknown_field_error_is_an_attribute_error_naming_close_names():
    cfg = config_for_function(scaled_sum)
    with pytest.raises(AttributeError, match="did you mean: scale"):
        cfg.scal = 1.0
    with pytest.raises(UnknownFieldError):
        _ = cfg.scael
    assert not hasattr(cfg, "scael")


def test_similar_names_follows_axlearns_trigram_rule():
    # 'num_layer' has 7 trigrams; 'num_layers' holds all 7, 'num_heads' 2 ('num', 'um_').
    assert config_lib.similar_names("num_layer", ["hidden_dim", "num_layers", "num_heads"]) == [
        "num_layers"
    ]
    # Equal overlap breaks ties alphabetically; names shorter than 3 match nothing.
    assert config_lib.similar_names("abcd", ["xabcdx", "abcd"]) == ["abcd", "xabcdx"]
    assert config_lib.similar_names("ab", ["ab", "abc"]) == []


class _AttrsAttribute:
    def __init__(self, name, default):
        self.name, self.default = name, default


class _AttrsLike:
    """What attrs generates: `__attrs_attrs__`, one Attribute (name, default) per field."""

    __attrs_attrs__ = (_AttrsAttribute("rate", 0.5), _AttrsAttribute("label", None))

    def __init__(self, rate=0.5, label=None):
        self.rate, self.label = rate, label


def test_is_named_tuple_and_is_attrs_work_without_attrs_installed():
    import collections  # pylint: disable=import-outside-toplevel

    pair = collections.namedtuple("Pair", ["a", "b"])
    assert config_lib.is_named_tuple(pair(1, 2))
    assert not config_lib.is_named_tuple((1, 2))
    assert config_lib.is_attrs(_AttrsLike())
    assert not config_lib.is_attrs(Point(1))


def test_real_attrs_instances_are_attrs():
    attr = pytest.importorskip("attr")

    @attr.define
    class Foo:
        a: int
        b: str

    assert config_lib.is_attrs(Foo(a=1, b="x"))


@config_class
class _Ordered(config_lib.ConfigBase):
    num_layers: int = 10
    hidden_dim: int = 16
    activation: str = "relu"


def test_keys_and_items_are_sorted_while_fields_keep_declaration_order():
    cfg = _Ordered()
    assert len(cfg) == 3
    assert cfg.keys() == ["activation", "hidden_dim", "num_layers"]
    assert cfg.items() == [("activation", "relu"), ("hidden_dim", 16), ("num_layers", 10)]
    assert list(cfg.fields()) == ["num_layers", "hidden_dim", "activation"]
    assert cfg.debug_string() == "activation: 'relu'\nhidden_dim: 16\nnum_layers: 10"


def test_len_of_an_empty_and_of_an_inherited_config():
    @config_class
    class Empty(config_lib.ConfigBase):
        pass

    @config_class
    class More(_Ordered):
        dropout: float = 0.0

    assert len(Empty()) == 0 and Empty().keys() == [] and "x" not in Empty()
    assert len(More()) == 4 and "dropout" in More()


@config_class
class _Holder(config_lib.ConfigBase):
    sub: object = None


def test_debug_string_of_non_config_values_matches_axlearns():
    import collections  # pylint: disable=import-outside-toplevel
    import dataclasses  # pylint: disable=import-outside-toplevel

    import numpy as np  # pylint: disable=import-outside-toplevel

    @dataclasses.dataclass
    class DataClass:
        int_val: int
        str_val: str
        type_val: object

    ntuple = collections.namedtuple("ntuple", ("none", "int", "str", "type"))
    listed = ["sub[0]: None", "sub[1]: 123", "sub[2]: 'str'", "sub[3]: 'numpy.float64'"]
    keyed = [
        "sub['none']: None",
        "sub['int']: 123",
        "sub['str']: 'str'",
        "sub['type']: 'numpy.float64'",
    ]
    cases = [
        ([None, 123, "str", np.float64], listed),
        ((None, 123, "str", np.float64), listed),
        (dict(none=None, int=123, str="str", type=np.float64), keyed),
        (ntuple(none=None, int=123, str="str", type=np.float64), keyed),
        (
            DataClass(int_val=123, str_val="str", type_val=np.float64),
            ["sub['int_val']: 123", "sub['str_val']: 'str'", "sub['type_val']: 'numpy.float64'"],
        ),
        (DataClass, [f"sub: '{__name__}.{DataClass.__qualname__}'"]),
    ]
    cfg = _Holder()
    for value, lines in cases:
        cfg.sub = value
        assert cfg.debug_string() == "\n".join(lines), value


def test_dataclass_and_attrs_fields_at_omitted_defaults_are_left_out_of_dumps():
    import dataclasses  # pylint: disable=import-outside-toplevel

    @dataclasses.dataclass
    class Spec:
        size: int
        note: Optional[str] = None

    cfg = _Holder(sub=Spec(size=3))
    assert cfg.debug_string() == "sub['size']: 3"
    cfg.sub = Spec(size=3, note="x")
    assert cfg.debug_string() == "sub['size']: 3\nsub['note']: 'x'"
    cfg.sub = _AttrsLike(rate=0.25)
    assert cfg.debug_string() == "sub['rate']: 0.25"


def test_to_dict_keeps_values_and_names_types_as_axlearn_does():
    import collections  # pylint: disable=import-outside-toplevel
    import dataclasses  # pylint: disable=import-outside-toplevel

    @dataclasses.dataclass
    class Spec:
        size: int

    pair = collections.namedtuple("Pair", ["a", "b"])
    counts = collections.defaultdict(int, {"x": 1})
    cfg = _Holder(
        sub={
            "none": None,
            "str": "text",
            "required": REQUIRED,
            "tuple": (1, Point),
            "range": range(3),
            "spec": Spec(size=2),
            "pair": pair(1, [2]),
            "attrs": _AttrsLike(label="l"),
            "counts": counts,
            "fn": scaled_sum,
            "config": config_for_function(scaled_sum).set(a=1),
        }
    )
    got = cfg.to_dict()["sub"]
    assert got["none"] is None and got["str"] == "text" and got["required"] is REQUIRED
    assert got["tuple"] == (1, f"{__name__}.Point") and isinstance(got["tuple"], tuple)
    assert got["range"] == [0, 1, 2]
    assert got["spec"] == {"size": 2} and got["pair"] == {"a": 1, "b": [2]}
    assert got["attrs"] == {"rate": 0.5, "label": "l"}
    assert got["counts"] == {"x": 1} and type(got["counts"]) is dict
    assert got["fn"] == f"{__name__}.scaled_sum"
    assert got["config"] == {"fn": f"{__name__}.scaled_sum", "a": 1, "b": 2.0, "scale": 1.0}
    json.loads(cfg.to_json())  # The JSON form stays JSON.


def test_freeze_makes_a_config_and_its_children_read_only():
    cfg = Tree.default_config().set(name="root", leaves=[Tree.default_config().set(name="c")])
    assert cfg.freeze() is cfg and cfg.is_frozen
    with pytest.raises(config_lib.FrozenConfigError, match="'name'"):
        cfg.name = "other"
    with pytest.raises(config_lib.FrozenConfigError):
        cfg.leaves[0].name = "other"
    with pytest.raises(config_lib.FrozenConfigError):
        cfg.leaf.dim = 3
    with pytest.raises(config_lib.FrozenConfigError):
        cfg.set(name="other")
    assert cfg.name == "root"
    # Copies are the user's own to edit.
    assert cfg.clone(name="copy").name == "copy"
    import copy  # pylint: disable=import-outside-toplevel

    copied = copy.deepcopy(cfg)
    copied.leaves[0].name = "edited"
    assert not copied.is_frozen and cfg.leaves[0].name == "c"


def test_get_and_set_recursively_methods_walk_fields_indices_and_keys():
    cfg = Tree.default_config().set(
        name="root",
        leaves=[Tree.default_config().set(name="c0")],
        rules={"policy": config_for_function(optional_args).set(x=1.0)},
    )
    assert cfg.get_recursively([]) is cfg
    assert cfg.get_recursively(["leaves", 0, "name"]) == "c0"
    assert cfg.get_recursively(["rules", "policy", "x"]) == 1.0
    cfg.set_recursively(["leaves", 0, "name"], value="renamed")
    cfg.set_recursively("rules['policy'].x", value=2.0)
    assert cfg.leaves[0].name == "renamed" and cfg.rules["policy"].x == 2.0
    with pytest.raises(AttributeError, match="did you mean: name"):
        cfg.get_recursively(["leaves", 0, "nam"])
    with pytest.raises(KeyError):
        cfg.get_recursively(["rules", "polcy"])
    with pytest.raises(ValueError):
        cfg.set_recursively([], value=1)


class _UncopyableProxy:
    """Stands for a wrapt.ObjectProxy around a function: callable, but not copyable."""

    def __init__(self, fn):
        self.__wrapped__ = fn  # Like wrapt, forwards the name and the signature.
        self.__name__, self.__qualname__ = fn.__name__, fn.__qualname__
        self.__signature__ = __import__("inspect").signature(fn)

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)

    def __deepcopy__(self, memo):
        raise NotImplementedError("proxies cannot be copied")


def test_copies_of_function_and_class_configs_share_a_proxy_fn_or_klass():
    import copy  # pylint: disable=import-outside-toplevel

    proxy = _UncopyableProxy(scaled_sum)
    with pytest.raises(NotImplementedError):
        copy.deepcopy(proxy)
    cfg = config_for_function(proxy)
    clone = cfg.clone(a=1)
    assert clone.fn is proxy and clone.instantiate() == 3.0
    assert copy.deepcopy(cfg).fn is proxy
    class_cfg = config_for_class(Point).set(x=1)
    class_cfg.klass = _UncopyableProxy(Point)
    assert copy.deepcopy(class_cfg).klass is class_cfg.klass


def test_config_modifier_base_returns_the_config_and_is_the_one_modifiers_subclass():
    from axlearn.common import trainer_config_modifier  # pylint: disable=import-outside-toplevel

    cfg = Tree.default_config().set(name="x")
    assert config_lib.ConfigModifier.default_config().instantiate()(cfg) is cfg
    assert trainer_config_modifier.ConfigModifier is config_lib.ConfigModifier


def test_with_overrides_sets_fields_on_each_built_config():
    built = config_lib.with_overrides(
        lambda: Tree.default_config().set(name="base"), name="over"
    )
    first, second = built(), built()
    assert first.name == second.name == "over" and first is not second


def _write_experiment(root, body: str) -> None:
    package = root / "myroot" / "experiments"
    package.mkdir(parents=True)
    (root / "myroot" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(body)


def test_get_named_trainer_config_imports_the_module_when_called(tmp_path, monkeypatch):
    _write_experiment(
        tmp_path,
        "def named_trainer_configs():\n"
        "    return {'small_model': lambda: 'small', 'large_model': lambda: 'large'}\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "myroot.experiments.mod" not in sys.modules
    fn = config_lib.get_named_trainer_config(
        "small_model", config_module="mod", root_module="myroot"
    )
    assert fn() == "small" and "myroot.experiments.mod" in sys.modules
    with pytest.raises(KeyError, match=r"did you mean \[large_model, small_model\]") as e:
        config_lib.get_named_trainer_config("model", config_module="mod", root_module="myroot")
    assert isinstance(e.value, ConfigError)
    for name in list(sys.modules):
        if name.startswith("myroot"):
            monkeypatch.delitem(sys.modules, name)


def test_get_named_trainer_config_finds_this_repositorys_experiments():
    fn = config_lib.get_named_trainer_config("golf_baseline", config_module="golf")
    assert callable(fn)
    with pytest.raises(KeyError, match="defines golf_baseline"):
        config_lib.get_named_trainer_config("zzz", config_module="golf")


def test_config_for_partial_function_binds_arguments_and_dumps_as_axlearns():
    import functools  # pylint: disable=import-outside-toplevel

    cfg = config_lib.config_for_partial_function(scaled_sum, 1, scale=3.0)
    fn = cfg.instantiate()
    assert isinstance(fn, functools.partial) and fn(b=1.0) == (1 + 1.0) * 3.0
    cfg.kwargs = {"scale": 2.0, "b": 4.0}
    assert cfg.instantiate()() == (1 + 4.0) * 2.0
    assert cfg.debug_string().splitlines() == [
        f"args[0]: '{__name__}.scaled_sum'",
        "args[1]: 1",
        "klass: 'functools.partial'",
        "kwargs['scale']: 2.0",
        "kwargs['b']: 4.0",
    ]


def test_config_for_class_of_functools_partial_is_the_partial_function_config():
    cfg = config_for_class(__import__("functools").partial).set(args=(pow,), kwargs={"exp": 2})
    assert isinstance(cfg, config_lib.PartialFunctionConfig) and cfg.instantiate()(3) == 9


@pytest.mark.parametrize(
    "annotation,words",
    [
        (Required[int], "an int"),
        (Optional[float], "a number or None"),
        (Required[Optional[str]], "a string or None"),
        (bool, "True or False"),
        (Sequence[str], "a list of a string"),
        (Union[str, Sequence[str]], "a string or a list of a string"),
    ],
)
def test_a_field_type_is_described_in_a_user_s_words(annotation, words):
    assert describe_annotation(annotation) == words


# ----- AXLearn's config core: field types, redefinition, non-config fields -----


def _typed(w: int, x: "str", y: Union[int, str], z: Required[float], u):
    return (w, x, y, z, u)


def test_config_for_function_records_each_parameter_s_type():
    types_ = {name: field.type for name, field in config_for_function(_typed).fields().items()}
    del types_["fn"]
    assert types_ == {"w": int, "x": str, "y": Union[int, str], "z": Required[float], "u": Any}


def test_an_unresolvable_annotation_keeps_the_other_parameters_types():
    def fn(a: int, b: "NoSuchType" = None):  # noqa: F821 -- the forward reference is the point.
        return a, b

    fields = config_for_function(fn).fields()
    assert fields["a"].type is int and fields["b"].type == "NoSuchType"


def test_config_for_class_records_each_constructor_parameter_s_type():
    fields = config_for_class(Point).fields()
    assert (fields["x"].type, fields["y"].type) == (int, int) and "self" not in fields


def test_fn_and_klass_fields_are_typed_as_a_callable_and_a_class():
    assert typing.get_origin(config_for_function(_typed).fields()["fn"].type).__name__ == "Callable"
    assert typing.get_origin(config_for_class(Point).fields()["klass"].type) is type


@config_class
class _Scaled(config_lib.ConfigBase):
    scale: int = 1  # Redefined below.
    name: str = "a"


def test_a_redefined_field_takes_the_subclass_s_type_and_default():
    @config_class
    class Rescaled(_Scaled):
        scale: float = 0.1

    assert (Rescaled().fields()["scale"].type, Rescaled().scale) == (float, 0.1)
    assert (_Scaled().fields()["scale"].type, _Scaled().scale) == (int, 1)
    assert Rescaled().name == "a"


def test_redefining_an_inherited_field_as_a_method_raises_non_config_field_error():
    with pytest.raises(config_lib.NonConfigFieldError, match="scale redefines an inherited"):

        @config_class
        class Bad(_Scaled):  # pylint: disable=unused-variable
            def scale(self):
                return 2


def test_redefining_an_inherited_field_as_a_class_var_raises_non_config_field_error():
    with pytest.raises(config_lib.NonConfigFieldError, match="scale redefines an inherited"):

        @config_class
        class Bad(_Scaled):  # pylint: disable=unused-variable
            scale: ClassVar[int] = 2


def _elsewhere(self):
    return self


def test_a_function_assigned_in_the_class_body_raises_non_config_field_error():
    with pytest.raises(config_lib.NonConfigFieldError, match="helper"):

        @config_class
        class Bad(config_lib.ConfigBase):  # pylint: disable=unused-variable
            helper = _elsewhere


def test_a_lambda_assigned_in_the_class_body_raises_non_config_field_error():
    with pytest.raises(config_lib.NonConfigFieldError, match="helper"):

        @config_class
        class Bad(config_lib.ConfigBase):  # pylint: disable=unused-variable
            helper = lambda self: self  # noqa: E731 -- the assignment is what is refused.


def test_overriding_an_inherited_method_is_allowed():
    @config_class
    class WithSet(config_lib.ConfigBase):
        x: int = 1

        def set(self, **kwargs):
            return super().set(**{k: v * 10 for k, v in kwargs.items()})

    assert WithSet().set(x=2).x == 20


def test_an_attribute_set_on_the_class_after_decoration_raises_on_construction():
    @config_class
    class Late(config_lib.ConfigBase):
        x: int = 1

    Late()
    Late.other_field = 1
    with pytest.raises(config_lib.NonConfigFieldError, match="Late.other_field"):
        Late()


def test_a_field_default_set_on_the_class_after_decoration_raises_on_construction():
    @config_class
    class Late(config_lib.ConfigBase):
        x: int = 1

    Late.x = 5  # Would not change the default: the class attribute is not the field.
    with pytest.raises(config_lib.NonConfigFieldError, match="Late.x"):
        Late()


# ----- AXLearn's config core: dataclass fields that skip serialization -----


@dataclasses.dataclass
class _WithCache:
    name: str
    cache: dict = dataclasses.field(
        default_factory=dict, metadata={"skip_serialization": True}
    )
    size: int = 42


@config_class
class _HoldsRecord(config_lib.ConfigBase):
    data: object = _WithCache(name="x")


def test_a_field_marked_skip_serialization_is_left_out_of_debug_string():
    cfg = _HoldsRecord(data=_WithCache(name="y", cache={"k": 1}, size=7))
    assert cfg.debug_string().splitlines() == ["data['name']: 'y'", "data['size']: 7"]


def test_a_field_marked_skip_serialization_is_left_out_even_where_defaults_are_kept():
    flat = _HoldsRecord().to_flat_dict(omit_default_values=())
    assert flat == {"data['name']": "x", "data['size']": 42}


# ----- AXLearn's config core: values given at instantiate() -----


def test_a_required_function_field_may_be_given_at_instantiate():
    assert config_for_function(scaled_sum).instantiate(a=3) == (3 + 2.0) * 1.0


def test_instantiate_kwargs_take_precedence_over_function_fields():
    assert config_for_function(scaled_sum).set(a=1, b=1.0).instantiate(b=5.0) == 6.0


def test_a_required_class_field_may_be_given_at_instantiate():
    point = config_for_class(Point).set(y=2).instantiate(x=np.asarray([0, 1]))
    np.testing.assert_array_equal(point.x, [0, 1])
    assert point.y == 2


def test_a_required_field_given_neither_in_the_config_nor_at_instantiate_is_missing():
    with pytest.raises(MissingRequiredFieldsError, match=r"fields of ClassConfig\[Point\]: x"):
        config_for_class(Point).instantiate(y=1)


def test_the_star_args_field_may_be_given_at_instantiate():
    def gather(*items):
        return list(items)

    assert config_for_function(gather).set(items=[1]).instantiate(items=[2, 3]) == [2, 3]


def _keywords(a=0, **options):
    return dict(a=a, **options)


def test_the_star_star_kwargs_parameter_is_a_dict_field_passed_as_keywords():
    cfg = config_for_function(_keywords).set(options={"b": 2, "c": 3})
    assert cfg.instantiate() == {"a": 0, "b": 2, "c": 3}


def test_instantiate_kwargs_take_precedence_over_the_star_star_kwargs_field():
    cfg = config_for_function(_keywords).set(options={"b": 2, "c": 3})
    assert cfg.instantiate(b=5) == {"a": 0, "b": 5, "c": 3}


def test_an_unset_star_star_kwargs_field_is_left_out_of_debug_string():
    cfg = config_for_function(_keywords)
    assert cfg.options is None and "options" not in cfg.debug_string()


def test_a_field_marked_skip_serialization_stays_in_to_dict():
    cfg = _HoldsRecord(data=_WithCache(name="y", cache={"k": 1}))
    assert cfg.to_dict() == {"data": {"name": "y", "cache": {"k": 1}, "size": 42}}
