"""matplotlib is an optional extra (`pip install -e ".[plots]"`): the one place that imports it, for the training
loss curve (weights/train.py) and the benchmarks' plots (bench/). It sits here, below bench, which uses weights/."""

import sys


def pyplot():
    """matplotlib.pyplot on the headless Agg backend, or None, with a note on stderr, when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return None
    return plt
