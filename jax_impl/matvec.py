"""Products of a few activation rows with a weight matrix, x (..., K) @ W (K, N): decode's and verify's matrix work,
and a batch's (batch.py: B requests' rows of a step, up to MAX_ROWS).

On a CPU with one JAX device these go to kernels/matvec.cc, a C++ kernel registered through jax.ffi that splits
W's rows over XLA's thread pool. XLA:CPU runs such small products on one core, and a decode step is almost only
these products, so without it jax_impl decodes at one core's memory bandwidth (about half of this 2-core machine's).
Everything else - prefill and training (more rows), bf16, GPU and TPU, meshes (XLA's dot, which the SPMD partitioner
splits), derivatives - takes XLA's dot.

The kernel is compiled on first use with the system's C++ compiler ($CXX, else c++) into a per-user cache. Without
a compiler, or with JAX_IMPL_MATVEC=xla in the environment (or --matvec xla on the command line), XLA's dot runs
and the results differ only in fp32 summation order.
"""

import ctypes
import functools
import hashlib
import math
import os
import platform
import subprocess
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from . import reference

SOURCE = Path(__file__).with_name("kernels") / "matvec.cc"
MAX_ROWS = 48         # decode, verify, and batches of them (batch.py). XLA's dot is 5-15% faster from about
#                       24 rows on this 2-core machine, but the kernel gives each row the bits of that row alone
MODES = ("auto", "xla")
mode = os.environ.get("JAX_IMPL_MATVEC", "auto")  # read when a function is traced


def checked_mode(value):  # -> value, one of MODES
    if value not in MODES:
        raise reference.UserError(f"--matvec / JAX_IMPL_MATVEC {value}: expected one of {', '.join(MODES)}")
    return value


def set_mode(value):
    """"auto" (the kernel where it applies) or "xla". Compiled programs are dropped, so every later call follows."""
    global mode
    if checked_mode(value) != mode:
        mode = value
        jax.clear_caches()


def cache_dir():
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qwen35-jax"


@functools.cache
def build():
    """Compile kernels/matvec.cc for this machine (cached by source, jax version and host) -> the library path."""
    compiler = os.environ.get("CXX", "c++")
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-pthread",
             f"-I{jax.ffi.include_dir()}"]
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, jax.__version__.encode(), platform.node().encode(),
                                     " ".join([compiler, *flags]).encode()])).hexdigest()[:16]
    library = cache_dir() / f"matvec-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([compiler, *flags, str(SOURCE), "-o", str(partial)], check=True, capture_output=True)
        partial.replace(library)  # atomic: concurrent first uses each compile, none reads a half-written file
    return library


@functools.cache
def kernel_registered():
    """Build and register the kernel once; False (with one warning) where it cannot be built."""
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode()[-500:] if isinstance(e, subprocess.CalledProcessError) else str(e)
        warnings.warn(f"jax_impl: the CPU matvec kernel ({SOURCE.name}) could not be built, XLA's dot runs "
                      f"instead (slower decoding on CPU): {detail}", stacklevel=3)
        return False
    jax.ffi.register_ffi_target("qwen35_matvec_f32", jax.ffi.pycapsule(library.qwen35_matvec_f32), platform="cpu")
    return True


def uses_kernel(x, w):
    return (checked_mode(mode) == "auto" and x.dtype == w.dtype == jnp.float32 and w.ndim == 2 and x.size > 0
            and math.prod(x.shape[:-1]) <= MAX_ROWS and jax.default_backend() == "cpu" and jax.device_count() == 1
            and kernel_registered())


def matmul(x, w, preferred_element_type=None):  # (..., K) @ (K, N) -> (..., N)
    return matmuls(x, w, preferred_element_type=preferred_element_type)[0]


def matmuls(x, *ws, preferred_element_type=None):  # (..., K) @ each (K, N_i) -> tuple of (..., N_i)
    """Products of one input with several matrices; the kernel does them in one call (one hand-off to the threads)."""
    if not all(uses_kernel(x, w) for w in ws):
        return tuple(jnp.matmul(x, w, preferred_element_type=preferred_element_type) for w in ws)
    return kernel_matmuls(x, ws)


@jax.custom_jvp
@jax.custom_batching.custom_vmap
def kernel_matmuls(x, ws):  # (..., K) fp32, tuple of (K, N_i) fp32 -> tuple of (..., N_i); at most MAX_ROWS rows
    rows = x.reshape(-1, x.shape[-1])
    outs = jax.ffi.ffi_call("qwen35_matvec_f32", [jax.ShapeDtypeStruct((rows.shape[0], w.shape[1]), w.dtype)
                                                  for w in ws])(rows, *ws)
    return tuple(out.reshape(*x.shape[:-1], w.shape[1]) for out, w in zip(outs, ws))


@kernel_matmuls.def_vmap
def kernel_matmuls_batched(axis_size, in_batched, x, ws):
    """Under vmap the batch becomes more rows (XLA's dot once past MAX_ROWS); batched matrices take XLA's dot."""
    x_batched, ws_batched = in_batched
    if any(ws_batched):
        x = x if x_batched else jnp.broadcast_to(x, (axis_size, *x.shape))
        ws = [w if batched else jnp.broadcast_to(w, (axis_size, *w.shape)) for w, batched in zip(ws, ws_batched)]
        return tuple(jnp.einsum("b...k,bkn->b...n", x, w) for w in ws), (True,) * len(ws)
    return matmuls(x, *ws), (x_batched,) * len(ws)


@kernel_matmuls.defjvp
def kernel_matmuls_jvp(primals, tangents):  # derivatives through XLA's dot: a product is linear in each factor
    (x, ws), (dx, dws) = primals, tangents
    return kernel_matmuls(x, ws), tuple(dx @ w + x @ dw for w, dw in zip(ws, dws))
