"""python -m jax_impl.serve: the former name of python -m jax_impl.jsonl (the JSONL front end), kept so that
commands written for it still run."""

import sys

from .jsonl import main

if __name__ == "__main__":
    sys.exit(main())
