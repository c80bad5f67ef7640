"""The golden text format: reading it back into configs, and the `_init` and
`_regularizer` golden lines.

A golden config (`ConfigBase.debug_string()`) is one `key: value` line per leaf: `a.b`
for nested configs, `[i]` for sequence items, `['k']` for dict keys; classes, functions
and dtypes are quoted qualified names, enum members `<Cls.NAME: value>`, partition specs
`PartitionSpec(...)`. `parse_flat_text` reads such text (a golden file, a run's
`config.txt`, AXLearn's goldens) back into a config tree; every name it resolves goes
through `config.import_name`, so only names under the trusted packages are imported.

`init_lines` and `regularizer_lines` write the other two golden files of a config: each
parameter's initializer, and each parameter's effective weight-decay scale, in AXLearn's
formats. See docs/golden_configs.md.

This module is pure Python: importing it must not import jax.
"""

import ast
import dataclasses
import enum
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Optional

from axlearn.common.config import (  # The core's path and traversal helpers, shared.
    REQUIRED,
    ConfigBase,
    ConfigError,
    Configurable,
    InstantiableConfig,
    UnknownFieldError,
    Unresolved,
    _close_names,
    _format_path,
    _visit,
    config_class,
    config_for_class,
    config_for_function,
    import_name,
    parse_path,
    qualified_name,
)


def flat_lines(text: str) -> dict[str, str]:
    """Key -> value text of each `key: value` line of golden text."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if sep:
            out[key] = value
    return out


# ----- parsing golden text -----


class UnresolvedName(str, Unresolved):
    """A quoted qualified name ('pkg.module.name') that does not import here, or that is
    outside the trusted packages (and so was never imported)."""

    def __new__(cls, name: str, where: str = "", reason: str = "") -> "UnresolvedName":
        return super().__new__(cls, name)

    def __init__(self, name: str, where: str = "", reason: str = ""):
        del name  # Held by the str itself.
        Unresolved.__init__(self, where, reason)


class EnumText(Unresolved):
    """An enum member written as `<Cls.NAME: value>` whose enum class is not known here."""

    def __init__(self, text: str, class_name: str, member: str, where: str = ""):
        reason = f"enum {class_name} (read as {text}) is not a type this field takes"
        super().__init__(where, reason)
        self.text, self.class_name, self.member = text, class_name, member

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, EnumText) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


@config_class
class UnresolvedConfig(InstantiableConfig):
    """A config whose `klass`/`fn` does not import here, or that sets fields its class
    lacks. Each parsed one is an instance of its own subclass, whose fields are the
    text's, so that it dumps back unchanged; `instantiate()` raises."""

    _unresolved: ClassVar[Unresolved] = Unresolved()

    def instantiate(self, **kwargs):
        raise self._unresolved.error()


def unresolved_values(cfg: Any, path: str = "") -> list[tuple[str, Unresolved]]:
    """(path, value) of every unresolved name, enum or config in a config tree."""
    found: list[tuple[str, Unresolved]] = []

    def enter(child_path: str, value: Any) -> bool:
        if isinstance(value, UnresolvedConfig):
            found.append((child_path, value._unresolved))
        return True

    def visit(child_path: str, value: Any) -> None:
        # An unresolved config's klass/fn is its own placeholder (a copy), listed once.
        if isinstance(value, Unresolved) and all(value.where != f.where for _, f in found):
            found.append((child_path, value))

    _visit(cfg, path, visit, enter)
    return found


_ENUM_REPR = re.compile(r"<([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\.([A-Za-z_]\w*): (.*)>")


def read_value(text: str) -> Any:
    """One value of golden text: a Python literal, `PartitionSpec(...)` (a jax
    PartitionSpec), `inf`/`nan`, or an enum member `<Cls.NAME: value>` (an EnumText
    until a field of that enum type takes it)."""
    match = _ENUM_REPR.fullmatch(text)
    if match:
        return EnumText(text, *match.group(1, 2))
    return _literal(ast.parse(text, mode="eval").body)


_SPECIAL_FLOATS = {"inf": float("inf"), "nan": float("nan")}


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_literal(item) for item in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _literal(node.operand)
        if isinstance(operand, (int, float, complex)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.Name) and node.id in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[node.id]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "PartitionSpec"
        and not node.keywords
    ):
        from jax.sharding import PartitionSpec  # pylint: disable=import-outside-toplevel

        return PartitionSpec(*(_literal(arg) for arg in node.args))
    raise ValueError(f"not a literal: {ast.unparse(node)}")


def _key_value(line: str, lineno: int, source: str) -> tuple[list[Any], Any]:
    key, sep, text = line.partition(": ")
    if not sep:
        raise ConfigError(f"{source}:{lineno}: expected 'key: value', got {line!r}")
    try:
        value = read_value(text)
    except (ValueError, SyntaxError) as e:
        raise ConfigError(f"{source}:{lineno}: cannot read value {text!r}: {e}") from e
    try:
        return parse_path(key), value
    except ConfigError as e:
        raise ConfigError(f"{source}:{lineno}: {e}") from e


class _Node(dict):
    """An intermediate tree while parsing: child key -> _Node, or a leaf (value, lineno)."""


@dataclasses.dataclass(frozen=True)
class _ParseContext:
    source: str  # The file name, for errors.
    foreign: bool  # Read as a dump of another library version (see parse_flat_text).

    def where(self, lineno: int, path: Sequence[Any] = ()) -> str:
        return f"{self.source}:{lineno}: {_format_path(path) or '<root>'}"


def parse_flat_text(text: str, *, source: str = "<text>", foreign: bool = False) -> ConfigBase:
    """Reads golden text back into a config tree.

    `klass`/`fn` lines choose each config's class; quoted names in fields whose default
    is a class, function or dtype are imported, through `config.import_name`: a name
    outside the trusted packages is refused (`UntrustedNameError`, naming the line, the
    key and the name) before anything is imported. Dumping the result reproduces `text`.

    By default a name that does not import here, or a field its class lacks, raises;
    a field the text leaves out keeps its default. With `foreign=True` the text is read
    as the complete dump of another version of the library (AXLearn's own goldens):
    - unknown or untrusted names and unknown fields are kept as `Unresolved`
      placeholders (an `UnresolvedConfig` for a config) that dump back as the same text
      and raise, naming their config path and what is missing, when instantiated;
    - a field the text leaves out is None, since a dump omits exactly the fields that
      are None or REQUIRED (its config gets a subclass whose default there is None).
    """
    root = _Node()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts, value = _key_value(line, lineno, source)
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, _Node())
            if not isinstance(node, _Node):
                raise ConfigError(f"{source}:{lineno}: {_format_path(parts)} nests under a leaf")
        node[parts[-1]] = (value, lineno)
    return _build(root, [], _ParseContext(source, foreign), default=None)


def _first_lineno(node: Any) -> int:
    if isinstance(node, tuple):
        return node[1]
    return min(_first_lineno(v) for v in node.values())


def _annotation_names_object(annotation: Any) -> bool:
    """Whether an annotation admits classes, callables or dtypes."""
    if annotation is type or annotation is Callable or "dtype" in str(annotation):
        return True
    if typing.get_origin(annotation) in (type, Callable, typing.Callable):
        return True
    return any(_annotation_names_object(a) for a in typing.get_args(annotation))


def _names_an_object(default: Any, annotation: Any) -> bool:
    """Whether a quoted string for this field is the qualified name of a class/fn/dtype."""
    return qualified_name(default) is not None or _annotation_names_object(annotation)


def _enum_types(default: Any, annotation: Any) -> list[type]:
    """The enum classes a field takes: its default's, and those its annotation names."""
    types_ = [type(default)] if isinstance(default, enum.Enum) else []
    candidates = [annotation, *typing.get_args(annotation)]
    types_ += [a for a in candidates if isinstance(a, type) and issubclass(a, enum.Enum)]
    return types_


def _resolve_enum(value: EnumText, default: Any, annotation: Any) -> Any:
    for enum_type in _enum_types(default, annotation):
        if enum_type.__name__ == value.class_name.rsplit(".", 1)[-1]:
            if value.member in enum_type.__members__:
                return enum_type[value.member]
    return value


def _build_leaf(node: tuple, path: list[Any], ctx: _ParseContext, default, annotation) -> Any:
    value, lineno = node
    if isinstance(value, EnumText):
        value.where = ctx.where(lineno, path)
        resolved = _resolve_enum(value, default, annotation)
        if resolved is value and not ctx.foreign:
            raise value.error()
        return resolved
    if (
        isinstance(value, str)
        and re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+", value)
        and _names_an_object(default, annotation)
    ):
        return _resolve_name(value, lineno, path, ctx)
    return value


def _resolve_name(name: str, lineno: int, path: list[Any], ctx: _ParseContext) -> Any:
    """The object `name` (read at `path`) names, through `import_name` and its trust
    check; in foreign text, an `UnresolvedName` where it does not resolve here."""
    try:
        return import_name(name)
    except ConfigError as e:
        if ctx.foreign:
            return UnresolvedName(name, ctx.where(lineno, path), str(e))
        raise type(e)(f"{ctx.where(lineno, path)}: {e}") from e


def _build(node: Any, path: list[Any], ctx: _ParseContext, default: Any, annotation: Any = Any):
    if isinstance(node, tuple):  # A leaf.
        return _build_leaf(node, path, ctx, default, annotation)
    if "klass" in node or "fn" in node:
        return _build_config(node, path, ctx)
    if all(isinstance(k, int) for k in node):
        items = [node[i] for i in sorted(node)]
        if sorted(node) != list(range(len(node))):
            raise ConfigError(
                f"{ctx.source}:{_first_lineno(node)}: {_format_path(path)} has gaps in its indices"
            )
        defaults = list(default) if isinstance(default, (list, tuple)) else []
        built = [
            _build(item, path + [i], ctx, defaults[i] if i < len(defaults) else None)
            for i, item in enumerate(items)
        ]
        return list(built) if isinstance(default, list) else tuple(built)
    defaults = default if isinstance(default, Mapping) else {}
    return {k: _build(v, path + [k], ctx, defaults.get(k)) for k, v in node.items()}


def _text_config_class(
    base: type,
    *,
    extra: Sequence[str] = (),
    none: Sequence[str] = (),
    unresolved: Optional[Unresolved] = None,
    name: Optional[str] = None,
) -> type:
    """A subclass of config class `base` for text it cannot express as it is: `extra`
    fields (each defaulting to REQUIRED, so that every value the text sets, None
    included, dumps back) and `none` fields whose default becomes None. With
    `unresolved`, the subclass is an UnresolvedConfig whose instantiate() raises."""
    bases = (base,)
    namespace: dict[str, Any] = {field: REQUIRED for field in extra}
    namespace.update({field: None for field in none})
    annotations = {field: Any for field in extra}
    annotations.update({field: base._fields[field].annotation for field in none})
    if unresolved is not None:
        if not issubclass(base, UnresolvedConfig):
            bases = (base, UnresolvedConfig)
        namespace.update(_unresolved=unresolved, instantiate=UnresolvedConfig.instantiate)
    name = name or base.__qualname__
    namespace.update(__annotations__=annotations, __module__=base.__module__, __qualname__=name)
    return config_class(type(name.rsplit(".", 1)[-1], bases, namespace))


def _build_config(node: _Node, path: list[Any], ctx: _ParseContext) -> ConfigBase:
    key = "klass" if "klass" in node else "fn"
    name, lineno = node[key]
    target = _resolve_name(name, lineno, path + [key], ctx)
    if isinstance(target, UnresolvedName):
        unresolved = target
        cls = _text_config_class(
            UnresolvedConfig, extra=list(node), unresolved=unresolved, name=f"Unresolved[{name}]"
        )
        cfg = cls()
        setattr(cfg, key, unresolved)
        for field_name, child in node.items():
            if field_name != key:
                setattr(cfg, field_name, _build(child, path + [field_name], ctx, None))
        return cfg
    if key == "fn":
        cfg = config_for_function(target)
    elif isinstance(target, type) and issubclass(target, Configurable):
        cfg = target.default_config()
    else:
        cfg = config_for_class(target)
    unknown = [f for f in node if f != key and f not in cfg.keys()]
    if unknown and not ctx.foreign:
        first = _first_lineno(node[unknown[0]])
        raise UnknownFieldError(
            f"{ctx.source}:{first}: {_format_path(path + [unknown[0]])}: "
            f"{name} has no field '{unknown[0]}'{_close_names(str(unknown[0]), cfg.keys())}"
        )
    if ctx.foreign:
        cfg = _as_complete_dump(cfg, node, unknown, path, ctx, name)
    for field_name, child in node.items():
        if field_name == key:
            continue
        default = getattr(cfg, field_name)
        annotation = cfg._fields[field_name].annotation
        setattr(cfg, field_name, _build(child, path + [field_name], ctx, default, annotation))
    return cfg


def _as_complete_dump(
    cfg: ConfigBase,
    node: _Node,
    unknown: list[str],
    path: list[Any],
    ctx: _ParseContext,
    name: str,
) -> ConfigBase:
    """`cfg` re-typed so that `node`, read as a complete dump, dumps back unchanged: the
    `unknown` fields are kept (and make instantiation fail), and fields the text leaves
    out that are not None or REQUIRED here become None, the only values a dump omits."""
    none = [
        f
        for f, value in cfg.items()
        if f not in node and f not in ("klass", "fn") and not (value is None or value is REQUIRED)
    ]
    if not unknown and not none:
        return cfg
    unresolved = None
    if unknown:
        where = ctx.where(_first_lineno(node[unknown[0]]), path)
        unresolved = Unresolved(where, f"{name} has no field(s) {', '.join(map(repr, unknown))}")
    cls = _text_config_class(type(cfg), extra=unknown, none=none, unresolved=unresolved)
    values = {f: v for f, v in cfg.items() if f not in none}
    return cls(**values)


# ----- the `_init` and `_regularizer` golden lines -----


def init_lines(layer: Any) -> list[str]:
    """The `_init.txt` golden lines of a model layer (a `BaseLayer`): one line per
    parameter, `path: <initializer's debug_string>`, in the order of
    `layer.parameter_initializers()`, which is AXLearn's order of initialization, e.g.
    `decoder/emb/token_emb/weight: normal(0, 1.0 / fan_out), shape=(32, 8), axes=FanAxes(...)`.
    """
    return [
        f"{path}: {initializer.debug_string(path, spec.shape, spec.fan_axes)}"
        for path, initializer, spec in layer.parameter_initializers()
    ]


REGULARIZER_HEADER = f"{'=' * 20}weight_decay_scale root.optimizer{'=' * 20}"


def _format_scale(value: float) -> str:
    """1.0 -> '1', 0.0 -> '0', 0.25 -> '0.25'."""
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


def regularizer_lines(scales: Mapping[str, float]) -> list[str]:
    """The `_regularizer.txt` golden lines: AXLearn's header, then `path: scale` per
    parameter, sorted by path, from the learner's effective weight-decay scales
    (`learner.weight_decay_scales`)."""
    return [REGULARIZER_HEADER] + [f"{p}: {_format_scale(s)}" for p, s in sorted(scales.items())]
