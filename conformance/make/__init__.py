"""The goldens' generator and the suite's proofs of power: tools of a clone of the repository, not in the installed kit.

    python -m conformance generate [--check]     build.py: rebuild ../cases from reference.py (golden.py, traces.py
                                                 and draws.py build the cases, the serving traces, the statistical pack)
    python -m conformance.make.mutants           mutants.py: the realistic bugs the serving traces must catch

The checker in ../ (runner, format, engines) never imports this package.
"""
