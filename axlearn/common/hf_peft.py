"""LoRA adapters of a Llama-shaped model in and out of PEFT's format.

A PEFT adapter directory (what `peft.PeftModel.save_pretrained` writes and
`peft.PeftModel.from_pretrained` loads onto a transformers LlamaForCausalLM) holds:

    adapter_config.json          peft_type LORA, r, lora_alpha, lora_dropout, target_modules
    adapter_model.safetensors    per adapted module, e.g. for layer i's query projection:
        base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [r, in]
        base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [out, r]

PEFT computes W x + (lora_alpha / r) B A x, as our LoRA layers do with
`lora_down` = A (transposed, or reshaped to heads) and `lora_up` = B. Our LoRA layers map
to PEFT's Llama module names as:

    .../attention/i_proj/i_proj (LoraFusedQKVLinear)  self_attn.{q,k,v}_proj (enabled ones)
    .../attention/o_proj (LoraMultiheadOutputLinear)  self_attn.o_proj
    .../feed_forward/linear1_0, linear1_1, linear2     mlp.gate_proj, mlp.up_proj, mlp.down_proj

Reading an adapter checks it against the model: the same target modules, rank and
alpha, every tensor present with its shape and no others, and none of PEFT's variants
we do not compute (DoRA, rsLoRA, per-module rank or alpha patterns, trained biases);
a mismatch is a ConfigError naming the file.
"""

import os
import re
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np

from axlearn.common import hf_checkpoint, lora
from axlearn.common.config import ConfigError
from axlearn.common.module import Module
from axlearn.common.utils import flatten_with_paths, unflatten_paths

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers"
_LAYER = re.compile(r"^decoder/transformer/(?:repeat/layer|layer(\d+))/(.*)$")
_ATTENTION = "self_attention/attention/"
# Our path inside a transformer layer -> PEFT's module name (fused QKV: three names).
_MODULES = {
    f"{_ATTENTION}i_proj/i_proj/": None,
    f"{_ATTENTION}o_proj/": "self_attn.o_proj",
    "feed_forward/linear1_0/": "mlp.gate_proj",
    "feed_forward/linear1_1/": "mlp.up_proj",
    "feed_forward/linear2/": "mlp.down_proj",
}
_QKV_MODULES = dict(query="self_attn.q_proj", key="self_attn.k_proj", value="self_attn.v_proj")


def _check_llama_path(path: str) -> re.Match:
    match = _LAYER.match(path)
    if match is None or match.group(2) not in _MODULES:
        raise ConfigError(
            f"The LoRA layer at {path.rstrip('/')} has no PEFT Llama module name; PEFT names "
            "the seven linear maps of a Llama layer"
        )
    return match


def _layers(path: str, module: Module, sub: Any, num_layers: int) -> Iterator[tuple[int, Any]]:
    """(layer index, the LoRA layer's parameters of that layer) for a LoRA layer at `path`."""
    del module
    match = _check_llama_path(path)
    if match.group(1) is not None:
        yield int(match.group(1)), sub
        return
    adapter = {"adapter": sub["adapter"]}  # Only the adapter is read: no slices of the base.
    for i in range(num_layers):  # Stacked layers: a leading axis of num_layers.
        yield i, _index(adapter, i)


def _index(tree: Any, i: int) -> Any:
    if isinstance(tree, dict):
        return {key: _index(value, i) for key, value in tree.items()}
    return tree[i]


def _module_tensors(module: Module, sub: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{PEFT module name suffix or qkv output: (A [r, in], B [out, r])} of one layer."""
    down = np.asarray(sub["adapter"]["lora_down"]["weight"], np.float32)
    up = np.asarray(sub["adapter"]["lora_up"]["weight"], np.float32)
    if isinstance(module, lora.LoraLinear):  # down [in, r], up [r, out]
        return {"": (down.T, up.T)}
    if isinstance(module, lora.LoraMultiheadOutputLinear):  # down [r, N, H], up [r, D]
        return {"": (down.reshape(down.shape[0], -1), up.T)}
    # Fused: down [D, s, r], up [r, heads, H].
    tensors, start = {}, 0
    for j, (name, count) in enumerate(
        zip(module.adapter.enabled, module.adapter.lora_up.config.head_counts)
    ):
        part = up[:, start : start + count, :]
        tensors[name] = (down[:, j, :].T, part.reshape(part.shape[0], -1).T)
        start += count
    return tensors


def _peft_names(path: str, key: str) -> str:
    inner = _LAYER.match(path).group(2)
    return _QKV_MODULES[key] if _MODULES[inner] is None else _MODULES[inner]


def _num_layers(model: Module) -> int:
    return model.config.decoder.transformer.num_layers


def adapter_settings(model: Module) -> dict[str, Any]:
    """{'r', 'lora_alpha', 'lora_dropout', 'target_modules'} of the model's adapters; a
    ConfigError if they differ between layers (PEFT's patterns are not written)."""
    settings, names = set(), set()
    for path, module, _ in lora.lora_modules(model, _param_tree(model)):
        cfg = module.adapter.config
        settings.add((cfg.rank, float(cfg.alpha), float(cfg.dropout.rate or 0.0)))
        _check_llama_path(path)
        keys = module.adapter.enabled if isinstance(module, lora.LoraFusedQKVLinear) else [""]
        names.update(_peft_names(path, key) for key in keys)
    if not settings:
        raise ConfigError("The model has no LoRA layers")
    if len(settings) > 1:
        raise ConfigError(
            f"The model's adapters differ in (rank, alpha, dropout): {sorted(settings)}; a PEFT "
            "adapter directory holds one setting"
        )
    rank, alpha, dropout = settings.pop()
    return dict(
        r=rank, lora_alpha=alpha, lora_dropout=dropout,
        target_modules=sorted(name.split(".")[-1] for name in names),
    )


def _param_tree(model: Module) -> Any:
    return model.create_parameter_specs_recursively()


def peft_tensors(model: Module, params: Any) -> dict[str, np.ndarray]:
    """The adapter tensors of `params` (the model's parameters) under PEFT's names."""
    tensors = {}
    for path, module, sub in lora.lora_modules(model, params):
        for i, layer in _layers(path, module, sub, _num_layers(model)):
            for key, (a, b) in _module_tensors(module, layer).items():
                name = f"{_PREFIX}.{i}.{_peft_names(path, key)}"
                tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a)
                tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b)
    return tensors


def adapter_config(model: Module, *, base_model: Optional[str] = None) -> dict[str, Any]:
    """The adapter_config.json of the model's adapters."""
    return dict(
        adapter_settings(model),
        peft_type="LORA",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
        bias="none",
        fan_in_fan_out=False,
        inference_mode=True,
        init_lora_weights=True,
        modules_to_save=None,
        use_rslora=False,
        use_dora=False,
        layers_to_transform=None,
        layers_pattern=None,
        rank_pattern={},
        alpha_pattern={},
    )


def write_adapter(
    directory: str, model: Module, params: Any, *, base_model: Optional[str] = None
) -> list[str]:
    """Writes the adapters of `params` as a PEFT adapter directory; returns the names."""
    config = adapter_config(model, base_model=base_model)
    tensors = peft_tensors(model, params)
    if os.path.isdir(directory) and os.path.exists(os.path.join(directory, ADAPTER_WEIGHTS_FILE)):
        raise ConfigError(f"{directory} already holds {ADAPTER_WEIGHTS_FILE}: export into a new "
                          "directory")
    os.makedirs(directory, exist_ok=True)
    hf_checkpoint._safetensors()  # pylint: disable=protected-access
    from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    hf_checkpoint.write_json(os.path.join(directory, ADAPTER_CONFIG_FILE), config)
    return [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE]


# Settings of PEFT's LoRA variants that change the function; each must be as here.
_PLAIN = dict(
    peft_type="LORA", bias="none", fan_in_fan_out=False, use_rslora=False, use_dora=False,
    modules_to_save=None, layers_to_transform=None, rank_pattern={}, alpha_pattern={},
)


def check_adapter_config(path: str, config: dict[str, Any], model: Module) -> None:
    """Refuses (ConfigError naming `path`) an adapter config that is not the model's."""
    for key, plain in _PLAIN.items():
        value = config.get(key, plain)
        if value != plain and not (plain in ({}, None) and not value):
            raise ConfigError(f"{path}: {key} is {value!r}; only plain LoRA ({plain!r}) is read")
    want = adapter_settings(model)
    targets = config.get("target_modules")
    if not isinstance(targets, (list, tuple)) or sorted(targets) != want["target_modules"]:
        raise ConfigError(
            f"{path}: target_modules {targets!r} differ from the model's adapters "
            f"{want['target_modules']}"
        )
    for key in ("r", "lora_alpha"):
        if config.get(key) != want[key]:
            raise ConfigError(f"{path}: {key} is {config.get(key)!r}, the model's is {want[key]!r}")


def _adapter_shapes(model: Module, param_specs: Any) -> dict[str, tuple[int, ...]]:
    """{PEFT tensor name: shape} of the model's adapters."""
    base_paths = lora.base_param_paths(model, param_specs)
    adapters = {
        path: np.zeros(tuple(spec.shape), np.float32)
        for path, spec in flatten_with_paths(param_specs, is_leaf=lambda x: hasattr(x, "shape"))
        if base_paths[path] is None
    }
    return {name: t.shape for name, t in peft_tensors(model, unflatten_paths(adapters)).items()}


def check_adapter(directory: str, model: Module, param_specs: Any) -> None:
    """Refuses (ConfigError naming the file) a PEFT adapter directory that is not for the
    model: its config (`check_adapter_config`), then its tensors' names and shapes, read
    from the safetensors header alone."""
    config_path = os.path.join(directory, ADAPTER_CONFIG_FILE)
    weights_path = os.path.join(directory, ADAPTER_WEIGHTS_FILE)
    check_adapter_config(config_path, hf_checkpoint.read_json(config_path), model)
    shapes = {name: tuple(shape) for name, shape in _read_shapes(weights_path).items()}
    expected = _adapter_shapes(model, param_specs)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise ConfigError(
            f"{weights_path}: tensors missing: {_some(missing)}; not in the model: "
            f"{_some(unexpected)}"
        )
    for name, shape in expected.items():
        if shapes[name] != tuple(shape):
            raise ConfigError(
                f"{weights_path}: {name} has shape {shapes[name]}, the model's is {tuple(shape)}"
            )


def _some(names: list[str]) -> str:
    return (", ".join(names[:3]) + (" ..." if len(names) > 3 else "")) if names else "none"


def _open(weights_path: str) -> Any:
    if not os.path.isfile(weights_path):
        raise ConfigError(f"{weights_path}: no such file")
    hf_checkpoint._safetensors()  # pylint: disable=protected-access
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel

    try:
        return safe_open(weights_path, framework="numpy")
    except Exception as e:  # pylint: disable=broad-except
        raise ConfigError(f"{weights_path}: unreadable safetensors ({e})") from None


def _peft_name(name: str) -> str:
    # PEFT may save under the adapter's name ('...lora_A.default.weight').
    return name.replace(".default.weight", ".weight")


def _read_shapes(weights_path: str) -> dict[str, list[int]]:
    with _open(weights_path) as f:
        return {_peft_name(name): f.get_slice(name).get_shape() for name in f.keys()}


def read_adapter(directory: str, model: Module, param_specs: Any) -> dict[str, np.ndarray]:
    """{our adapter parameter path: float32 array} from a PEFT adapter directory, checked
    against the model first (`check_adapter`)."""
    check_adapter(directory, model, param_specs)
    weights_path = os.path.join(directory, ADAPTER_WEIGHTS_FILE)
    try:
        with _open(weights_path) as f:
            tensors = {_peft_name(name): f.get_tensor(name) for name in f.keys()}
    except ConfigError:
        raise
    except Exception as e:  # pylint: disable=broad-except
        raise ConfigError(f"{weights_path}: unreadable safetensors ({e})") from None
    return adapter_params_from_peft(model, param_specs, tensors)


def adapter_params_from_peft(
    model: Module, param_specs: Any, tensors: dict[str, Any]
) -> dict[str, np.ndarray]:
    """{our adapter parameter path: float32 array} from PEFT-named tensors (numpy or
    torch), which must hold every adapter tensor of the model in PEFT's shapes."""
    tensors = {name: np.asarray(_numpy(value), np.float32) for name, value in tensors.items()}
    out = {}
    num_layers = _num_layers(model)
    for path, module, sub in lora.lora_modules(model, param_specs):
        down_shape = tuple(sub["adapter"]["lora_down"]["weight"].shape)
        up_shape = tuple(sub["adapter"]["lora_up"]["weight"].shape)
        stacked = int(_check_llama_path(path).group(1) is None)
        downs, ups = [], []
        match = _check_llama_path(path)
        for i in range(num_layers) if stacked else [int(match.group(1))]:
            d, u = _from_peft(path, module, i, tensors, down_shape[stacked:], up_shape[stacked:])
            downs.append(d)
            ups.append(u)
        out[f"{path}adapter/lora_down/weight"] = np.stack(downs) if stacked else downs[0]
        out[f"{path}adapter/lora_up/weight"] = np.stack(ups) if stacked else ups[0]
    return out


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # A torch tensor.
        return value.detach().float().cpu().numpy()
    return np.asarray(value)


def _from_peft(path, module, i, tensors, down_shape, up_shape):
    def pair(key):
        name = f"{_PREFIX}.{i}.{_peft_names(path, key)}"
        return tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]

    if isinstance(module, lora.LoraLinear):
        a, b = pair("")
        return a.T, b.T
    if isinstance(module, lora.LoraMultiheadOutputLinear):
        a, b = pair("")
        return a.reshape(down_shape), b.T
    downs, ups = [], []
    head_dim = up_shape[-1]
    for name in module.adapter.enabled:
        a, b = pair(name)
        downs.append(a.T)  # [D, r]
        ups.append(b.T.reshape(b.shape[1], -1, head_dim))  # [r, heads, H]
    return np.stack(downs, axis=1), np.concatenate(ups, axis=1)
