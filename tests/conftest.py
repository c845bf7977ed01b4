import os
from functools import lru_cache
from pathlib import Path

# One BLAS thread per pytest-xdist worker, as CI runs (.ci/run): worker processes and the tests' subprocesses inherit
# it, so that two workers on two cores do not oversubscribe them (with one thread per core each, a run on a busy
# machine took 37 minutes against CI's 11-16). Set before NumPy loads OpenBLAS; a value in the environment wins.
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

import numpy as np

import reference

# JAX on the CPU, whatever the machine has: tests must pass without an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent


@lru_cache(maxsize=None)
def model(name, dtype=np.float32):
    """A committed checkpoint in weights/, its weights cast to dtype (float64 shows what is rounding and what is not)."""
    cfg, params = reference.load_model(ROOT / "weights" / name)
    return cfg, reference.cast(params, dtype)


# The longest files first (tests/*.py, longest first, from a full run's --durations on 2 cores: 2026-12-04). Workers
# take whole files (--dist loadfile) in collection order as they finish the last; in alphabetical order the longest
# (llama-server's build and run, mlx-lm's server) came last, and one worker ran them alone for the run's last 6 of
# 13 minutes. Longest first is the classic schedule for this (LPT); the rest keep their order.
LONGEST_FIRST = ("test_llama_server.py", "test_conformance_jax.py", "test_check_server.py", "test_conformance_peers.py",
                 "test_conformance_jax_traces.py", "test_jax_serving.py", "test_mlx_server.py", "test_shaped.py",
                 "test_jax_self_speculative.py", "test_jax_generate.py", "test_jax_sharding.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
