"""The peer engines llama.cpp (llama-cpp-python) and mlx-lm against the goldens: every result is what their expectations
files say. The first llama.cpp run converts the checkpoints to GGUF (cached in conformance/_out/cache/)."""

from test_conformance import run_quietly

from conformance.engines.llama_cpp import with_mrope_section


def test_llama_cpp_has_no_unexpected_result(capsys):
    results, code, out = run_quietly("llama_cpp", capsys)
    assert code == 0, out
    # llama.cpp's own rollback (n_rs_seq snapshots, llama_memory_seq_rm) commits every accept count correctly
    rolled_back = [f"spec-tiny-mtp-greedy-accept{k}-per-position" for k in range(5)]
    rolled_back += ["spec-tiny-moe-greedy-accept2-per-position", "spec-tiny-multimodal-greedy-accept2-per-position"]
    assert all(results[n].status == "PASS" for n in rolled_back)
    assert "no tape of delta-rule updates" in results["spec-tiny-mtp-greedy-accept2-replay"].note
    assert "check_tensor_dims" in results["model-tiny-odd-prefill-T70"].details[0]    # the recorded reason, not another


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
