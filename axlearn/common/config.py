"""Typed, composable configs that flatten into golden text.

A config is a tree of typed fields. Classes expose their config through
`Configurable.default_config()`, whose `klass` field names the class; plain functions and
classes get one from `config_for_function` / `config_for_class`, whose `fn` / `klass`
field names the callable. `cfg.instantiate()` turns a config into the object it describes.

The flat text form (`debug_string()`) is one `key: value` line per leaf, config fields
sorted by name, dict entries in insertion order, sequence items in index order:
`a.b` for nested configs, `[i]` for sequence items and `['k']` for dict keys (and for
the fields of dataclass, attrs and named-tuple values), with classes, functions and
dtypes written as quoted, fully qualified names.
`axlearn.common.golden_text.parse_flat_text` reads that text back into a config tree.
Names read from text or overrides resolve only to what was declared configurable
(`import_name`, `register_configurable`).

The API is AXLearn's: the same names (`config_class`, `REQUIRED`, `register_validator`,
`get_named_trainer_config`, ...) with the same behaviour and error classes, each of
which is also a `ConfigError`. Field values are validated on assignment by the
registered validators; field names must be lower_snake_case. As in AXLearn:
- a container value (list, tuple, set, dict, dataclass, attrs, Hugging Face config) is
  accepted on assignment whatever its items; here every leaf is also checked, by its flat
  key, when the config is written as text (`to_flat_dict`, `debug_string`: the launcher
  writes it before it instantiates anything), so that no unreadable value reaches a
  golden or a run's config.txt;
- a class's defaults are validated when a config is constructed, not when the class is
  declared (a validator registered in between admits them);
- a field annotated without a value (`dim: int`) has no default: the constructor must be
  given it (`Cfg(dim=16)`; MissingFieldArgumentError, also a TypeError, names it);
- reading an unknown field raises an UnknownFieldError that is also a KeyError (what
  AXLearn's `__getattr__` raises, which a subclass overriding it may catch);
- `config_for_function` refuses a function with a parameter named `fn` or `_`, and
  instantiating a function or class config whose target has a positional-only
  parameter raises UnsupportedParameterError (also a NotImplementedError);
- `config_for_function` / `config_for_class` record each parameter's type
  (`cfg.fields()[name].type`), keep `*args` as a sequence field and `**kwargs` as a dict
  field, and take values at `instantiate(**kwargs)`, which supply REQUIRED fields and win
  over the config's;
- a subclass redefines an inherited field by annotating it again (type and default);
- a class attribute without an annotation (a value, a function not defined in the class
  body, an inherited field's name as a method) raises NonConfigFieldError, and so does
  constructing a config whose class got an attribute after @config_class;
- a dataclass value's field marked `metadata={"skip_serialization": True}` is left out of
  `to_flat_dict` and `debug_string` (`to_dict` keeps it, as AXLearn's does).

This module is pure Python: importing it must not import jax.
"""

import ast
import collections
import copy
import dataclasses
import difflib
import enum
import functools
import importlib
import inspect
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Generic, Optional, TypeVar, Union

T = TypeVar("T")
C = TypeVar("C", bound="ConfigBase")


class ConfigError(ValueError):
    """A config is malformed: an unknown field, a missing value or a value of the wrong type.

    Every error below is a ConfigError and also the built-in exception AXLearn raises in
    the same place (an AttributeError for an unknown field, a TypeError for a value of the
    wrong type, ...), so that code written against either catches it.
    """


class UnknownFieldError(ConfigError, AttributeError):
    """A field name that the config class does not define."""


class UnknownKeyError(ConfigError, KeyError):
    """A dict key, or a named trainer config, that does not exist."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # Not KeyError's quoted repr.


class MissingConfigClassDecoratorError(ConfigError, TypeError):
    """A ConfigBase subclass was instantiated without being declared with @config_class."""


class InvalidConfigClassError(ConfigError, TypeError):
    """@config_class was applied to a class that is not a ConfigBase."""


class InvalidConfigNameError(ConfigError):
    """A field name that is not lower_snake_case (`^[a-z][a-z0-9_]*$`)."""


class InvalidConfigValueError(ConfigError, TypeError):
    """A field value of a type no registered validator accepts, or of the wrong type."""


class NonConfigFieldError(ConfigError):
    """A config class attribute without a type annotation (so it would not be a field)."""


class RequiredFieldMissingError(ConfigError):
    """A field still set to REQUIRED where a value is needed."""


class MissingFieldArgumentError(RequiredFieldMissingError, TypeError):
    """A config was constructed without a value for a field that has no default (attrs'
    TypeError in AXLearn)."""


class UnsupportedParameterError(ConfigError, NotImplementedError):
    """A function or class config cannot pass a parameter of this kind (positional-only)."""


class _UnknownFieldLookupError(UnknownFieldError, KeyError):
    """Reading a field the config class does not define: an UnknownFieldError, and also the
    KeyError that AXLearn's `ConfigBase.__getattr__` raises, which a subclass overriding
    `__getattr__` may catch."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # Not KeyError's quoted repr.


class MissingRequiredFieldsError(RequiredFieldMissingError):
    """`instantiate()` found fields still set to REQUIRED (all listed by path)."""


class FrozenConfigError(ConfigError, RuntimeError):
    """A field of a frozen config (see `ConfigBase.freeze`) was set."""


def is_named_tuple(x: Any) -> bool:
    """Whether `x` is an instance of a `collections.namedtuple` / `typing.NamedTuple`."""
    return isinstance(x, tuple) and hasattr(x, "_fields") and hasattr(x, "_asdict")


def is_attrs(x: Any) -> bool:
    """Whether `x` is an instance (or class) of an attrs class; works without attrs."""
    return hasattr(x, "__attrs_attrs__")


def _attrs_asdict(x: Any) -> dict[str, Any]:
    """The fields of attrs instance `x` by name, not recursing (attrs itself not needed)."""
    return {a.name: getattr(x, a.name) for a in x.__attrs_attrs__}


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def similar_names(name: str, candidates: Iterable[str]) -> list[str]:
    """The candidates sharing more than half of `name`'s 3-character substrings, most
    similar first (ties alphabetically): AXLearn's "did you mean" rule."""
    grams = [name[i : i + 3] for i in range(len(name) - 2)]

    def overlap(candidate: str) -> float:
        return sum(g in candidate for g in grams) / max(len(grams), 1)

    scored = [(overlap(c), c) for c in candidates]
    return [c for score, c in sorted(scored, key=lambda p: (-p[0], p[1])) if score > 0.5]


class RequiredFieldValue:
    """The type of `REQUIRED`: a placeholder for a value the user must provide."""

    _instance: ClassVar[Optional["RequiredFieldValue"]] = None

    def __new__(cls) -> "RequiredFieldValue":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REQUIRED"

    def __bool__(self) -> bool:
        return False

    def __deepcopy__(self, memo) -> "RequiredFieldValue":
        return self

    def __copy__(self) -> "RequiredFieldValue":
        return self

    def __reduce__(self):
        return (RequiredFieldValue, ())


REQUIRED = RequiredFieldValue()
# `Required[int]` reads as "an int the user must set"; the field's default is `REQUIRED`.
Required = Union[T, RequiredFieldValue]

# Values that `to_flat_dict` omits when they equal the field's default.
DEFAULT_OMITTED_VALUES = (None, REQUIRED)


class _NoDefault:
    """The `ConfigField.default` of a field declared without a value (`dim: int`)."""

    def __repr__(self) -> str:
        return "NO_DEFAULT"


# A field with this default must be given to the config's constructor (`Cfg(dim=16)`).
NO_DEFAULT = _NoDefault()


@dataclasses.dataclass(frozen=True)
class ConfigField:
    """One field of a config class."""

    name: str
    annotation: Any
    default: Any

    @property
    def type(self) -> Any:
        """The annotation, under the name AXLearn's (attrs') fields give it."""
        return self.annotation


def close_names(
    name: str, candidates: Iterable[str], *, n: int = 3, cutoff: float = 0.5
) -> list[str]:
    """Up to `n` candidates close to a mistyped `name`, closest first (difflib's ratio of
    at least `cutoff`): the "did you mean" of every error naming a field, key or config."""
    return difflib.get_close_matches(name, list(candidates), n=n, cutoff=cutoff)


def _close_names(name: str, candidates: Iterable[str]) -> str:
    matches = close_names(name, candidates)
    return f" (did you mean: {', '.join(matches)}?)" if matches else ""


def _copy_value(value: Any) -> Any:
    """Value semantics: configs and containers are copied when assigned."""
    if isinstance(value, (ConfigBase, list, dict, tuple, set)):
        return copy.deepcopy(value)
    return value


# ----- field names and values -----

# (match_fn, validate_fn) pairs in registration order; see `register_validator`.
_config_field_validators: list[tuple[Callable[[Any], bool], Callable[[Any], None]]] = []


def register_validator(
    *, match_fn: Callable[[Any], bool], validate_fn: Callable[[Any], None]
) -> None:
    """Registers a validator of config field values: every value for which `match_fn`
    returns True is passed to `validate_fn`, which raises InvalidConfigValueError if the
    value is not a valid field value. A value that no `match_fn` matches is invalid."""
    _config_field_validators.append((match_fn, validate_fn))


def validate_config_field_name(name: str) -> None:
    """Raises InvalidConfigNameError unless `name` is lower_snake_case."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise InvalidConfigNameError(
            f'Invalid config field name "{name}": use lower_snake_case ([a-z][a-z0-9_]*)'
        )


def validate_config_field_value(value: Any) -> None:
    """Runs every registered validator whose `match_fn` matches `value` (in registration
    order); raises InvalidConfigValueError if none matches."""
    matched = False
    for match_fn, validate_fn in _config_field_validators:
        if match_fn(value):
            matched = True
            validate_fn(value)
    if not matched:
        raise InvalidConfigValueError(
            f"Invalid config value type {type(value).__qualname__} for value {value!r}; "
            f"register a validator for it with `{register_validator.__name__}`"
        )


def _is_basic_value(value: Any) -> bool:
    """Values AXLearn accepts as they are (plain data, classes, functions, enums, dtypes),
    plus configs and, deliberately beyond AXLearn, what golden text here names or writes:
    any callable object (functools.partial, jax's remat policies), numpy scalars and
    dtypes, jax PartitionSpecs, ranges and values read from foreign golden text."""
    return (
        value is None
        or isinstance(
            value,
            (RequiredFieldValue, ConfigBase, type, bool, int, float, complex, str, bytes, range),
        )
        or isinstance(value, enum.Enum)
        or callable(value)
        or _is_dtype_instance(value)
        or type(value).__module__ == "numpy"  # numpy scalars such as np.float32(1).
        or _is_partition_spec(value)
        # Unresolved, defined with the parser below, is not yet defined while this module's
        # own config classes validate their defaults.
        or isinstance(value, globals().get("Unresolved", ()))
    )


def _is_container(value: Any) -> bool:
    """Values whose items AXLearn leaves unchecked on assignment: sequences, sets, dicts,
    dataclass and attrs instances, Hugging Face configs."""
    return (
        isinstance(value, (list, tuple, set, frozenset, dict))
        or _is_dataclass_instance(value)
        or (not isinstance(value, type) and is_attrs(value))
        # Hugging Face configs (transformers.PretrainedConfig) hold plain data.
        or (not isinstance(value, (type, ConfigBase)) and hasattr(value, "from_pretrained"))
    )


def _container_items(value: Any) -> list[tuple[str, Any]]:
    """(flat key suffix, item) of each item of a container value (see `_is_container`)."""
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", item) for i, item in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return [(f"[{item!r}]", item) for item in value]
    if isinstance(value, dict):
        return [(f"[{k!r}]", item) for k, item in value.items()]
    if _is_dataclass_instance(value):
        return [(f"[{f.name!r}]", getattr(value, f.name)) for f in dataclasses.fields(value)]
    if is_attrs(value):
        return [(f"[{k!r}]", item) for k, item in _attrs_asdict(value).items()]
    return _container_items(value.to_dict())


def _check_text_value(path: str, value: Any) -> None:
    """Raises InvalidConfigValueError, naming `path`, for a value that no validator accepts
    at any depth of `value` (a container's items are checked here, when the config is
    written as text, not when they are assigned)."""
    if isinstance(value, ConfigBase):
        return
    try:
        validate_config_field_value(value)
    except InvalidConfigValueError as e:
        raise InvalidConfigValueError(f"{path}: {e}") from e
    if _is_container(value):
        for key, item in _container_items(value):
            _check_text_value(f"{path}{key}", item)


# As AXLearn's validators do, a container is accepted on assignment whatever its items
# (its list and dict validators build generators that nothing consumes): its items are
# checked, by path, when the config is written as text (`to_flat_dict`, `debug_string`,
# which the launcher writes before it instantiates anything).
register_validator(match_fn=_is_basic_value, validate_fn=lambda _: None)
register_validator(match_fn=_is_container, validate_fn=lambda _: None)


class ConfigBase:
    """Base of all config classes. Subclasses are declared with `@config_class`."""

    # Set by `config_class`: field name -> ConfigField, in declaration order.
    _fields: ClassVar[dict[str, ConfigField]] = {}

    def __init__(self, **kwargs):
        if "_fields" not in type(self).__dict__:
            raise MissingConfigClassDecoratorError(
                f"{type(self).__qualname__} was not decorated with @config_class"
            )
        _check_no_late_class_attributes(type(self))
        missing = []
        for field in self._fields.values():
            if field.name in kwargs:
                continue
            if field.default is NO_DEFAULT:
                missing.append(field.name)
                continue
            # Defaults are validated here, not at @config_class (AXLearn's point): a value
            # type whose validator is registered after the class is declared is accepted.
            try:
                validate_config_field_value(field.default)
            except InvalidConfigValueError as e:
                raise InvalidConfigValueError(f"{type(self).__qualname__}.{field.name}: {e}") from e
            object.__setattr__(self, field.name, _copy_value(field.default))
        if missing:
            raise MissingFieldArgumentError(
                f"{type(self).__qualname__}() needs a value for its field(s) without a default: "
                f"{', '.join(missing)} (e.g. {type(self).__qualname__}({missing[0]}=...))"
            )
        for key, value in kwargs.items():
            setattr(self, key, value)

    # ----- field access -----

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._fields:
            raise UnknownFieldError(
                f"{type(self).__qualname__} has no field '{name}'"
                f"{_close_names(name, self._fields)}"
            )
        if self.__dict__.get("_frozen", False):
            raise FrozenConfigError(
                f"{type(self).__qualname__} is frozen; cannot set '{name}' (clone() it to edit)"
            )
        validate_config_field_value(value)
        object.__setattr__(self, name, _copy_value(value))

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails, i.e. for names that are not fields.
        if name.startswith("__"):
            raise AttributeError(name)
        raise _UnknownFieldLookupError(
            f"{type(self).__qualname__} has no field '{name}'{_close_names(name, self._fields)}"
        )

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    def __len__(self) -> int:
        return len(self._fields)

    def keys(self) -> list[str]:
        """The field names, sorted (as AXLearn's, and as dumps list them)."""
        return sorted(self._fields)

    def items(self) -> list[tuple[str, Any]]:
        """(name, value) of every field, sorted by name."""
        return [(name, getattr(self, name)) for name in self.keys()]

    def fields(self) -> dict[str, ConfigField]:
        """Field name -> ConfigField, in declaration order (base classes' fields first)."""
        return dict(self._fields)

    def get_recursively(self, path: Union[str, Sequence[Any]]) -> Any:
        """The value at `path` below this config: a sequence of field names, list indices
        and dict keys (['model', 'decoder', 'dim']), or the same as text
        ('model.decoder.dim'); self for an empty path. Raises UnknownFieldError (an
        AttributeError) for a field the config does not have."""
        return get_recursively(self, path)

    def set_recursively(self, path: Union[str, Sequence[Any]], *, value: Any) -> None:
        """Sets the value at `path` (as in `get_recursively`, not empty)."""
        set_recursively(self, path, value)

    def freeze(self: C) -> C:
        """Makes this config and the configs nested in it read-only: setting a field then
        raises FrozenConfigError. Returns self. Copies (`clone()`, `copy.deepcopy`) are not
        frozen. Values inside a field (a list's items) are not guarded."""

        def enter(path: str, value: Any) -> bool:
            if isinstance(value, ConfigBase):
                object.__setattr__(value, "_frozen", True)
            return True

        _visit(self, "", lambda path, value: None, enter)
        return self

    @property
    def is_frozen(self) -> bool:
        """Whether `freeze()` made this config read-only."""
        return self.__dict__.get("_frozen", False)

    def set(self: C, **kwargs) -> C:
        """Sets fields by keyword and returns self, for chaining."""
        for key, value in kwargs.items():
            setattr(self, key, value)
        return self

    def clone(self: C, **kwargs) -> C:
        """Returns a deep copy with `kwargs` applied."""
        return copy.deepcopy(self).set(**kwargs)

    def __eq__(self, other: Any) -> bool:
        return type(self) is type(other) and all(
            getattr(self, name) == getattr(other, name) for name in self._fields
        )

    def __hash__(self):
        return id(self)

    def __deepcopy__(self, memo):
        result = object.__new__(type(self))
        memo[id(self)] = result
        kept = self._uncopied_field()
        for name in self._fields:
            value = getattr(self, name)
            if name != kept:
                value = copy.deepcopy(value, memo)
            object.__setattr__(result, name, value)
        return result

    def _uncopied_field(self) -> Optional[str]:
        """A field a copy shares instead of copying: the `fn` / `klass` that a function or
        class config calls, which may be a proxy object (wrapt) that cannot be copied."""
        return None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={_value_repr(v)}" for k, v in self.items())
        return f"{type(self).__qualname__}({fields})"

    # ----- traversal and flattening -----

    def visit(
        self,
        visit_fn: Callable[[str, Any], None],
        enter_fn: Optional[Callable[[str, Any], bool]] = None,
    ) -> None:
        """Calls `visit_fn(path, value)` on every leaf; `enter_fn(path, value)` on every
        config, sequence and mapping, which is entered unless `enter_fn` returns False."""
        _visit(self, "", visit_fn, enter_fn)

    def to_flat_dict(self, *, omit_default_values: Iterable[Any] = DEFAULT_OMITTED_VALUES):
        """Returns `{flat_key: value}` for every leaf.

        A field whose value equals its default and is one of `omit_default_values`
        (by default None and REQUIRED) is left out, and so is a dataclass value's field
        marked `metadata={"skip_serialization": True}`, whatever its value. A leaf that
        no validator accepts (an item of a container: those are not checked on
        assignment) raises InvalidConfigValueError naming its flat key.
        """
        omitted = list(omit_default_values)
        result = {}

        def enter(path: str, value: Any) -> bool:
            if isinstance(value, ConfigBase):
                # Fields in name order; dicts keep insertion order, sequences index order.
                for name, field in sorted(value._fields.items()):
                    field_value = getattr(value, name)
                    if _is_omitted(field_value, field.default, omitted):
                        continue
                    child_path = f"{path}.{name}" if path else name
                    _visit(field_value, child_path, visit, enter)
                return False
            record = _record_fields(value)
            if record is not None:  # As for config fields, omit defaults that are omitted.
                skipped = _skipped_fields(value)
                for key, item, default in record:
                    if key not in skipped and not _is_omitted(item, default, omitted):
                        _visit(item, f"{path}[{key!r}]", visit, enter)
                return False
            return True

        def visit(path: str, value: Any) -> None:
            _check_text_value(path, value)
            result[path] = value

        _visit(self, "", visit, enter)
        return result

    def debug_string(
        self,
        *,
        kv_separator: str = ": ",
        field_separator: str = "\n",
        omit_default_values: Iterable[Any] = DEFAULT_OMITTED_VALUES,
    ) -> str:
        """The golden text: one `key: value` line per leaf (no trailing newline).

        Config fields come in name order, dict entries in insertion order and sequence
        items in index order, so that a dict written in a meaningful order (a remat
        spec, regex rules) reads in that order.
        """
        flat = self.to_flat_dict(omit_default_values=omit_default_values)
        return field_separator.join(
            f"{key}{kv_separator}{format_value(value)}" for key, value in flat.items()
        )

    def to_dict(self) -> dict[str, Any]:
        """A nested dict of the fields: configs, dataclasses, attrs instances and named
        tuples become dicts, lists and tuples keep their type, ranges become lists,
        classes and functions become their qualified names; other values are kept as
        they are (None, REQUIRED, numbers, strings)."""
        return {name: _to_dict_value(value) for name, value in self.items()}

    def to_json(self, **kwargs) -> str:
        """`to_dict()` as JSON, every value JSON-friendly (others by name or repr)."""
        return json.dumps(_to_jsonable(self), **kwargs)


def _is_omitted(value: Any, default: Any, omitted: list[Any]) -> bool:
    return any(value is o or (o is not REQUIRED and value == o) for o in omitted) and (
        value is default or value == default
    )


def _record_fields(value: Any) -> Optional[list[tuple[str, Any, Any]]]:
    """(name, value, default) of each field of a dataclass or attrs instance or named
    tuple, which configs flatten like dicts (`x['name']`); None for other values, and
    for such an object that a module names (jax's `dots_saveable`), written by name."""
    if isinstance(value, (ConfigBase, str, int, float, list, dict)) or value is None:
        return None  # The common values, quickly.
    if not (_is_dataclass_instance(value) or is_attrs(value) or is_named_tuple(value)):
        return None
    if callable(value) and qualified_name(value) is not None:
        return None
    if _is_dataclass_instance(value):
        return [(f.name, getattr(value, f.name), f.default) for f in dataclasses.fields(value)]
    if is_attrs(value) and not isinstance(value, type):
        return [(a.name, getattr(value, a.name), a.default) for a in value.__attrs_attrs__]
    if is_named_tuple(value):
        defaults = getattr(type(value), "_field_defaults", {})
        return [(k, v, defaults.get(k, dataclasses.MISSING)) for k, v in value._asdict().items()]
    return None


# A dataclass field whose metadata holds this key as True is left out of `to_flat_dict`
# and `debug_string` (AXLearn's `dataclasses.field(metadata={"skip_serialization": True})`):
# a cache or debugging aid inside a value, not part of what the config says.
SKIP_SERIALIZATION = "skip_serialization"


def _skipped_fields(value: Any) -> frozenset:
    """The names of a dataclass value's fields marked to skip serialization."""
    if not _is_dataclass_instance(value):
        return frozenset()
    return frozenset(
        f.name for f in dataclasses.fields(value) if f.metadata.get(SKIP_SERIALIZATION, False)
    )


def _visit(value, path, visit_fn, enter_fn) -> None:
    record = _record_fields(value)
    if record is not None:
        if enter_fn is None or enter_fn(path, value):
            for key, item, _ in record:
                _visit(item, f"{path}[{key!r}]", visit_fn, enter_fn)
    elif isinstance(value, ConfigBase):
        if enter_fn is None or enter_fn(path, value):
            for name in value._fields:
                child_path = f"{path}.{name}" if path else name
                _visit(getattr(value, name), child_path, visit_fn, enter_fn)
    elif isinstance(value, (list, tuple)) and value:
        if enter_fn is None or enter_fn(path, value):
            for i, item in enumerate(value):
                _visit(item, f"{path}[{i}]", visit_fn, enter_fn)
    elif isinstance(value, dict) and value:
        if enter_fn is None or enter_fn(path, value):
            for key, item in value.items():
                _visit(item, f"{path}[{key!r}]", visit_fn, enter_fn)
    else:
        visit_fn(path, value)


def qualified_name(value: Any) -> Optional[str]:
    """'module.Name' for classes, functions and dtypes; None for other values."""
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)) or (
        # jax.numpy scalar types (jnp.bfloat16) are instances of a metaclass.
        hasattr(value, "__module__")
        and hasattr(value, "__qualname__")
        and callable(value)
        and not isinstance(value, ConfigBase)
    ):
        module = getattr(value, "__module__", None)
        name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
        if module and name:
            return _public_name(value, module, name)
    if _is_dtype_instance(value):
        # np.dtype('float32') and jnp.dtype('bfloat16') alike name their jax.numpy type,
        # which imports for every dtype jax supports.
        return f"jax.numpy.{value.name}"
    if callable(value) and not isinstance(value, ConfigBase):
        return _module_attribute_name(value)
    return None


def _module_attribute_name(value: Any) -> Optional[str]:
    """'module.name' for a callable object (not a function or class) that its type's
    module holds under a public name, such as jax's `dots_saveable` policy object. Of
    several names (aliases), the last one bound, which is the newer. A deep copy (configs
    copy their values) names the same as the original it equals."""
    module_name = getattr(type(value), "__module__", None)
    module = sys.modules.get(module_name) if module_name else None
    names = [
        name
        for name, member in (vars(module).items() if module is not None else ())
        if not name.startswith("_")
        and (member is value or type(member) is type(value) and _equal(member, value))
    ]
    return _public_name(value, module_name, names[-1]) if names else None


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # pylint: disable=broad-except
        return False


def _public_name(value: Any, module: str, name: str) -> str:
    """'module.name', or the shortest 'package.name' that reaches the same object where
    `module` is private (has a part starting with '_'): `package` is one of its prefixes
    before that part (optax._src.alias.adamw is optax.adamw)."""
    parts = module.split(".")
    private = [i for i, part in enumerate(parts) if part.startswith("_")]
    for end in range(1, private[0] + 1 if private else 0):
        package = ".".join(parts[:end])
        obj = sys.modules.get(package)
        for attr in name.split("."):
            obj = getattr(obj, attr, None)
        if obj is value:
            return f"{package}.{name}"
    return f"{module}.{name}"


def _is_dtype_instance(value: Any) -> bool:
    module = type(value).__module__
    return module.startswith("numpy") and all(
        hasattr(value, attr) for attr in ("name", "kind", "itemsize")
    ) and not isinstance(value, type)


def format_value(value: Any) -> str:
    """How one leaf is written in golden text."""
    name = qualified_name(value)
    if name is not None:
        return repr(name)
    if isinstance(value, enum.Enum):
        return repr(value)  # `<GMMBackend.TOKAMAX: 'TOKAMAX'>`, as AXLearn writes it.
    if _is_partition_spec(value):
        return f"PartitionSpec{tuple(value)!r}"  # `PartitionSpec(('data', 'fsdp'), None)`.
    return _value_repr(value)


def _is_partition_spec(value: Any) -> bool:
    """Whether `value` is a jax PartitionSpec (never true while jax is not imported)."""
    sharding = sys.modules.get("jax.sharding")
    return sharding is not None and isinstance(value, sharding.PartitionSpec)


def _value_repr(value: Any) -> str:
    name = qualified_name(value)
    if name is not None:
        return repr(name)
    return repr(value)


def _to_dict_value(value: Any) -> Any:
    if isinstance(value, ConfigBase):
        return value.to_dict()
    if isinstance(value, dict):
        items = {k: _to_dict_value(v) for k, v in value.items()}
        # A defaultdict's constructor differs from dict's: it becomes a plain dict.
        return items if isinstance(value, collections.defaultdict) else type(value)(items)
    if _is_dataclass_instance(value):
        return {f.name: _to_dict_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if is_attrs(value) and not isinstance(value, type):
        return {k: _to_dict_value(v) for k, v in _attrs_asdict(value).items()}
    if is_named_tuple(value):
        return {k: _to_dict_value(v) for k, v in value._asdict().items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_dict_value(v) for v in value)
    if isinstance(value, range):
        return [_to_dict_value(v) for v in value]
    if isinstance(value, (type, types.FunctionType)):
        return qualified_name(value)
    return value


def _to_jsonable(value: Any) -> Any:
    if isinstance(value, ConfigBase):
        return {name: _to_jsonable(v) for name, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_jsonable(v) for k, v in value.items()}
    if value is REQUIRED:
        return "REQUIRED"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    name = qualified_name(value)
    return name if name is not None else repr(value)


# ----- declaring config classes -----


def config_class(cls: type[C]) -> type[C]:
    """Turns the annotated class attributes of `cls` into config fields.

    Fields of base config classes are inherited; a subclass may override a default by
    annotating the field again. A field annotated without a value (`dim: int`) has no
    default: the config's constructor must be given it (`Cfg(dim=16)`), as with AXLearn's
    attrs classes; `REQUIRED` is the default of a field to be set later. Defaults are
    validated when a config is constructed.
    """
    if not isinstance(cls, type) or not issubclass(cls, ConfigBase):
        raise InvalidConfigClassError(f"@config_class expects a ConfigBase subclass, got {cls}")
    fields: dict[str, ConfigField] = {}
    for base in reversed(cls.__mro__[1:]):
        fields.update(getattr(base, "_fields", {}))
    annotations = cls.__dict__.get("__annotations__", {})
    _check_non_config_attributes(cls, annotations)
    for name, annotation in annotations.items():
        if _is_class_var(annotation):
            continue
        validate_config_field_name(name)
        default = cls.__dict__.get(name, NO_DEFAULT)
        fields[name] = ConfigField(name=name, annotation=annotation, default=default)
    for name in fields:
        if name in cls.__dict__ and name not in annotations or _is_class_var(annotations.get(name)):
            # A method, property or ClassVar named as an inherited field would be deleted
            # below (or shadow the field): the field is redefined only with an annotation.
            raise NonConfigFieldError(
                f"{cls.__qualname__}.{name} redefines an inherited config field as a non-field; "
                f"redefine it as a field ('{name}: <type> = <default>') or use another name"
            )
        # Defaults live in `_fields`; the class attributes would shadow `__getattr__`.
        if name in cls.__dict__:
            delattr(cls, name)
    cls._fields = fields
    # What `ConfigBase.__init__` checks: a name set on the class later is no field.
    cls._class_attributes = frozenset()
    cls._class_attributes = frozenset(dir(cls))
    return cls


def _is_class_var(annotation: Any) -> bool:
    return annotation is ClassVar or typing.get_origin(annotation) is ClassVar


def _check_no_late_class_attributes(cls: type) -> None:
    """Raises NonConfigFieldError for a class attribute set on `cls` (or a base) after
    @config_class (`Config.foo = 1`): it would not be a field, and setting a field's
    name so would not change its default."""
    late = sorted(
        name
        for name in set(dir(cls)) - cls._class_attributes
        if not name.startswith("__")
    )
    if late:
        raise NonConfigFieldError(
            f"Non-config attribute is not supported: {cls.__qualname__}.{late[0]} was set on "
            "the class after @config_class; declare fields in the class body and set values "
            "on a config"
        )


def _check_non_config_attributes(cls: type, annotations: dict[str, Any]) -> None:
    """Raises NonConfigFieldError for a class attribute that looks like a field but has no
    annotation (`foo = 10`): it would silently not be a field. Methods, properties,
    nested classes and private (`_x`) attributes are allowed (AXLearn allows only
    methods). As in AXLearn, a method is a function defined in the body of the class or
    of one of its bases (`def foo(self)`, its `__qualname__` says so): a function defined
    elsewhere and assigned (`foo = some_fn`, `foo = lambda self: ...`) is a value without
    a type, so no field either."""
    for name, value in cls.__dict__.items():
        if name.startswith("_") or name in annotations:
            continue
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        if isinstance(value, types.FunctionType) and _is_method_of(value, cls, name):
            continue
        if isinstance(value, (property, type)):
            continue
        raise NonConfigFieldError(
            f"Non-config attribute is not supported: {cls.__qualname__}.{name}; annotate it "
            "with a type to make it a field"
        )


def _is_method_of(fn: types.FunctionType, cls: type, name: str) -> bool:
    """Whether `fn` was defined as `name` in the body of `cls` or of a base of it."""
    return any(fn.__qualname__ == f"{klass.__qualname__}.{name}" for klass in cls.__mro__)


def _check_required(cfg: "ConfigBase", path: str) -> list[str]:
    """Paths of REQUIRED values in `cfg` and in nested function configs.

    Nested class configs are left alone: their owner may fill them (a layer sets a
    child's `input_dim`), and they are checked when they are instantiated in turn.
    """
    missing = []

    def enter(child_path: str, value: Any) -> bool:
        return value is cfg or not isinstance(value, ClassConfigBase)

    def visit(child_path: str, value: Any) -> None:
        if value is REQUIRED:
            missing.append(child_path)

    _visit(cfg, path, visit, enter)
    return missing


class Unresolved:
    """A value read from golden text (`golden_text.parse_flat_text`) that names something
    this library does not have.

    It dumps back as the text it was read from, so that a foreign config (AXLearn's)
    round-trips; instantiating a config that holds one raises, naming the config path
    and what is missing.
    """

    def __init__(self, where: str = "", reason: str = ""):
        self.where = where  # 'source:line: config.path', for the error.
        self.reason = reason  # What is missing.

    def error(self) -> "ConfigError":
        return ConfigError(f"{self.where}: {self.reason}")


def _check_resolved(cfg: "ConfigBase") -> None:
    """Raises for the first value read from foreign text that names something missing
    here (see `Unresolved`), in `cfg` and its nested function configs."""

    def enter(child_path: str, value: Any) -> bool:
        return value is cfg or not isinstance(value, ClassConfigBase)

    def visit(child_path: str, value: Any) -> None:
        if isinstance(value, Unresolved):
            raise value.error()

    _visit(cfg, "", visit, enter)


@config_class
class InstantiableConfig(ConfigBase, Generic[T]):
    """A config that knows how to build the object it describes."""

    def instantiate(self, **kwargs) -> T:
        raise NotImplementedError(type(self))

    def check_required_fields(self, path: str = "", *, given: Iterable[str] = ()) -> None:
        """Raises one error that lists every REQUIRED field by its dotted path, but for
        the fields named in `given` (those the caller supplies itself)."""
        prefix = f"{path}." if path else ""
        given = set(given)
        missing = [
            m
            for m in _check_required(self, path)
            if re.split(r"[.\[]", m[len(prefix) :], maxsplit=1)[0] not in given
        ]
        if missing:
            raise MissingRequiredFieldsError(
                f"Missing required fields of {type(self).__qualname__}: {', '.join(missing)}"
            )
        _check_resolved(self)


@config_class
class ClassConfigBase(InstantiableConfig[T]):
    """A config whose `klass` is the class it instantiates."""

    klass: type[T] = REQUIRED

    def _uncopied_field(self) -> Optional[str]:
        return "klass"

    def instantiate(self, **kwargs) -> T:
        self.check_required_fields(kwargs.pop("config_path", ""))
        return self.klass(self, **kwargs)


@config_class
class FunctionConfigBase(InstantiableConfig[T]):
    """A config whose fields are the keyword arguments of `fn`."""

    fn: Callable[..., T] = REQUIRED

    def _uncopied_field(self) -> Optional[str]:
        return "fn"

    # The field that holds `fn`'s *args (AXLearn's `chain` takes its transformations as
    # `args`), passed positionally; None: fn takes no *args.
    _positional_field: ClassVar[Optional[str]] = None
    # The field that holds `fn`'s **kwargs (a dict, AXLearn's `var_kwargs` field), whose
    # entries are passed as keyword arguments after the other fields; None: fn has none.
    _keyword_field: ClassVar[Optional[str]] = None
    # `fn`'s positional-only parameters, which instantiate() refuses (AXLearn's rule).
    _positional_only: ClassVar[tuple[str, ...]] = ()

    def instantiate(self, **kwargs) -> T:
        """Calls `fn` with the fields as keyword arguments; `kwargs` add to them and take
        precedence (AXLearn's rule), so that a REQUIRED field may be given here (an array,
        a shared object) instead of in the config."""
        self.check_required_fields(kwargs.pop("config_path", ""), given=kwargs)
        return _call_with_fields(self, self.fn, "fn", kwargs)


@config_class
class CallableClassConfigBase(InstantiableConfig[T]):
    """A config whose fields are the constructor arguments of `klass`."""

    klass: type[T] = REQUIRED

    _positional_field: ClassVar[Optional[str]] = None  # As in FunctionConfigBase.
    _keyword_field: ClassVar[Optional[str]] = None  # As in FunctionConfigBase.
    _positional_only: ClassVar[tuple[str, ...]] = ()  # As in FunctionConfigBase.

    def _uncopied_field(self) -> Optional[str]:
        return "klass"

    def instantiate(self, **kwargs) -> T:
        """Constructs `klass` from the fields; `kwargs` add to them and take precedence,
        as in FunctionConfigBase."""
        self.check_required_fields(kwargs.pop("config_path", ""), given=kwargs)
        return _call_with_fields(self, self.klass, "klass", kwargs)


def _call_with_fields(cfg: ConfigBase, target: Callable, key: str, kwargs: dict) -> Any:
    """`target(*positional, **fields)` with the fields of a function/class config, those
    named in `kwargs` replaced by its values (and its other entries added); the entries
    of the **kwargs field come under the named fields. A positional-only parameter
    cannot be passed so (AXLearn's NotImplementedError, at the same point)."""
    if cfg._positional_only:
        raise UnsupportedParameterError(
            f"{type(cfg).__qualname__}: parameter '{cfg._positional_only[0]}' of "
            f"{getattr(target, '__qualname__', target)} is positional-only (param kind "
            "POSITIONAL_ONLY), which a config cannot pass by name; wrap it in a function "
            "that takes keywords"
        )
    fields = {k: getattr(cfg, k) for k in cfg._fields if k != key}
    positional = fields.pop(cfg._positional_field) if cfg._positional_field else None
    if cfg._positional_field in kwargs:
        positional = kwargs.pop(cfg._positional_field)
    keywords = fields.pop(cfg._keyword_field) if cfg._keyword_field else None
    if cfg._keyword_field in kwargs:
        keywords = kwargs.pop(cfg._keyword_field)
    return target(*(positional or ()), **{**(keywords or {}), **fields, **kwargs})


_registered: dict[int, Any] = {}  # id -> object: what `register_configurable` declared.


def register_configurable(obj: T) -> T:
    """Declares `obj` (a function, class or constant) nameable in config text; returns it,
    so that it decorates: `@register_configurable def my_schedule(...)`. `Configurable`
    subclasses need not: they register themselves. A user's package registers its own
    functions so, and is trusted with `--trusted_packages` or $AXLEARN_TRUSTED_PACKAGES."""
    _registered[id(obj)] = obj
    return obj


def is_registered(obj: Any) -> bool:
    """Whether config text may name `obj` (see `register_configurable`)."""
    return _registered.get(id(obj)) is obj


class Configurable:
    """A class built from a config: `Cls.default_config().set(...).instantiate()`."""

    @config_class
    class Config(ClassConfigBase):
        """Configures Configurable."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_configurable(cls)  # Config text may name every configurable class.

    @classmethod
    def default_config(cls) -> Config:
        return cls.Config(klass=cls)

    def __init__(self, cfg: Config):
        if not isinstance(cfg, self.Config):
            raise ConfigError(
                f"{type(self).__qualname__} expects a {type(self).__qualname__}.Config, "
                f"got {type(cfg).__qualname__}"
            )
        self._config = copy.deepcopy(cfg)

    @property
    def config(self) -> Config:
        """A copy of this object's config (changing it changes nothing here)."""
        return copy.deepcopy(self._config)


def _parameter_types(fn: Callable) -> dict[str, Any]:
    """The annotation of each annotated parameter of `fn`, forward references (strings)
    resolved in `fn`'s module. One that does not resolve keeps its text and leaves the
    others' types as they are (AXLearn records every annotation as written)."""
    try:
        return typing.get_type_hints(fn)
    except Exception:  # pylint: disable=broad-except
        pass  # One annotation does not resolve: resolve the others one by one.
    hints = {}
    namespace = getattr(inspect.unwrap(fn), "__globals__", {})
    for name, param in inspect.signature(fn).parameters.items():
        if param.annotation is param.empty:
            continue
        one = types.SimpleNamespace(__annotations__={name: param.annotation}, __globals__=namespace)
        try:
            hints[name] = typing.get_type_hints(one)[name]
        except Exception:  # pylint: disable=broad-except
            hints[name] = param.annotation  # Kept as written.
    return hints


def _signature_fields(fn: Callable, skip: Sequence[str] = ()) -> dict[str, Any]:
    """name -> (annotation, default) of each parameter of `fn` but `skip`: the annotation
    as `fn` declares it (Any where it has none)."""
    fields = {}
    hints = _parameter_types(fn)
    for param in inspect.signature(fn).parameters.values():
        if param.name in skip:
            continue
        if param.kind == param.VAR_POSITIONAL:  # A sequence field, None: no arguments.
            fields[param.name] = (Optional[Sequence[hints.get(param.name, Any)]], None)
            continue
        if param.kind == param.VAR_KEYWORD:  # A dict field, None: no more arguments.
            fields[param.name] = (Optional[dict[str, hints.get(param.name, Any)]], None)
            continue
        default = REQUIRED if param.default is param.empty else param.default
        fields[param.name] = (hints.get(param.name, Any), default)
    return fields


def _positional_field(fn: Callable, kind=inspect.Parameter.VAR_POSITIONAL) -> Optional[str]:
    """The name of `fn`'s *args parameter (of its **kwargs with `kind=VAR_KEYWORD`)."""
    for param in inspect.signature(fn).parameters.values():
        if param.kind == kind:
            return param.name
    return None


def _make_config_class(base: type, name: str, fields: dict[str, Any], fn: Callable) -> type:
    annotations = {k: v[0] for k, v in fields.items()}
    namespace = {k: v[1] for k, v in fields.items()}
    for attribute, kind in (("_positional_field", inspect.Parameter.VAR_POSITIONAL),
                            ("_keyword_field", inspect.Parameter.VAR_KEYWORD)):  # fmt: skip
        field = _positional_field(fn, kind)
        namespace[attribute] = field if field in fields else None
    namespace["_positional_only"] = tuple(
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind == p.POSITIONAL_ONLY and p.name in fields
    )
    namespace["__annotations__"] = annotations
    namespace["__module__"] = __name__
    namespace["__qualname__"] = name
    return config_class(type(name, (base,), namespace))


def config_for_function(fn: Callable[..., T], **kwargs) -> FunctionConfigBase[T]:
    """A config with one field per parameter of `fn` (REQUIRED where `fn` has no default).
    A parameter named `fn` (the config's own field) or `_` is refused, as in AXLearn."""
    for reserved in ("fn", "_"):
        if reserved in inspect.signature(fn).parameters:
            raise ConfigError(
                f"Configured function {getattr(fn, '__qualname__', fn)} should not have a "
                f"'{reserved}' parameter (the config's `fn` field names the function)"
                if reserved == "fn"
                else f"Configured function {getattr(fn, '__qualname__', fn)} should not have "
                "a '_' parameter (config fields need names)"
            )
    fields = _signature_fields(fn)
    cls = _make_config_class(FunctionConfigBase, f"FunctionConfig[{fn.__name__}]", fields, fn)
    return cls(fn=fn, **kwargs)


def config_for_class(klass: type[T], **kwargs) -> CallableClassConfigBase[T]:
    """A config with one field per constructor parameter of `klass`; for
    `functools.partial`, a PartialFunctionConfig (fields `args` and `kwargs`)."""
    if klass is functools.partial:
        return PartialFunctionConfig(**kwargs)
    fields = _signature_fields(klass.__init__, skip=("self", "klass"))
    cls = _make_config_class(
        CallableClassConfigBase,
        f"ClassConfig[{klass.__name__}]",
        fields,
        klass.__init__,
    )
    return cls(klass=klass, **kwargs)


@config_class
class PartialFunctionConfig(InstantiableConfig[Callable]):
    """A config of `functools.partial(*args, **kwargs)`, where `args[0]` is the function;
    it dumps as AXLearn's `config_for_class(functools.partial)` does (`klass`, `args[i]`,
    `kwargs['name']`)."""

    klass: type = functools.partial
    args: Sequence[Any] = ()  # The function, then its leading positional arguments.
    kwargs: dict[str, Any] = {}  # Keyword arguments bound to the function.

    def instantiate(self, **kwargs) -> Callable:
        self.check_required_fields(kwargs.pop("config_path", ""))
        if not self.args or not callable(self.args[0]):
            raise ConfigError(f"args[0] must be the function to bind, got {self.args!r}")
        return self.klass(*self.args, **self.kwargs, **kwargs)


def config_for_partial_function(
    fn: Callable[..., T], /, *args, **kwargs
) -> PartialFunctionConfig:
    """A config that instantiates to `functools.partial(fn, *args, **kwargs)`; set more
    bound keyword arguments through its `kwargs` field.

    Example: `config_for_partial_function(pow, exp=2).instantiate()(3) == 9`.
    """
    return PartialFunctionConfig(args=(fn, *args), kwargs=kwargs)


ConfigOr = Union[T, InstantiableConfig[T]]


def maybe_instantiate(value: Any, **kwargs) -> Any:
    """Instantiates `value` if it is an instantiable config; returns it unchanged otherwise."""
    if isinstance(value, InstantiableConfig):
        return value.instantiate(**kwargs)
    return value


def maybe_set_config(cfg: C, **kwargs) -> C:
    """Sets only those of `kwargs` that `cfg` has as fields."""
    for key, value in kwargs.items():
        if key in cfg._fields:
            setattr(cfg, key, value)
    return cfg


class ConfigModifier(Configurable):
    """Maps a config to a modified one (`modifier(cfg) -> cfg`): a named, configurable
    edit, e.g. a mesh rule's change of a trainer config. This base leaves `cfg`
    unchanged; subclasses override `__call__`."""

    def __call__(self, cfg: InstantiableConfig[T]) -> InstantiableConfig[T]:
        return cfg


# What an experiment module's `named_trainer_configs()` maps each config name to.
TrainerConfigFn = Callable[[], InstantiableConfig]


def with_overrides(trainer_config_fn: TrainerConfigFn, **kwargs) -> TrainerConfigFn:
    """A TrainerConfigFn that builds `trainer_config_fn()` and sets `kwargs` on it."""

    def fn() -> InstantiableConfig:
        return trainer_config_fn().set(**kwargs)

    return fn


def get_named_trainer_config(
    config_name: str, *, config_module: str, root_module: Optional[str] = None
) -> TrainerConfigFn:
    """The TrainerConfigFn named `config_name` in experiment module `config_module`.

    The module, imported when this is called, is `{root_module}.experiments.{config_module}`
    (AXLearn's layout, e.g. root_module='axlearn', config_module='text.gpt.fuji'), or
    `experiments.{config_module}` (this repository's launcher modules) without
    `root_module`. Its `named_trainer_configs()` returns {name: TrainerConfigFn}, or a
    function of the name. An unknown name raises UnknownKeyError (a KeyError) naming
    the similar names.
    """
    package = f"{root_module}.experiments" if root_module else "experiments"
    module = importlib.import_module(f"{package}.{config_module}")
    config_map = module.named_trainer_configs()
    if callable(config_map):
        return config_map(config_name)
    if config_name in config_map:
        return config_map[config_name]
    similar = similar_names(config_name, config_map.keys())
    hint = (
        f"did you mean [{', '.join(similar)}]"
        if similar
        else f"{module.__name__} defines {', '.join(sorted(config_map)) or 'none'}"
    )
    raise UnknownKeyError(f"Unrecognized config {config_name}; {hint}")


# ----- paths -----

_QUOTED = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\""
# A tuple dict key such as `[(None, 1)]`: quoted strings, literals and one level of nesting.
_TUPLE_KEY = rf"\((?:{_QUOTED}|\((?:{_QUOTED}|[^()'\"])*\)|[^()'\"])*\)"
_PATH_TOKEN = re.compile(
    rf"\.?([A-Za-z_][A-Za-z_0-9]*)|\[(-?\d+)\]|\[({_QUOTED}|{_TUPLE_KEY})\]"
)


def parse_path(path: Union[str, Sequence[Any]]) -> list[Any]:
    """Splits 'a.b[0]['k'][(None, 1)]' into ['a', 'b', 0, 'k', (None, 1)]. Lists pass
    through unchanged."""
    if not isinstance(path, str):
        return list(path)
    parts: list[Any] = []
    pos = 0
    while pos < len(path):
        match = _PATH_TOKEN.match(path, pos)
        if match is None or (pos == 0 and path.startswith(".")):
            raise ConfigError(f"Cannot parse path '{path}' at position {pos}")
        name, index, key = match.groups()
        if name is not None:
            parts.append(name)
        elif index is not None:
            parts.append(int(index))
        else:
            parts.append(ast.literal_eval(key))
        pos = match.end()
    return parts


def _format_path(parts: Sequence[Any]) -> str:
    """The inverse of parse_path (dict keys that are identifiers read as fields)."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier():
            out += f".{part}" if out else part
        else:
            out += f"[{part!r}]"
    return out


def _get_child(node: Any, key: Any, parts: Sequence[Any], depth: int) -> Any:
    where = _format_path(parts[:depth]) or "<root>"
    if isinstance(node, ConfigBase):
        if not isinstance(key, str) or key not in node.keys():
            raise UnknownFieldError(
                f"{where} ({type(node).__qualname__}) has no field {key!r}"
                f"{_close_names(str(key), node.keys())}"
            )
        return getattr(node, key)
    if isinstance(node, (list, tuple)):
        if not isinstance(key, int) or not -len(node) <= key < len(node):
            raise ConfigError(f"{where} has {len(node)} items; index {key!r} is out of range")
        return node[key]
    if isinstance(node, Mapping):
        if key not in node:
            raise UnknownKeyError(
                f"{where} has no key {key!r}{_close_names(str(key), map(str, node))}"
            )
        return node[key]
    raise ConfigError(f"{where} is a {type(node).__name__}, which has no {key!r}")


def get_recursively(cfg: Any, path: Union[str, Sequence[Any]]) -> Any:
    """The value at `path` ('a.b[0]' or ['a', 'b', 0])."""
    parts = parse_path(path)
    node = cfg
    for depth, key in enumerate(parts):
        node = _get_child(node, key, parts, depth)
    return node


def set_recursively(cfg: Any, path: Union[str, Sequence[Any]], value: Any) -> None:
    """Sets the value at `path`; tuples on the way are rebuilt, so they can be set too."""
    parts = parse_path(path)
    if not parts:
        raise ConfigError("set_recursively needs a non-empty path")
    _set_in(cfg, parts, 0, value)


def _set_in(node: Any, parts: Sequence[Any], depth: int, value: Any) -> Any:
    key = parts[depth]
    if depth + 1 < len(parts):
        value = _set_in(_get_child(node, key, parts, depth), parts, depth + 1, value)
    elif not isinstance(node, Mapping):
        _get_child(node, key, parts, depth)  # Raises for unknown fields and bad indices.
    if isinstance(node, ConfigBase):
        setattr(node, key, value)
        return node
    if isinstance(node, list):
        node[key] = value
        return node
    if isinstance(node, tuple):
        items = list(node)
        items[key] = value
        return type(node)(items) if not hasattr(node, "_fields") else type(node)(*items)
    if isinstance(node, dict):
        node[key] = value
        return node
    raise ConfigError(f"Cannot set {_format_path(parts[: depth + 1])}")


# ----- names config text may use -----


# Config text (golden files, a run's config.txt, overrides) is data from disk: it may name
# only what was declared configurable. Objects of our own packages (and of a user's, once
# trusted) resolve when registered: every `Configurable` subclass registers itself, and
# functions are registered with `@register_configurable` where they are defined. Of jax,
# numpy and optax, config text may name only the public objects listed below (dtypes,
# activations, initializers, remat policies, optax's transformations and schedules).
TRUSTED_PACKAGES_ENV = "AXLEARN_TRUSTED_PACKAGES"
LIBRARY_PACKAGES = ("axlearn", "experiments")  # Resolved by registration.
THIRD_PARTY_PACKAGES = ("jax", "numpy", "optax")  # Resolved from `_THIRD_PARTY_NAMES` alone.
DEFAULT_TRUSTED_PACKAGES = (*LIBRARY_PACKAGES, *THIRD_PARTY_PACKAGES)
_widened_packages: list[str] = []  # Added by `trust_packages` (the commands' flag).

_DTYPES = (
    "bfloat16", "float16", "float32", "float64", "int4", "int8", "int16", "int32", "int64",
    "uint4", "uint8", "uint16", "uint32", "uint64", "bool_", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
)  # fmt: skip
_ACTIVATIONS = (
    "relu", "relu6", "gelu", "silu", "swish", "sigmoid", "tanh", "softplus", "elu", "celu",
    "selu", "leaky_relu", "log_sigmoid", "softmax", "log_softmax", "hard_tanh", "glu", "mish",
    "squareplus", "sparse_plus", "identity",
)  # fmt: skip
_UFUNCS = ("tanh", "exp", "square", "sqrt", "abs", "sin", "cos", "log1p")
_INITIALIZERS = (
    "constant", "delta_orthogonal", "glorot_normal", "glorot_uniform", "he_normal",
    "he_uniform", "lecun_normal", "lecun_uniform", "normal", "ones", "orthogonal",
    "truncated_normal", "uniform", "variance_scaling", "xavier_normal", "xavier_uniform",
    "zeros",
)  # fmt: skip
# optax's modules whose public objects build gradient transformations or schedules.
_OPTAX_MODULES = ("alias", "transform", "clipping", "combine", "constrain", "factorized",
                  "lookahead", "wrappers", "schedule", "join", "inject", "contrib")
_THIRD_PARTY_NAMES: Optional[dict[str, Any]] = None  # Dumped name -> object; built lazily.


def _third_party_names() -> dict[str, Any]:
    """The jax, numpy and optax objects config text may name, under their public paths and
    under the names dumps write for them (`jax._src.ad_checkpoint.dots_saveable`)."""
    global _THIRD_PARTY_NAMES  # pylint: disable=global-statement
    if _THIRD_PARTY_NAMES is not None:
        return _THIRD_PARTY_NAMES
    # pylint: disable=import-outside-toplevel
    import jax
    import jax.numpy as jnp
    import numpy as np

    public: dict[str, Any] = {}
    for dtype in _DTYPES:
        for prefix, module in (("jax.numpy", jnp), ("numpy", np)):
            if hasattr(module, dtype):
                public[f"{prefix}.{dtype}"] = getattr(module, dtype)
    for fn in _UFUNCS:
        public[f"numpy.{fn}"], public[f"jax.numpy.{fn}"] = getattr(np, fn), getattr(jnp, fn)
    public.update({f"jax.nn.{a}": getattr(jax.nn, a) for a in _ACTIVATIONS if hasattr(jax.nn, a)})
    public.update(
        {f"jax.nn.initializers.{i}": getattr(jax.nn.initializers, i) for i in _INITIALIZERS
         if hasattr(jax.nn.initializers, i)}
    )  # fmt: skip
    public.update(
        {f"jax.checkpoint_policies.{p}": getattr(jax.checkpoint_policies, p)
         for p in dir(jax.checkpoint_policies) if not p.startswith("_")}
    )  # fmt: skip
    public.update(_optax_names())
    names = dict(public)
    for obj in public.values():
        dumped = qualified_name(obj)
        if dumped is not None:
            names.setdefault(dumped, obj)
    _THIRD_PARTY_NAMES = names
    return names


def _optax_names() -> dict[str, Any]:
    """optax's top-level transformations, optimizers and schedules (`optax.adamw`)."""
    try:
        import optax  # pylint: disable=import-outside-toplevel
    except ImportError:
        return {}
    names = {}
    for attr in dir(optax):
        obj = getattr(optax, attr)
        module = getattr(obj, "__module__", "") or ""
        if (
            not attr.startswith("_")
            and callable(obj)
            and module.startswith("optax.")
            and module.rsplit(".", 1)[-1].lstrip("_") in _OPTAX_MODULES
        ):
            names[f"optax.{attr}"] = obj
    return names


class UntrustedNameError(ConfigError):
    """A name in config text or an override that the library did not declare configurable:
    outside the trusted packages, private, or not registered."""


def trust_packages(packages: Union[str, Iterable[str]]) -> None:
    """Lets config text name the registered objects of `packages` too, for this process: a
    comma-separated string or a sequence of top-level package names. The commands call
    it with their `--trusted_packages` flag; `AXLEARN_TRUSTED_PACKAGES` does the same.
    Trusting a package lets its modules be imported; its names must still be registered."""
    if isinstance(packages, str):
        packages = packages.split(",")
    for package in packages:
        package = package.strip()
        if not package:
            continue
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", package):
            raise ConfigError(f"Trusted package '{package}' is not a dotted Python name")
        if package not in _widened_packages:
            _widened_packages.append(package)


def trusted_packages() -> tuple[str, ...]:
    """The defaults, then `trust_packages`'s, then `$AXLEARN_TRUSTED_PACKAGES`'s."""
    env = [p.strip() for p in os.environ.get(TRUSTED_PACKAGES_ENV, "").split(",") if p.strip()]
    packages = [*DEFAULT_TRUSTED_PACKAGES, *_widened_packages, *env]
    return tuple(dict.fromkeys(packages))


def _is_trusted_module(module: str, packages: Sequence[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _module_of(obj: Any) -> str:
    """The module that defines `obj`: a module's own name, a class's or function's
    `__module__`, else its type's (a dtype instance, a policy object)."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    module = getattr(obj, "__module__", None)
    return module if isinstance(module, str) else type(obj).__module__


def _untrusted(name: str, where: str, what: str) -> UntrustedNameError:
    packages = ", ".join(trusted_packages())
    return UntrustedNameError(
        f"{where}'{name}'{what} is not under a trusted package ({packages}); "
        f"to allow it, set {TRUSTED_PACKAGES_ENV}=<package> or pass --trusted_packages"
    )


def _refused(name: str, where: str, why: str) -> UntrustedNameError:
    return UntrustedNameError(f"{where}'{name}' {why}; config text names only what was declared "
                              "configurable (docs/golden_configs.md, 'What config text may name')")


def import_name(name: str, *, where: str = "") -> Any:
    """The object 'package.module.attr' names (attr may be nested: 'mod.Class.method'), if
    config text may name it; `where` prefixes errors.

    - Under jax, numpy and optax: only the public objects listed here (dtypes,
      activations, initializers, remat policies, optax's transformations), found without
      importing anything by the given name.
    - Under our packages and trusted ones: a module path with no private part, whose
      object `register_configurable` (or a `Configurable` subclass) registered.
    - Anything else is refused before it is imported.
    """
    parts = name.split(".")
    if any(part.startswith("__") for part in parts):
        raise ConfigError(f"{where}'{name}': names with dunder parts are not resolved")
    packages = trusted_packages()
    if parts[0] in THIRD_PARTY_PACKAGES:
        found = _third_party_names().get(name)
        if found is None:
            raise _refused(name, where, f"is not one of the {parts[0]} objects config text may name")
        return found
    if not _is_trusted_module(name, packages):
        raise _untrusted(name, where, "")
    if any(part.startswith("_") for part in parts[:-1]):
        raise _refused(name, where, "is in a private module")
    obj = _import_public(name, parts, where)
    if not is_registered(obj):
        defined = _module_of(obj)
        if not _is_trusted_module(defined, packages):
            raise _untrusted(name, where, f" (defined in {defined})")
        raise _refused(name, where, "is not registered as configurable")
    return obj


def _import_public(name: str, parts: list[str], where: str) -> Any:
    """The object at `name`: its longest importable module prefix, then attributes."""
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only a missing module of our own prefix means "try a shorter prefix".
            if e.name and not module_name.startswith(e.name):
                raise ConfigError(f"{where}importing '{name}' failed: {e}") from e
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise ConfigError(f"{where}'{name}' does not name an importable class, function or dtype")


# ----- overrides -----


def _type_matches(value: Any, annotation: Any) -> bool:
    """A permissive structural check of `value` against a type annotation."""
    if annotation is Any or annotation is None and value is None:
        return True
    if isinstance(annotation, TypeVar):
        return True
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (Union, getattr(types, "UnionType", Union)):
        return any(_type_matches(value, a) for a in args)
    if annotation is type(None):
        return value is None
    if annotation is RequiredFieldValue:  # The REQUIRED arm of Required[T] takes only REQUIRED.
        return value is REQUIRED
    if origin is typing.Literal:
        return value in args
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple, Sequence, typing.Sequence) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(args) == len(value) and all(map(_type_matches, value, args))
        return not args or all(_type_matches(v, args[0]) for v in value)
    if origin in (dict, Mapping, typing.Mapping) or annotation is dict:
        return isinstance(value, Mapping)
    if isinstance(annotation, type):
        if annotation in (bool, str):
            return isinstance(value, annotation)
        if issubclass(annotation, ConfigBase):
            return isinstance(value, annotation)
        return True  # Types we cannot check cheaply (callables, dtypes, ...).
    return True


def _coerce_override(field_path: str, field: Optional[ConfigField], current: Any, value: Any):
    """Resolves qualified names for callable/dtype fields and checks the value's type."""
    if isinstance(value, str) and qualified_name(current) is not None and "." in value:
        return import_name(value, where=f"{field_path}: ")
    if field is not None and not _type_matches(value, field.annotation):
        raise InvalidConfigValueError(
            f"{field_path}: expected {describe_annotation(field.annotation)}, "
            f"got {value!r} ({_article(type(value).__name__)})"
        )
    if field is not None and field.annotation is float and isinstance(value, int):
        return float(value)
    return value


def _annotation_str(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _article(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiouAEIOU" else f"a {noun}"


# How a user reads the plain types of a field (an override's value is a Python literal).
_PLAIN_TYPES = {int: "an int", float: "a number", bool: "True or False", str: "a string"}


def describe_annotation(annotation: Any) -> str:
    """A field's type in a user's words: `Required[int]` -> 'an int', `Optional[float]` ->
    'a number or None', `Sequence[str]` -> 'a list of a string'...; no internal names
    (REQUIRED's marker type is left out: it is no value to give)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, getattr(types, "UnionType", Union)):
        arms = [a for a in args if a is not RequiredFieldValue]
        named = [describe_annotation(a) for a in arms if a is not type(None)]
        if type(None) in arms:
            named.append("None")
        return " or ".join(dict.fromkeys(named)) if named else "REQUIRED"
    if annotation is type(None):
        return "None"
    if annotation in _PLAIN_TYPES:
        return _PLAIN_TYPES[annotation]
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple, Sequence, typing.Sequence) or annotation in (list, tuple):
        item = args[0] if args and (origin is not tuple or args[-1] is Ellipsis) else None
        return f"a list of {describe_annotation(item)}" if item not in (None, Any) else "a list"
    if origin in (dict, Mapping, typing.Mapping) or annotation is dict:
        return "a dict"
    if isinstance(annotation, type) and issubclass(annotation, ConfigBase):
        return f"a config ({annotation.__qualname__})"
    return _annotation_str(annotation)


def apply_overrides(cfg: C, overrides: Iterable[str]) -> C:
    """Applies 'path=value' strings, values as Python literals, type-checked per field.

    Example: `apply_overrides(cfg, ["learner.optimizer.peak_lr=3e-4", "max_step=100"])`.
    A value that is not a literal is taken as a string (`model.dtype=jax.numpy.float32`),
    except where the field holds a number (`lr=-1e9x`): that is an error naming the field,
    which a string would otherwise reach only once built, without its name.
    """
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"Override '{override}' is not of the form path=value")
        path, text = override.split("=", 1)
        path, text = path.strip(), text.strip()
        parts = parse_path(path)
        parent = get_recursively(cfg, parts[:-1])
        current = _get_child(parent, parts[-1], parts, len(parts) - 1)
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            if isinstance(current, (int, float)) and not isinstance(current, bool):
                raise InvalidConfigValueError(  # pylint: disable=raise-missing-from
                    f"{override}: {path} holds a number ({current!r}); {text!r} is not one"
                )
            value = text
        field = parent._fields.get(parts[-1]) if isinstance(parent, ConfigBase) else None
        set_recursively(cfg, parts, _coerce_override(path, field, current, value))
    return cfg
