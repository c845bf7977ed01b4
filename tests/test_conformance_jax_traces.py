"""jax_impl's batched serving path against the serving traces (a file of its own, so that a test worker runs it
beside the other jax cases): each batch's rows in one call of jax_impl.batch's step, in the trace's number of slots,
released slots reused; a trace with drafts once per rollback strategy."""

import reference as R
from conformance.format import case_dirs
from test_conformance import run_quietly


def test_jax_passes_every_serving_trace(capsys):
    results, code, out = run_quietly("jax", capsys, pattern="^trace-")
    assert code == 0, out
    assert {r.status for r in results.values()} == {"PASS"}
    assert {name.split("@")[0] for name in results} == {folder.name for folder in case_dirs()
                                                        if folder.name.startswith("trace-")}
    assert {name.split("@")[1] for name in results if "@" in name} == set(R.ROLLBACK_STRATEGIES)
