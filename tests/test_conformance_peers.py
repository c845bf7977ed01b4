"""The peer engines llama.cpp (llama-cpp-python) and mlx-lm against the goldens: every result is what their expectations
files say. The first llama.cpp run converts the checkpoints to GGUF (cached in conformance/_out/cache/)."""

import llama_cpp
import numpy as np
from test_conformance import run_quietly

import reference as R
from conformance.make import golden as G
from conformance.engines import llama_cpp as adapter
from conformance.engines.llama_cpp import LlamaCpp, ServedTrace, with_mrope_section
from conformance.format import CASES_DIR, TOLERANCES, checkpoint_dir, read_manifest
from conformance.runner import select_cases


def test_llama_cpp_has_no_unexpected_result(capsys):
    results, code, out = run_quietly("llama_cpp", capsys)
    assert code == 0, out
    # llama.cpp's own rollback (n_rs_seq snapshots, llama_memory_seq_rm) commits every accept count correctly
    rolled_back = [f"spec-tiny-mtp-greedy-accept{k}-per-position" for k in range(5)]
    rolled_back += ["spec-tiny-moe-greedy-accept2-per-position", "spec-tiny-multimodal-greedy-accept2-per-position"]
    assert all(results[n].status == "PASS" for n in rolled_back)
    assert "no tape of delta-rule updates" in results["spec-tiny-mtp-greedy-accept2-replay"].note
    assert "check_tensor_dims" in results["model-tiny-odd-prefill-T70"].details[0]    # the recorded reason, not another
    # serving traces, each batch one llama_decode over several sequences of one context: every trace whose rows it can
    # decide runs, under per-position rollback, and passes (the long one, slot reuse), but for the sampled plain rows,
    # which its sampler order (the temperature after top-k and top-p) draws otherwise; no tree rows (one state per
    # sequence: a tree would need one per branch)
    runnable = {meta["name"] for _, meta in select_cases(CASES_DIR, "^trace-")
                if not {"accept:sampling", "trace:tree"} & set(meta["features"])
                and meta["attrs"].get("rollback") != "replay"}
    ran = {name for name, r in results.items() if name.startswith("trace-") and r.status != "SKIP"}
    assert ran == runnable
    assert {name for name in ran if results[name].status != "PASS"} == {"trace-plain-decoding-tiny-draft-sampling"}
    assert {f"trace-{name}@per-position" for name in (
        "long-context-tiny-dense-greedy", "release-and-reuse-tiny-draft-greedy", "mixed-accepts-tiny-moe-greedy",
        "prefix-cache-on-trained-model-default-greedy")} <= ran
    assert "trace-plain-decoding-tiny-draft-sampling" in ran
    skipped = {name for name, r in results.items() if name.startswith("trace-")} - ran
    assert all("no tape of delta-rule updates" in results[name].note for name in skipped if name.endswith("@replay"))
    assert all("not speculative sampling" in results[name].note or "a tree would need one sequence per branch"
               in results[name].note for name in skipped if "@replay" not in name)
    assert all("lacks tree, trace:tree" in results[name].note for name in skipped if "trace-tree-rows-tiny" in name)


def test_mlx_has_no_unexpected_result(capsys):
    results, code, out = run_quietly("mlx", capsys)
    assert code == 0, out
    assert {r.status for n, r in results.items() if n.startswith("spec-")} == {"SKIP"}
    # mlx exposes its caches, so the forward cases compare the state too
    assert "not compared" not in results["model-tiny-mtp-extend"].note
    assert "parameters not in model" in results["model-tiny-moe-per-expert-mtp-greedy"].details[0]


def test_the_mrope_section_written_for_llama_cpp_has_qwen35s_layout():
    """For the real model's 32 rotary pairs the section the adapter writes is Qwen3.5's own [11, 11, 10]."""
    config = {"head_dim": 256, "rope_parameters": {"partial_rotary_factor": 0.25}}
    assert with_mrope_section(config)["rope_parameters"]["mrope_section"] == [11, 11, 10]


PROMPT = [50, 197, 163, 112, 121, 220, 9, 221, 49, 193, 27, 21]
VERIFIED, KEPT, NEXT = [128, 155, 248, 186, 161], 2, 139      # 5 tokens verified in one pass, the first 2 kept


def rolled_back(session):
    """A two-sequence trace context whose request "a" verified 5 tokens after PROMPT and kept the first 2."""
    served = ServedTrace(session, 2)
    served.start("a")
    served.decode([("a", PROMPT, 1)])
    served.decode([("a", VERIFIED, len(VERIFIED))])
    served.keep("a", len(PROMPT), KEPT)           # llama_memory_seq_rm(mem, 0, len(PROMPT) + KEPT, -1)
    return served


def next_logits(served, request):
    return served.decode([(request, [NEXT], 1)])[request][0]


def copy_by_sequence(served, source, request):
    """What the adapter does not do: the copy as llama_memory_seq_cp into the new request's sequence."""
    served.start(request)
    llama_cpp.llama_memory_seq_cp(served.context.memory, served.seq[source], served.seq[request], -1, -1)
    served.length[request] = served.length[source]


def test_llama_cpp_copies_a_rolled_back_sequence_with_the_state_before_the_rollback():
    """The finding "prefix-cache copies" in expectations/llama_cpp.json: llama_memory_seq_cp right after a partial
    rollback gives the copy the DeltaNet state after every verified token (the pending snapshot index stays with the
    source), beside the attention KV of the kept positions. The rolled-back sequence itself, a copy through
    llama_state_seq_get/set_data_ext (the adapter's prefix cache) and a seq_cp copy without a pending rollback are
    right."""
    session = LlamaCpp().load(checkpoint_dir("tiny-draft"))
    cfg, params = G.model("tiny-draft")
    kept = PROMPT + VERIFIED[:KEPT]
    right = R.forward(params, cfg, np.array(kept + [NEXT]), R.empty_state(cfg))[0][-1]
    short = R.forward(params, cfg, np.array(kept), R.empty_state(cfg))[2]
    full = R.forward(params, cfg, np.array(PROMPT + VERIFIED), R.empty_state(cfg))[2]
    stale = R.State(tuple(f if isinstance(f, R.DeltaState) else s for f, s in zip(full.layers, short.layers)),
                    short.length)
    wrong = R.forward(params, cfg, np.array([NEXT]), stale)[0][-1]
    atol = TOLERANCES["logits"]["atol"]
    assert np.abs(right - wrong).max() > 100 * atol        # the two are far apart: the test tells them apart

    def off(logits, expected):
        return np.abs(logits - expected).max()

    served = rolled_back(session)
    copy_by_sequence(served, "a", "b")
    assert off(next_logits(served, "b"), wrong) <= atol            # the finding
    assert off(next_logits(served, "a"), right) <= atol            # the source is rolled back
    served.close()
    served = rolled_back(session)
    served.restore("b", served.save("a"))
    assert off(next_logits(served, "b"), right) <= atol
    served.close()
    served = ServedTrace(session, 2)
    served.start("a")
    served.decode([("a", kept, 1)])
    copy_by_sequence(served, "a", "b")
    assert off(next_logits(served, "b"), right) <= atol
    served.close()


class SequenceCopies(ServedTrace):
    """The trace context with prefix-cache entries as llama_memory_seq_cp into a spare sequence each."""
    SPARE = 4

    def __init__(self, session, slots):
        super().__init__(session, slots + self.SPARE)
        self.free, self.spare = self.free[:slots], self.free[slots:]

    def save(self, request):
        spare = self.spare.pop(0)
        llama_cpp.llama_memory_seq_cp(self.context.memory, self.seq[request], spare, -1, -1)
        return spare, self.length[request]

    def restore(self, request, entry):
        self.start(request)
        llama_cpp.llama_memory_seq_cp(self.context.memory, entry[0], self.seq[request], -1, -1)
        self.length[request] = entry[1]


def test_the_traces_catch_llama_cpp_copying_a_rolled_back_sequence(capsys, monkeypatch):
    """With prefix-cache entries as sequence copies, the traces whose entry is written right after a partial accept
    fail at the restored request; those whose entries follow a prefill pass."""
    monkeypatch.setattr(adapter, "ServedTrace", SequenceCopies)
    results, code, out = run_quietly("llama_cpp", capsys, pattern="^trace-(same-prompt-diverge|snapshot-after-"
                                     "partial-accept|stop-inside-accepted|restore-at-chunk-boundary|plain-decoding)-"
                                     "tiny-draft-greedy")
    assert code == 1
    failed = {name for name, r in results.items() if r.status == "FAIL"}
    assert failed == {f"trace-{scenario}-tiny-draft-greedy@per-position" for scenario in
                      ("same-prompt-diverge", "snapshot-after-partial-accept", "stop-inside-accepted")}, out
    assert {results[name].status for name in ("trace-restore-at-chunk-boundary-tiny-draft-greedy@per-position",
                                              "trace-plain-decoding-tiny-draft-greedy")} == {"PASS"}
    for name in failed:     # the first wrong output is a verify row of a request restored from an entry
        batches = read_manifest(CASES_DIR / name.split("@")[0])["attrs"]["batches"]
        restored = {step["request"] for batch in batches for step in batch if step["op"] == "restore"}
        b, s = (int(part[1:]) for part in results[name].details[0].split(".")[:2])
        assert batches[b][s]["request"] in restored, results[name].details[0]


def test_llama_cpp_traces_reuse_the_lowest_released_sequence():
    served = ServedTrace(LlamaCpp().load(checkpoint_dir("tiny-draft")), 3)
    for request in "abc":
        served.start(request)
    served.release("b")
    served.release("a")
    served.start("d")
    served.start("e")
    assert (served.seq["d"], served.seq["e"], served.seq["c"]) == (0, 1, 2)
    served.close()


def test_llama_cpp_in_the_statistical_pack(capsys):
    """llama.cpp drawing with its own generator: its sampler order (temperature last) and its acceptance (q never
    read) are flagged; where they coincide with the spec (top-k only, a one-hot q) it passes."""
    results, code, out = run_quietly("llama_cpp", capsys, statistical=True)
    assert code == 0, out
    assert {n for n, r in results.items() if r.status == "PASS"} == {"draws-sampling-t0.6-topk20",
                                                                      "draws-spec-one-hot-q"}


def test_mlx_in_the_statistical_pack(capsys):
    results, code, out = run_quietly("mlx", capsys, statistical=True)
    assert code == 0, out
    assert results["draws-sampling-t0.6-topk20"].status == "PASS"
