"""check-server's near-tie margin and logprob tolerance (tolerances.json "server") against the rounding measured on
the shipped checkpoints (its "measured" record, written by `python -m conformance.make.server_margin --write`): every
declared value covers its precision's measured figures with the stated safety factor. (Remeasuring in a test costs
too much: compiling jax_impl's bf16 decode of the default model alone took 6 to 20 s here.)"""

import pytest

from conformance import check_server as cs
from conformance.make import server_margin as sm

RECORD = cs.RULES["measured"]


def test_the_record_names_its_command_and_covers_every_declared_precision():
    assert RECORD["command"].startswith(sm.COMMAND) and RECORD["safety"] == sm.SAFETY
    assert set(RECORD["figures"]) == set(cs.RULES["greedy_margin"]) == set(cs.RULES["logprob_atol"])
    for dtype, names in sm.MEASURED.items():
        assert set(RECORD["figures"][dtype]) == set(names)
        for figures in RECORD["figures"][dtype].values():
            assert figures["positions"] > 10_000 and figures["requests"] >= 100


@pytest.mark.parametrize("dtype", sorted(sm.MEASURED))
def test_the_declared_margin_and_tolerance_cover_the_measured_rounding(dtype):
    margin, atol = sm.required(RECORD["figures"][dtype])
    assert cs.RULES["greedy_margin"][dtype] >= margin, (dtype, margin)
    assert cs.RULES["logprob_atol"][dtype] >= atol, (dtype, atol)
    # the rule can fail: a deviation past half the margin over the safety factor needs more than the declared one
    louder = {"x": dict(RECORD["figures"][dtype]["default"],
                        argmax_deviation=cs.RULES["greedy_margin"][dtype] / sm.SAFETY / 2 * 1.01)}
    assert sm.required(louder)[0] > cs.RULES["greedy_margin"][dtype]

