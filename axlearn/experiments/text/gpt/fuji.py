"""Names from AXLearn's Fuji experiments that its golden configs refer to: the remat
policies its mesh rules choose by name (`remat_spec['policy']: '...fuji.<policy>'`)."""

import jax

from axlearn.common.utils import save_and_offload_only_these_names_regex

_OFFLOAD_DOTS = jax.checkpoint_policies.offload_dot_with_no_batch_dims(
    offload_src="device", offload_dst="pinned_host"
)
_OFFLOAD_ATTENTION_PROJ = save_and_offload_only_these_names_regex(
    names_which_can_be_saved=None,
    names_which_can_be_offloaded=r".*[kqv]_proj",
    offload_src="device",
    offload_dst="pinned_host",
)


def offload_dots_saveable_policy(prim, *args, **params):
    """Remat policy: offload the outputs of matmuls without batch dimensions to host memory
    and recompute everything else."""
    return _OFFLOAD_DOTS(prim, *args, **params)


def offload_attention_proj_policy(prim, *args, **params):
    """Remat policy: offload the q/k/v projections to host memory, recompute the rest."""
    return _OFFLOAD_ATTENTION_PROJ(prim, *args, **params)
