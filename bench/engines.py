"""Plain greedy decoding in each engine, timed the same way: fn(model_dir, prompt, new_tokens) -> Run.

Batch 1, greedy, EOS ignored; prefill (the prompt's forward and the first token) and decode (the remaining
new_tokens - 1 forwards) are timed apart. Peers are imported on first use, so a missing one fails only its column.
jax_impl and transformers take `dtype` ("float32", "bfloat16") and run on the accelerator when there is one
(TAKES_DTYPE); reference.py and llama.cpp always run fp32 on the CPU.
"""

import time
from typing import NamedTuple

import numpy as np

import reference as R


class Run(NamedTuple):
    tokens: list
    prefill_s: float
    decode_s: float
    compile_s: float = 0.0
    stats: dict = None          # jax_impl's generate stats (tokens per call, acceptance)

    @property
    def decode_tok_s(self):
        return (len(self.tokens) - 1) / self.decode_s


def reference_engine(model_dir, prompt, new_tokens):
    cfg, params = R.load_model(model_dir)
    cfg = R.replace(cfg, eos_token_id=())
    tokens, stats = R.generate(params, cfg, prompt, new_tokens, R.Sampling(), np.random.default_rng(0))
    return Run(tokens, stats["seconds"]["prefill"], stats["seconds"]["decode"])


def jax_engine(model_dir, prompt, new_tokens, dtype="float32", **spec):
    """jax_impl's on-device generate loop; spec: draft, draft_len, rollback. Compile time reported apart."""
    import jax_impl
    cfg, params = jax_impl.load(model_dir, dtype)
    cfg = R.replace(cfg, eos_token_id=())
    tokens, stats = jax_impl.generate(params, cfg, prompt, new_tokens, **spec)
    s = stats["seconds"]
    return Run(tokens, s["prefill"], s["decode"], s["compile"], stats)


def jax_xla_dot_engine(model_dir, prompt, new_tokens, dtype="float32"):
    """jax_impl with XLA's dot for decode's products too (--matvec xla): what the CPU matvec kernel adds."""
    from jax_impl import matvec
    previous = matvec.mode
    matvec.set_mode("xla")
    try:
        return jax_engine(model_dir, prompt, new_tokens, dtype)
    finally:
        matvec.set_mode(previous)


def transformers_engine(model_dir, prompt, new_tokens, dtype="float32"):
    """On a GPU, one short run first: its first calls build kernels (triton, cuBLAS), which is not decode time."""
    import torch
    from transformers import AutoModelForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()

    @torch.no_grad()
    def greedy(new_tokens):
        start = time.perf_counter()
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]      # int() waits for the device
        prefilled = time.perf_counter()
        while len(tokens) < new_tokens:
            out = model(torch.tensor([tokens[-1:]], device=device), past_key_values=out.past_key_values,
                        use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        return Run(tokens, prefilled - start, time.perf_counter() - prefilled)
    if device == "cuda":
        greedy(3)
    return greedy(new_tokens)


def llama_cpp_engine(model_dir, prompt, new_tokens):
    """llama-cpp-python on the checkpoint converted to an f32 GGUF (conformance's converter), f32 KV cache."""
    import llama_cpp
    from conformance.engines.llama_cpp import gguf_file
    # logits_all: without it llama-cpp-python 0.3.36 leaves the prompt's last row of `scores` zero (first token 0)
    llm = llama_cpp.Llama(str(gguf_file(model_dir)), n_ctx=len(prompt) + new_tokens + 8, n_batch=512, n_threads=2,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, logits_all=True,
                          verbose=False)
    start = time.perf_counter()
    llm.eval(prompt)
    tokens = [int(np.argmax(llm.scores[llm.n_tokens - 1]))]
    prefilled = time.perf_counter()
    while len(tokens) < new_tokens:
        llm.eval(tokens[-1:])
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    return Run(tokens, prefilled - start, time.perf_counter() - prefilled)


TAKES_DTYPE = {"jax", "jax-xla-dot", "transformers"}
ENGINES = {"reference": reference_engine, "jax": jax_engine, "jax-xla-dot": jax_xla_dot_engine,
           "llama.cpp": llama_cpp_engine, "transformers": transformers_engine}
