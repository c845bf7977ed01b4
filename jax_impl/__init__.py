"""The Qwen3.5 hybrid model and exact speculative decoding of reference.py, jit-compiled with JAX.

    cfg, params = jax_impl.load("weights/default")
    tokens, stats = jax_impl.generate(params, cfg, prompt_ids, 64, draft="ngram", draft_len=4)
    server = jax_impl.Server(params, cfg, slots=16)          # many requests at once (scheduler.py, batch.py)
    results = server.generate([dict(prompt=p, max_new_tokens=64, draft="ngram") for p in prompts])

Engine verbs (the conformance adapter's): load; empty_state(cfg, capacity); prefill(params, cfg, tokens, state)
-> logits, hidden, state, tapes; decode(params, cfg, token, state) -> logits, hidden, state (state donated);
verify(params, cfg, tokens, state, strategy) -> logits, hidden, state after all, kept states or tapes;
commit(strategy, before, after, kept, n) -> the state after the first n verified positions (rollback.py);
verify_tree(params, cfg, tokens, parents, state, strategy) and commit_tree(strategy, before, after, kept, path, n),
the same over a draft tree and its accepted path (trees.py).

For an engine adapter driving the pieces (conformance/engines/jax.py): draw(logits, sampling, key), the acceptance
rules accept_greedy / accept_speculative (a tree's: accept_tree_greedy / accept_tree_speculative), the MTP
drafter's mtp_update / mtp_step (its state after new pairs, one step of its chain); the batched step with
caller-given rows, explicit_step(params, cfg, slots' state, Rows, T=, K=, rollback=) (tokens, drafts, q, uniforms
and commit rules given; nothing drafted or drawn), with read_slot / write_slot, draft_bucket, PREFILL_WIDTHS and
MAX_STOP_IDS; compiled(fn, donate, cfg, statics, *args), the
ahead-of-time compilation cache the generate loop and the server use.

JAX is the `jax` extra. The verbs are imported from their modules on first use, so that importing this package
needs no JAX and `python -m jax_impl` can say in one line that it is missing.
"""

import importlib

# reference.py, the spec, sits beside this package: top-level in a clone, qwen35.reference in the installed kit
# (conformance/__init__.py says more).
if __name__ == "jax_impl":
    import reference
else:
    from .. import reference

EXPORTS = {
    "batch": ("MAX_STOP_IDS", "PREFILL_WIDTHS", "Rows", "draft_bucket", "explicit_step", "read_slot", "write_slot"),
    "gated_delta": ("gated_delta_chunked", "gated_delta_recurrent", "gated_delta_step", "gated_delta_tree"),
    "model": ("commit", "commit_tree", "decode", "empty_kv", "empty_state", "forward", "forward_hidden",
              "forward_tapped", "kv_from_reference", "kv_to_reference", "lm_head", "prefill", "verify", "verify_tree"),
    "rollback": ("commit_per_position", "commit_replay", "conv_window", "conv_windows", "delta_states",
                 "keep_per_position", "replay"),
    "scheduler": ("Server",),
    "sharding": ("initialize_distributed", "make_mesh"),
    "trees": ("tree_delta_states", "tree_of"),
    "spec_decode": ("DRAFTERS", "accept_greedy", "accept_speculative", "accept_tree_greedy", "accept_tree_speculative",
                    "compiled", "draw", "generate", "generate_device", "mtp_hidden", "mtp_step", "mtp_update",
                    "probabilities", "prompt_lookup", "request_step", "sample"),
    "weights": ("load", "to_jax"),
}
MODULE_OF = {name: module for module, names in EXPORTS.items() for name in names}


def __getattr__(name):
    if name not in MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{MODULE_OF[name]}", __name__), name)
