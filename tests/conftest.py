import os
import sys
from pathlib import Path

# JAX on the CPU, whatever the machine has: tests must pass without an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
