"""check-server's near-tie margin and logprob tolerance (tolerances.json "server") against the rounding measured on
the shipped checkpoints (its "measured" record, written by `python -m conformance.make.server_margin --write`): every
declared value covers its precision's measured figures with the stated safety factor, and a fresh measurement of one
scenario request in bfloat16 on the trained default model stays within what the record says."""

import numpy as np
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


def test_a_fresh_bf16_measurement_is_within_the_record():
    spec = cs.Spec(sm.R.DEFAULT_MODEL)
    prompt = cs.build_prompt([{"seed": 1, "length": 12}], spec.cfg.vocab_size, set(spec.cfg.eos_token_id))
    engine = sm.Engine(spec.params, spec.cfg, "bfloat16", 64)
    seq, decoded = engine.decode(prompt, 24)
    fresh = sm.compare(decoded, spec.logits(seq))
    recorded = RECORD["figures"]["bfloat16"]["default"]
    assert fresh["positions"] == 36 and np.isfinite(fresh["argmax_deviation"])
    for key in ("argmax_deviation", "logit_deviation", "logprob_deviation", "flip_gap"):
        assert fresh[key] <= recorded[key], (key, fresh[key], recorded[key])
