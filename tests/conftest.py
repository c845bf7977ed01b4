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
