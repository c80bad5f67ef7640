"""The module tree and the invocation context.

A `Module` is built from its config; its children are declared in `__init__` with
`self._add_child(name, child_config)`. Modules hold no arrays: parameters and other
state live in a nested dict outside the tree (`{param_name: array, child_name: {...}}`).

A call runs inside an `InvocationContext` that carries the module's slice of the state,
a PRNG key, `is_training` and an `OutputCollection` (summaries, state updates, module
outputs). `F(module, state=..., inputs=..., prng_key=..., is_training=...)` is the
functional entry point; inside a call, `self.child(...)` or `self.child.method(...)`
enters the child's context automatically: its state slice, a PRNG key folded in from the
child's name, and a child output collection.
"""

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import jax

from axlearn.common.config import REQUIRED, ConfigError, Configurable, Required, config_class

Tensor = jax.Array
NestedTensor = Union[Tensor, dict[str, Any]]


@dataclasses.dataclass
class OutputCollection:
    """What a call produces besides its return value, nested by child name."""

    summaries: dict[str, Any] = dataclasses.field(default_factory=dict)
    state_updates: dict[str, Any] = dataclasses.field(default_factory=dict)
    module_outputs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def add_child(self, name: str) -> "OutputCollection":
        child = OutputCollection()
        self.summaries[name] = child.summaries
        self.state_updates[name] = child.state_updates
        self.module_outputs[name] = child.module_outputs
        return child

    def update_child(self, name: str, child: "OutputCollection") -> None:
        self.summaries[name] = child.summaries
        self.state_updates[name] = child.state_updates
        self.module_outputs[name] = child.module_outputs


jax.tree_util.register_dataclass(
    OutputCollection,
    data_fields=["summaries", "state_updates", "module_outputs"],
    meta_fields=[],
)


def new_output_collection() -> OutputCollection:
    return OutputCollection()


def child_prng_key(prng_key: Optional[Tensor], name: str) -> Optional[Tensor]:
    """A key for child `name`: distinct per name, the same on every run and process."""
    if prng_key is None:
        return None
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return jax.random.fold_in(prng_key, int.from_bytes(digest[:4], "little") & 0x7FFFFFFF)


@dataclasses.dataclass
class InvocationContext:
    """The state of one module's call."""

    module: "Module"
    state: Any
    prng_key: Optional[Tensor]
    is_training: bool
    output_collection: OutputCollection


def stacked_layer_context(
    context: InvocationContext, layer_state: Any, prng_key: Optional[Tensor]
) -> InvocationContext:
    """The context in which a stack (Repeat, Pipeline) runs one copy of its `layer` child:
    the stack's own module and mode, that copy's slice of the state as 'layer', `prng_key`
    and a fresh output collection."""
    return InvocationContext(
        module=context.module,
        state={"layer": layer_state},
        prng_key=prng_key,
        is_training=context.is_training,
        output_collection=new_output_collection(),
    )


_CONTEXT_STACK = threading.local()


def _context_stack() -> list[InvocationContext]:
    if not hasattr(_CONTEXT_STACK, "stack"):
        _CONTEXT_STACK.stack = []
    return _CONTEXT_STACK.stack


def current_context() -> Optional[InvocationContext]:
    stack = _context_stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def set_current_context(context: InvocationContext):
    stack = _context_stack()
    stack.append(context)
    try:
        yield context
    finally:
        stack.pop()


# Methods of Module (and of subclasses) that never enter a child context.
_NO_CONTEXT_METHODS = frozenset(
    {
        "config",
        "default_config",
        "path",
        "children",
        "parent",
        "name",
        "get_invocation_context",
        "add_summary",
        "add_state_update",
        "add_module_output",
        "vprint",
    }
)


def _wrap_method(method: Callable) -> Callable:
    """Makes `child.method(...)` called from its parent's context run in its own."""

    @functools.wraps(method)
    def wrapper(self: "Module", *args, **kwargs):
        context = current_context()
        if context is None or context.module is self:
            return method(self, *args, **kwargs)
        if context.module is self.parent:
            return self._call_in_child_context(method, args, kwargs)
        raise RuntimeError(
            f"{self.path()}.{method.__name__} was called from {context.module.path()}, "
            "which is not its parent; use F() to call a module from elsewhere"
        )

    wrapper.__wrapped_method__ = True
    return wrapper


class Module(Configurable):
    """A node of the module tree."""

    @config_class
    class Config(Configurable.Config):
        """Configures Module."""

        name: Required[str] = REQUIRED  # The child name; set by the parent.

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for attr, value in list(cls.__dict__.items()):
            if (
                attr.startswith("_")
                or attr in _NO_CONTEXT_METHODS
                or not inspect.isfunction(value)
                or getattr(value, "__wrapped_method__", False)
            ):
                continue
            setattr(cls, attr, _wrap_method(value))

    def __init__(self, cfg: Config, *, parent: Optional["Module"]):
        super().__init__(cfg)
        if not isinstance(cfg.name, str) or not cfg.name:
            raise ConfigError(f"{type(self).__name__} needs a name (cfg.name)")
        self._name = cfg.name
        self._parent = parent
        self._children: dict[str, Module] = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def parent(self) -> Optional["Module"]:
        return self._parent

    def path(self) -> str:
        """Dotted module path from the root, e.g. 'root.model.decoder'."""
        return f"{self._parent.path()}.{self._name}" if self._parent else self._name

    @property
    def children(self) -> dict[str, "Module"]:
        return dict(self._children)

    def _add_child(self, name: str, child_config: "Module.Config", **kwargs) -> "Module":
        """Instantiates `child_config` as child `name` (the config is copied)."""
        if name in self._children:
            raise ConfigError(f"{self.path()} already has a child named '{name}'")
        if not isinstance(child_config, Module.Config):
            raise ConfigError(
                f"{self.path()}.{name}: expected a Module config, got {type(child_config)}"
            )
        child_config = child_config.clone(name=name)
        child = child_config.instantiate(parent=self, config_path=self._config_path(name), **kwargs)
        self._children[name] = child
        return child

    def _config_path(self, child_name: str) -> str:
        names = []
        node: Optional[Module] = self
        while node is not None and node.parent is not None:
            names.append(node.name)
            node = node.parent
        return ".".join(reversed(names + [child_name])) if names else child_name

    def __getattr__(self, name: str) -> Any:
        children = self.__dict__.get("_children", {})
        if name in children:
            return children[name]
        raise AttributeError(f"{type(self).__name__} ({self.__dict__.get('_name')}) has no '{name}'")

    # ----- the invocation context -----

    def get_invocation_context(self) -> InvocationContext:
        context = current_context()
        if context is None or context.module is not self:
            raise RuntimeError(f"{self.path()} is not being called: use F() to call it")
        return context

    @property
    def state(self) -> Any:
        return self.get_invocation_context().state

    @property
    def parameters(self) -> Any:
        return self.get_invocation_context().state

    @property
    def prng_key(self) -> Optional[Tensor]:
        return self.get_invocation_context().prng_key

    @property
    def is_training(self) -> bool:
        return self.get_invocation_context().is_training

    def add_summary(self, name: str, value: Any) -> None:
        self.get_invocation_context().output_collection.summaries[name] = value

    def add_state_update(self, name: str, value: Any) -> None:
        self.get_invocation_context().output_collection.state_updates[name] = value

    def add_module_output(self, name: str, value: Any) -> None:
        self.get_invocation_context().output_collection.module_outputs[name] = value

    def _call_in_child_context(self, method: Callable, args: Sequence[Any], kwargs: dict):
        """Runs `method` of this module from its parent's context and merges its outputs."""
        parent_context = current_context()
        state = parent_context.state
        child_state = state.get(self.name, {}) if isinstance(state, dict) else {}
        prng_key = child_prng_key(parent_context.prng_key, self.name)
        # The scope names this module's ops in HLO metadata, so profiles say where time goes.
        with jax.named_scope(self.name):
            outputs, collection = self._functional_call(
                method, child_state, prng_key, parent_context.is_training, args, kwargs
            )
        parent_context.output_collection.update_child(self.name, collection)
        return outputs

    def _functional_call(self, method, state, prng_key, is_training, args, kwargs):
        """Calls `method` as a pure function of (state, prng_key, inputs).

        Subclasses may transform this function (BaseLayer applies rematerialization).
        """

        def call(state, prng_key, args, kwargs):
            context = InvocationContext(
                module=self,
                state=state,
                prng_key=prng_key,
                is_training=is_training,
                output_collection=new_output_collection(),
            )
            with set_current_context(context):
                outputs = method(self, *args, **kwargs)
            return outputs, context.output_collection

        return call(state, prng_key, args, kwargs)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(type(self))

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def vprint(self, *args) -> None:
        """Prints a debug line tagged with the module path (under jit: jax.debug.print)."""
        jax.debug.print(f"[{self.path()}] " + " ".join("{}" for _ in args), *args)


def functional(
    module: Module,
    *,
    state: Any,
    inputs: Union[Sequence[Any], dict[str, Any]],
    prng_key: Optional[Tensor],
    is_training: bool,
    method: str = "forward",
    drop_output_collections: Sequence[str] = (),
) -> tuple[Any, OutputCollection]:
    """Calls `module.<method>(**inputs)` (or `*inputs`) with the given state.

    Returns `(outputs, output_collection)`. Nothing is kept in the module.
    """
    fn = getattr(type(module), method, None)
    if fn is None:
        raise AttributeError(f"{type(module).__name__} has no method '{method}'")
    fn = getattr(fn, "__wrapped__", fn)
    args, kwargs = (inputs, {}) if not isinstance(inputs, dict) else ((), inputs)
    outer = current_context()
    if outer is not None and outer.module is module:
        raise RuntimeError(f"{module.path()} is already being called")
    outputs, collection = module._functional_call(fn, state, prng_key, is_training, args, kwargs)
    for name in drop_output_collections:
        setattr(collection, name, {})
    return outputs, collection


# The short name users and tests write.
F = functional
