"""Tensor parallelism over one mesh axis, "tp": attention and DeltaNet heads, FFN width, the experts' FFN width and
the vocabulary are split across devices; the DeltaNet state by value head, the KV cache by KV head. An axis that
does not divide evenly stays replicated (always correct, only less parallel). XLA's SPMD partitioner inserts the
collectives; the math is unchanged, so N devices give the tokens of one up to fp32 reduction order.

Multi-host: call initialize_distributed on every process first; the mesh then spans every process's devices,
host arrays go in through `put` (each process passes the same full array, keeps its own shards) and replicated
results come out through `fetch`.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import reference

AttnState, DeltaState, State = reference.AttnState, reference.DeltaState, reference.State  # the spec's types

TP = "tp"

# The split axis of each weight, by its checkpoint name (the last key, or "experts.<key>" for fused experts), in
# the layout weights.py gives it: 2-D matrices transposed to (in, out).
PARAM_AXES = {
    "embed_tokens": 0, "lm_head": 1,                                                      # vocab
    "in_proj_qkv": 1, "in_proj_z": 1, "in_proj_b": 1, "in_proj_a": 1, "conv1d": 0,        # DeltaNet channels/heads
    "dt_bias": 0, "A_log": 0, "out_proj": 0,
    "q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 0,                                   # attention heads
    "gate_proj": 1, "up_proj": 1, "down_proj": 0,                                         # FFN width
    "experts.gate_up_proj": 1, "experts.down_proj": 2,                                    # experts' FFN width
}


def make_mesh(devices=None):
    """A 1-D "tp" mesh over the first `devices` devices (all of them by default, every process's on multi-host)."""
    available = jax.devices()
    count = len(available) if devices is None else devices
    if not 1 <= count <= len(available):
        raise reference.UserError(f"--devices {count}: must be in [1, {len(available)}] (the devices JAX sees)")
    return Mesh(np.array(available[:count]), (TP,))


def initialize_distributed(coordinator=None, num_processes=None, process_id=None):
    """Join a multi-host run (jax.distributed); with no arguments JAX reads them from the cluster environment."""
    jax.distributed.initialize(coordinator, num_processes, process_id)


def split(mesh, shape, axis):
    """NamedSharding splitting `axis` of `shape` over "tp" if it divides evenly, else replicated."""
    spec = [None] * len(shape)
    if axis is not None and shape[axis] % mesh.shape[TP] == 0:
        spec[axis] = TP
    return NamedSharding(mesh, PartitionSpec(*spec))


def param_sharding(mesh, path, shape):
    names = [getattr(p, "key", None) for p in path]
    name = "experts." + names[-1] if len(names) > 1 and names[-2] == "experts" else names[-1]
    return split(mesh, shape, PARAM_AXES.get(name))


def state_shardings(mesh, state, batched=False):
    """DeltaNet S (Hv, Dk, Dv) by value head, conv window (W-1, C) by channel, KV cache (Hkv, ...) by KV head;
    batched: after a leading slot axis (jax_impl.batch), which stays whole."""
    b = int(batched)
    layers = tuple(DeltaState(split(mesh, s.conv.shape, 1 + b), split(mesh, s.S.shape, b))
                   if isinstance(s, DeltaState) else AttnState(split(mesh, s.k.shape, b), split(mesh, s.v.shape, b))
                   for s in state.layers)
    return State(layers, NamedSharding(mesh, PartitionSpec()))


def constrain_state(state, mesh):
    """Pin a state's layout inside jit (a no-op without a mesh)."""
    return state if mesh is None else jax.lax.with_sharding_constraint(state, state_shardings(mesh, state))


def put(x, sharding=None):
    """Host array -> device array; with a sharding, each process uploads only its own shards."""
    x = np.asarray(x)
    if sharding is None:
        return jax.device_put(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def replicated(mesh):
    return None if mesh is None else NamedSharding(mesh, PartitionSpec())


def fetch(x):
    """A replicated device array -> numpy, also when other processes hold some of its copies."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))
