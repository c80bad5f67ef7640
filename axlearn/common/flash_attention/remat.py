"""`policy`: the remat policy that saves the flash-attention kernel's outputs.

Its backward pass needs the context and the softmax statistics; saved, the kernel's
forward is not run again in the backward pass. On our stack the kernel is cuDNN's
(`jax.nn.dot_product_attention(implementation='cudnn')`); the XLA path has no kernel, so
the policy saves nothing there.
"""

# pylint: disable-next=protected-access
from axlearn.common.attention import _CUDNN_ATTENTION_FORWARD
from axlearn.common.config import register_configurable


@register_configurable
def policy(prim, *args, **params) -> bool:
    """True (save) for the outputs of the flash-attention forward kernel."""
    del args, params
    return getattr(prim, "name", None) in _CUDNN_ATTENTION_FORWARD
