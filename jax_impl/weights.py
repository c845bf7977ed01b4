"""Weights: reference.load_model's nested dict (checkpoint names, strictly checked, fp32 numpy) -> jax arrays in
the chosen dtype, optionally sharded over a mesh.

Every 2-D matrix but the embedding is stored transposed, (in, out), and the model computes `matmul(x, W)` where
the reference writes `x @ W.T`: with (out, in) weights XLA:CPU transposes each matrix in memory on every call (the
decode step reads every weight once, so that tripled its memory traffic); the CPU matvec kernel (matvec.py) reads
the same layout. A tied lm_head becomes its own (D, V) copy of the embedding for the same reason.
"""

import jax
import jax.numpy as jnp
import numpy as np

from . import reference
from .sharding import param_sharding, put

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def transposed(path, ndim):
    """Whether jax_impl stores this weight transposed from the checkpoint: every 2-D matrix but the embedding."""
    return ndim == 2 and path[-1].key != "embed_tokens"


def to_jax(params, dtype="float32", mesh=None):
    """Numpy weights -> jax arrays of `dtype` ("float32" for conformance, "bfloat16" for GPU/TPU)."""
    if dtype not in DTYPES:
        raise reference.UserError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")

    def convert(path, x):
        if transposed(path, x.ndim):
            x = x.T
        sharding = None if mesh is None else param_sharding(mesh, path, x.shape)
        return put(np.ascontiguousarray(x, jnp.dtype(DTYPES[dtype])), sharding)
    return jax.tree_util.tree_map_with_path(convert, params)


def load(model_dir, dtype="float32", mesh=None):
    """Checkpoint directory -> (reference.Config, weights pytree)."""
    cfg, params = reference.load_model(model_dir)
    return cfg, to_jax(params, dtype, mesh)


def random_params(cfg, dtype="bfloat16", seed=0):
    """Random weights of cfg's shapes, MTP head included, made on the device in jax_impl's layout (normal, scale
    0.02): for timing published shapes whose checkpoints would take long to write and read. Not a model."""
    shapes = reference.nested_params({name: jax.ShapeDtypeStruct(shape, DTYPES[dtype])
                                      for name, shape in reference.checkpoint_shapes(cfg, with_mtp=True).items()})
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    made = [0.02 * jax.random.normal(key, spec.shape[::-1] if transposed(path, len(spec.shape)) else spec.shape,
                                     spec.dtype) for key, (path, spec) in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(tree, made)
