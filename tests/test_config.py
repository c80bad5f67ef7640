"""Specification of axlearn.common.config."""

import json
import subprocess
import sys
from typing import Optional

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
    get_recursively,
    maybe_instantiate,
    maybe_set_config,
    set_recursively,
)
from axlearn.common.golden_text import parse_flat_text


def scaled_sum(a: int, b: float = 2.0, *, scale: float = 1.0) -> float:
    return (a + b) * scale


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
    assert cfg.keys() == ["fn", "a", "b", "scale"]
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
    with pytest.raises(ConfigError, match=r"leaf.eps: expected float, got 'big' \(str\)"):
        apply_overrides(cfg, ["leaf.eps='big'"])
    with pytest.raises(UnknownFieldError, match="did you mean: eps"):
        apply_overrides(cfg, ["leaf.epsilon=1.0"])
    with pytest.raises(ConfigError, match="not of the form"):
        apply_overrides(cfg, ["leaf.eps"])


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
    # A name the package does not expose keeps its private path, which still imports.
    name = config_lib.qualified_name(_base._AcquireFutures)  # pylint: disable=protected-access
    assert name == "concurrent.futures._base._AcquireFutures"
    assert config_lib.import_name(name) is _base._AcquireFutures  # pylint: disable=protected-access
    # A private name of a public module is left as it is.
    assert config_lib.qualified_name(_private_helper) == "tests.test_config._private_helper"
    # The public name round-trips through golden text.
    text = config_for_class(concurrent.futures.Future).debug_string()
    assert text == "klass: 'concurrent.futures.Future'"
    assert parse_flat_text(text).klass is concurrent.futures.Future


def _private_helper():
    pass


def test_importing_config_does_not_import_jax():
    code = "import sys, axlearn.common.config; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_field_without_default_is_rejected():
    with pytest.raises(ConfigError, match="has no default"):

        @config_class
        class Bad(config_lib.ConfigBase):  # pylint: disable=unused-variable
            x: int


def test_dict_entries_keep_insertion_order_and_fields_sort_by_name():
    """A remat spec written as {'prevent_cse': ..., 'policy': ...} reads in that order."""
    cfg = Tree.default_config().set(
        name="x", rules={"prevent_cse": False, "policy": config_for_function(optional_args).set(x=1.0)}
    )
    keys = list(cfg.to_flat_dict())
    assert keys.index("rules['prevent_cse']") < keys.index("rules['policy'].fn")
    top_level = [k.split(".")[0].split("[")[0] for k in keys]
    assert top_level == sorted(top_level)
