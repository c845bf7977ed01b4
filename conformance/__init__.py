"""Conformance kit for Qwen3.5-class hybrid models and exact speculative decoding.

    python -m conformance generate                 rebuild cases/ from reference.py (deterministic)
    python -m conformance list [--cases REGEX]     the cases, their kinds and features
    python -m conformance run --engine NAME [--cases REGEX] [--report out.json]
    python -m conformance sample --engine NAME [--cases REGEX] [--report out.json] [--seed S]
                                                   the statistical pack: the engine draws with its own random numbers

INTERPRETING.md is the contract for engine authors and for readers of the goldens in other languages.
"""
