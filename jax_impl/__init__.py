"""The Qwen3.5 hybrid model and exact speculative decoding of reference.py, jit-compiled with JAX.

    cfg, params = jax_impl.load("weights/default")
    tokens, stats = jax_impl.generate(params, cfg, prompt_ids, 64, draft="ngram", draft_len=4)
    server = jax_impl.Server(params, cfg, slots=16)          # many requests at once (serving.py, batch.py)
    results = server.generate([dict(prompt=p, max_new_tokens=64, draft="ngram") for p in prompts])

Engine verbs (the conformance adapter's): load; empty_state(cfg, capacity); prefill(params, cfg, tokens, state)
-> logits, hidden, state, tapes; decode(params, cfg, token, state) -> logits, hidden, state (state donated);
verify(params, cfg, tokens, state, strategy) -> logits, hidden, state after all, kept states or tapes;
commit(strategy, before, after, kept, n) -> the state after the first n verified positions (rollback.py).
"""

from .gated_delta import gated_delta_chunked, gated_delta_recurrent, gated_delta_step
from .model import (commit, decode, empty_kv, empty_state, forward, forward_hidden, kv_from_reference,
                    kv_to_reference, lm_head, prefill, verify)
from .rollback import (commit_per_position, commit_replay, conv_window, conv_windows, delta_states,
                       keep_per_position, replay)
from .serving import Server
from .sharding import initialize_distributed, make_mesh
from .spec_decode import (accept_greedy, accept_speculative, generate, generate_device, mtp_hidden, probabilities,
                          prompt_lookup, sample)
from .weights import load, to_jax
