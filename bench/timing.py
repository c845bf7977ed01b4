"""The benchmarks' engine columns: each is a conformance adapter (conformance/engines/), timed by its timed_greedy.

Batch 1, greedy, EOS ignored; prefill (the prompt's forward and the first token) and decode (the other new_tokens - 1
tokens) are timed apart. jax_impl and transformers take `dtype` ("float32", "bfloat16") and run on the accelerator
when there is one (TAKES_DTYPE); reference.py and llama.cpp run fp32 on the CPU. An adapter's module is imported on
first use, so a missing peer fails only its column.
"""

import contextlib

from conformance.engines import get_engine

COLUMNS = ("reference", "jax", "jax-xla-dot", "llama.cpp", "transformers")
TAKES_DTYPE = {"jax", "jax-xla-dot", "transformers"}


def adapter(column, dtype="float32"):
    """The adapter behind a column. transformers runs as it usually is, not as the suite runs it: in `dtype`, on a
    GPU when there is one, with its default attention implementation."""
    if column in ("jax", "jax-xla-dot"):
        return get_engine("jax_bf16" if dtype == "bfloat16" else "jax")
    if column == "transformers":
        import torch
        from conformance.engines.transformers import Transformers
        return Transformers(dtype, "cuda" if torch.cuda.is_available() else "cpu", attention=None)
    return get_engine({"reference": "reference", "llama.cpp": "llama_cpp"}[column])


@contextlib.contextmanager
def matvec_mode(column):
    """jax-xla-dot is jax_impl with XLA's dot for decode's products too (--matvec xla): what the CPU matvec kernel
    adds."""
    if column != "jax-xla-dot":
        yield
        return
    from jax_impl import matvec
    previous = matvec.mode
    matvec.set_mode("xla")
    try:
        yield
    finally:
        matvec.set_mode(previous)


def best_of(repeats, run):
    """The fastest decode of `repeats` runs, with the first run's compile time (later runs reuse its executables)."""
    runs = [run() for _ in range(repeats)]
    return min(runs, key=lambda r: r.decode_s)._replace(compile_s=runs[0].compile_s)


def time_column(column, model_dir, prompt, new_tokens, dtype="float32", repeats=1):
    """Load the column's model once, then the best of `repeats` timed greedy runs -> conformance.engines.Timed.
    On a GPU transformers runs 3 tokens first: its first calls build kernels (triton, cuBLAS), not decode time."""
    engine = adapter(column, dtype)
    model = engine.load(model_dir)
    with matvec_mode(column):
        if column == "transformers" and engine.device == "cuda":
            engine.timed_greedy(model, prompt, 3)
        return best_of(repeats, lambda: engine.timed_greedy(model, prompt, new_tokens))
