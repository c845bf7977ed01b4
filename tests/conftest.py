import os
from functools import lru_cache
from pathlib import Path

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
