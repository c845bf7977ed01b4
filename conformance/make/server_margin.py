"""The measurement behind tolerances.json "server" (check-server's near-tie margin and logprob tolerance):

    python -m conformance.make.server_margin [CHECKPOINT ...]     (default: tiny-mtp tiny-odd default)

For each shipped checkpoint it continues scenario prompts greedily with reference.py, then runs jax_impl's forward
over the same sequences, whole and in 16-token chunks (as a server prefills and decodes them), in float32 and in
bfloat16, and prints the largest difference from reference.py's float32 logits and log-probabilities. A server's
token is the spec's argmax up to twice such a difference (both top logits may move, in opposite directions)."""

import jax.numpy as jnp
import numpy as np

from .. import reference as R, sibling
from ..check_server import build_prompt, log_softmax

CHECKPOINTS = ("tiny-mtp", "tiny-odd", "default")
CAPACITY = 320       # positions: the longest sequence (150 + 64) and a chunk's padding
PROMPTS = ({"seed": 1, "length": 12}, {"seed": 301, "length": 150}, {"seed": 1000, "length": 30, "period": 4})


def sequences(params, cfg, new=64):
    for part in PROMPTS:
        seq = build_prompt([part], cfg.vocab_size, set(cfg.eos_token_id))
        logits, _, state, _ = R.forward(params, cfg, seq, R.empty_state(cfg))
        for _ in range(new):
            seq.append(int(np.argmax(logits[-1])))
            logits, _, state, _ = R.forward(params, cfg, [seq[-1]], state)
        yield seq


def jax_logits(jparams, cfg, seq, chunk):
    model = sibling("jax_impl.model")
    state, rows = model.empty_state(cfg, CAPACITY, jparams["embed_tokens"].dtype), []  # one shape: one compilation
    for start in range(0, len(seq), chunk):
        logits, _, state, _ = model.forward(jparams, cfg, jnp.asarray(seq[start:start + chunk]), state)
        rows.append(np.asarray(logits, np.float32))
    return np.concatenate(rows)


def main(names=CHECKPOINTS):
    weights = sibling("jax_impl.weights")
    for name in names:
        cfg, params = R.load_model(R.DEFAULT_MODEL.parent / name)
        for dtype in ("float32", "bfloat16"):
            jparams = weights.to_jax(params, dtype)
            worst_logit = worst_logprob = 0.0
            for seq in sequences(params, cfg):
                want = R.forward(params, cfg, seq, R.empty_state(cfg))[0]
                for chunk in (len(seq), 16):
                    got = jax_logits(jparams, cfg, seq, chunk)
                    worst_logit = max(worst_logit, float(np.abs(got - want).max()))
                    worst_logprob = max(worst_logprob, max(float(np.abs(log_softmax(g) - log_softmax(w)).max())
                                                           for g, w in zip(got, want)))
            print(f"{name:<10} {dtype:<9} logits up to {worst_logit:.3g}, log-probabilities up to {worst_logprob:.3g}")


if __name__ == "__main__":
    import sys
    main(sys.argv[1:] or CHECKPOINTS)
