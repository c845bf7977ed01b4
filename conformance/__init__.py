"""Conformance kit for Qwen3.5-class hybrid models and exact speculative decoding.

    python -m conformance list [--cases REGEX]     the cases, their kinds and features
    python -m conformance run --engine ENGINE [--cases REGEX] [--expectations FILE] [--report out.json]
    python -m conformance sample --engine ENGINE [--cases REGEX] [--expectations FILE] [--report out.json] [--seed S]
                                                   the statistical pack: the engine draws with its own random numbers
    python -m conformance serve --engine NAME      a Python adapter as a process engine (INTERPRETING.md section 8)
    python -m conformance check-server --url URL --model DIR [--scenarios REGEX] [--dialect NAME] [--report out.json]
                                                   a running server, black-box (INTERPRETING.md section 11)
    python -m conformance where                    the kit's paths (package, cases, expectations, examples), version
    python -m conformance generate [--check]       rebuild cases/ from reference.py (deterministic; in a clone)

What ships (the checker): runner.py, format.py (the case format), chisquare.py (the statistical pack's test), rules.py
(the wrong rules a decision must tell apart), protocol.py and adapter_server.py (the process protocol), engines/,
cases/, expectations/, tolerances.json; check_server.py, server_dialects.py and server_scenarios.json
(check-server). What makes the goldens, in a clone only: make/ (the generator and the suite's
proofs of power); nothing that ships imports it.

Installed from the wheel, this package is qwen35.conformance and the command is `qwen35-conformance`; the kit's
pytest plugin (pytest_plugin.py) runs the cases as an engine's own tests: `pytest --qwen35-engine ENGINE`.
INTERPRETING.md is the contract for engine authors and for readers of the goldens in other languages.
"""

import importlib

# In a clone of the repository this package and its siblings, reference.py (the spec) and jax_impl, are top-level;
# in the installed kit they are qwen35.conformance, qwen35.reference and qwen35.jax_impl (pyproject.toml). Modules
# here reach them through `sibling`, so both layouts run the same files.
KIT = __name__.rpartition(".")[0]


def sibling(name):
    """A module beside this package (reference, jax_impl, jax_impl.model) in either layout."""
    return importlib.import_module(f"{KIT}.{name}" if KIT else name)


reference = sibling("reference")
