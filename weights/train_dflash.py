"""Train a DFlash block drafter for the default model, on the target's own generations, and write it in the public
drafters' layout (z-lab's DFlashDraftModel: reference.load_dflash reads it; docs/dflash.md has the model card).

    python -m weights.train_dflash --out weights/default-dflash          # about an hour on 2 CPU cores
    python -m weights.train_dflash --out /tmp/smoke --sequences 8 --steps 3 --batch 2

Data: prompts cut from the training split of weights/default's corpus (weights.train.corpus), continued by the
target itself (jax_impl, a quarter of them sampled at temperature SAMPLED_TEMPERATURE, the rest greedy), so the
drafter learns the distribution it will be asked to draft (no shift between training text and the target's
output). The features are the target's outputs after the tapped layers over each whole sequence, computed once
(the target is frozen). Training is SpecForge's (specforge/core/dflash.py): per sequence, random anchor positions in
the generated part; each anchor a gets a block [token a, MASK x (b-1)] at positions a .. a+b-1 that sees the
context features of positions < a and its own block bidirectionally, never another block; slot k is labelled with
token a+k, cross-entropy weighted by exp(-(k-1)/gamma) (the DFlash paper's decay). The drafter's embedding and
head are the target's, frozen. The optimizer is optax AdamW.
"""

import argparse
import json
import math
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors.numpy import save_file

import reference as R
import jax_impl
from jax_impl.model import decoder_layer, empty_state, forward_hidden, lm_head
from weights.plots import pyplot
from weights.train import corpus

HERE = Path(__file__).resolve().parent
SAMPLED_TEMPERATURE = 0.8
SAMPLED_EVERY = 4               # every 4th sequence is sampled, the rest greedy
HELD_OUT_SEQUENCES = 32         # validation sequences, from the held-out split's files


def drafter_config(target_cfg, taps, layers, block, mask_token_id, window):
    """The drafter's config.json: a Qwen3 config with dflash_config, the target's attention shapes; with a window,
    the first layer a sliding one (as z-lab's Qwen3.5 drafters have them: causal within the window)."""
    sliding = {"layer_types": ["sliding_attention"] + ["full_attention"] * (layers - 1), "sliding_window": window,
               "use_sliding_window": True} if window else {}
    return {**sliding,
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False, "hidden_act": "silu",
        "hidden_size": target_cfg.hidden_size, "intermediate_size": target_cfg.intermediate_size,
        "num_hidden_layers": layers, "num_attention_heads": target_cfg.num_attention_heads,
        "num_key_value_heads": target_cfg.num_key_value_heads, "head_dim": target_cfg.head_dim,
        "rms_norm_eps": target_cfg.rms_norm_eps, "vocab_size": target_cfg.vocab_size,
        "num_target_layers": target_cfg.num_hidden_layers, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "block_size": block,
        "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": mask_token_id, "block_size": block},
    }


# ----------------------------------------------------------------------------------------------------------------
# Data: the target's own continuations and its tapped features

def prompts_from(texts, tokenizer, count, length, rng):
    """`count` windows of `length` tokens, each from a random place in a random text long enough for one."""
    encoded = [ids for ids in (e.ids for e in tokenizer.encode_batch(texts)) if len(ids) > length]
    picks = rng.integers(0, len(encoded), count)
    return [encoded[i][s:s + length] for i, s in
            ((i, int(rng.integers(0, len(encoded[i]) - length))) for i in picks)]


@partial(jax.jit, static_argnames=("cfg", "new_tokens", "temperature"))
def continuations(params, cfg, prompts, key, new_tokens, temperature):  # (B, L) -> (B, new_tokens)
    def one(tokens, state):
        hidden, state, _ = forward_hidden(params, cfg, tokens, state)
        return lm_head(params, hidden[-1]), state
    logits, states = jax.vmap(lambda t: one(t, empty_state(cfg, prompts.shape[1] + new_tokens)))(prompts)

    def step(carry, key):
        logits, states = carry
        token = (logits.argmax(-1) if temperature == 0 else
                 jax.random.categorical(key, logits / temperature)).astype(jnp.int32)
        logits, states = jax.vmap(lambda t, s: one(t[None], s))(token, states)
        return (logits, states), token
    return jax.lax.scan(step, (logits, states), jax.random.split(key, new_tokens))[1].T


def continue_prompts(params, cfg, prompts, new_tokens, temperature, seed, batch=64):
    """prompts (n, L) + the target's continuations, greedy (temperature 0) or sampled -> (n, L + new_tokens).
    Batches of sequences decoded together (vmap of jax_impl's forward): the same model as jax_impl.generate, whose
    float rounding may differ in the last bits at a near-tie, which only changes which of two likely tokens the
    training text holds."""
    padded = np.concatenate([prompts, np.repeat(prompts[:1], -len(prompts) % batch, axis=0)])   # one compiled shape
    out = [np.asarray(continuations(params, cfg, jnp.asarray(padded[i:i + batch]), jax.random.key(seed + i),
                                    new_tokens, temperature)) for i in range(0, len(padded), batch)]
    return np.concatenate([prompts, np.concatenate(out)[:len(prompts)]], axis=1).astype(np.int32)


def tapped_forward(params, cfg, tokens, taps):  # (S,) -> (S, len(taps) D): the outputs of the tapped layers
    state = empty_state(cfg, tokens.shape[0])
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    x, outputs = params["embed_tokens"][tokens], {}
    for i, (kind, layer, layer_state) in enumerate(zip(cfg.layer_types, params["layers"], state.layers)):
        x, _, _ = decoder_layer(x, kind, layer, layer_state, positions, tokens.shape[0], cfg)
        outputs[i] = x
    return jnp.concatenate([outputs[i] for i in taps], axis=-1)


def features_of(params, cfg, sequences, taps):
    run = jax.jit(lambda t: jax.lax.map(lambda row: tapped_forward(params, cfg, row, taps), t))
    return np.concatenate([np.asarray(run(jnp.asarray(sequences[i:i + 32]))).astype(np.float16)
                           for i in range(0, len(sequences), 32)])


# ----------------------------------------------------------------------------------------------------------------
# The drafter (the same computation as reference.dflash_block, for many blocks at once)

def init_drafter(cfg, dcfg, seed):
    """{checkpoint name: array}: N(0, 0.02) matrices, RMSNorm scales 1 (Qwen3's initialisation)."""
    rng = np.random.default_rng(seed)
    return {name: (np.ones(shape) if len(shape) == 1 else rng.normal(0, 0.02, shape)).astype(np.float32)
            for name, shape in R.dflash_shapes(cfg, dcfg).items()}


def rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta):  # (T, H, Dh) full rotary, halves rotated (reference.rope with rotary_dim = Dh)
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None, None].astype(jnp.float32) * freqs
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def layer_mask(dcfg, i, queries, keys):  # reference.dflash_visible on traced positions: (B,), (S,) -> (B, S)
    sliding = i < len(dcfg.layer_types) and dcfg.layer_types[i] == "sliding_attention"
    causal = sliding if dcfg.is_causal is None else dcfg.is_causal
    query, key = queries[:, None], keys[None, :]
    visible = jnp.ones((len(queries), len(keys)), bool)
    if causal:
        visible &= key <= query
    if sliding:
        visible &= (query - key < dcfg.sliding_window) & (causal | (key - query < dcfg.sliding_window))
    return visible


def drafter_logits(p, embed, dcfg, features, tokens, anchors, block):
    """One sequence: features (S, len(taps) D), tokens (S,), anchors (N,) -> logits (N, block, V) of the blocks
    [tokens[a], MASK x (block - 1)] at positions a .. a + block - 1, each seeing context positions < a and itself."""
    S, N, eps = features.shape[0], anchors.shape[0], dcfg.rms_norm_eps
    Hq, Hkv, Dh = dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim
    context = rms(features @ p["fc.weight"].T, p["hidden_norm.weight"], eps)                    # (S, D)
    slots = jnp.arange(block)
    block_tokens = jnp.where(slots == 0, tokens[anchors][:, None], dcfg.mask_token_id).reshape(-1)
    positions = (anchors[:, None] + slots).reshape(-1)                                        # (N b,)
    kv_positions = jnp.concatenate([jnp.arange(S), positions])
    query_block = jnp.repeat(jnp.arange(N), block)
    visible = jnp.concatenate([jnp.arange(S)[None, :] < jnp.repeat(anchors, block)[:, None],
                               query_block[:, None] == query_block[None, :]], axis=1)       # (N b, S + N b)
    x = embed[block_tokens]
    for i in range(dcfg.num_hidden_layers):
        layer_visible = visible & layer_mask(dcfg, i, positions, kv_positions)
        w = lambda name: p[f"layers.{i}.{name}.weight"]
        h = rms(x, w("input_layernorm"), eps)
        q = rope(rms((h @ w("self_attn.q_proj").T).reshape(-1, Hq, Dh), w("self_attn.q_norm"), eps), positions,
                 dcfg.rope_theta)
        kv_in = jnp.concatenate([context, h])
        k = rope(rms((kv_in @ w("self_attn.k_proj").T).reshape(-1, Hkv, Dh), w("self_attn.k_norm"), eps),
                 kv_positions, dcfg.rope_theta)
        v = (kv_in @ w("self_attn.v_proj").T).reshape(-1, Hkv, Dh)
        q = q.reshape(-1, Hkv, Hq // Hkv, Dh)
        scores = jnp.einsum("tkgd,skd->kgts", q, k) * Dh ** -0.5
        weights = jax.nn.softmax(jnp.where(layer_visible, scores, -jnp.inf), axis=-1)
        x = x + jnp.einsum("kgts,skd->tkgd", weights, v).reshape(-1, Hq * Dh) @ w("self_attn.o_proj").T
        h = rms(x, w("post_attention_layernorm"), eps)
        x = x + (jax.nn.silu(h @ w("mlp.gate_proj").T) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    return (rms(x, p["norm.weight"], eps) @ embed.T).reshape(N, block, -1)


def block_losses(p, embed, dcfg, features, tokens, anchors, block, gamma):
    """-> (weighted cross-entropy, per-slot top-1 hits (N, block - 1), per-slot validity (N, block - 1))."""
    logits = drafter_logits(p, embed, dcfg, features, tokens, anchors, block)[:, 1:]           # (N, b-1, V)
    label_at = anchors[:, None] + jnp.arange(1, block)
    valid = label_at < tokens.shape[0]
    labels = tokens[jnp.minimum(label_at, tokens.shape[0] - 1)]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1)[..., 0]
    weight = valid * jnp.exp(-jnp.arange(block - 1) / gamma)
    return (nll * weight).sum() / weight.sum(), (logits.argmax(-1) == labels) & valid, valid


def batch_losses(p, embed, dcfg, features, tokens, anchors, block, gamma):
    loss, hits, valid = jax.lax.map(lambda a: block_losses(p, embed, dcfg, *a, block, gamma),
                                    (features, tokens, anchors))
    return loss.mean(), hits, valid


def acceptance_length(hits, valid):
    """1 + the mean run of correct slots from the first (teacher forced: what a greedy round would accept)."""
    run = jnp.cumprod(hits & valid, axis=-1).sum(-1)
    return 1 + run.mean()


def sample_anchors(rng, prompt_len, seq_len, count, batch):
    """Per sequence, `count` distinct anchors in the generated part [prompt_len, seq_len - 2], sorted."""
    return np.stack([np.sort(rng.choice(np.arange(prompt_len, seq_len - 1), count, replace=False))
                     for _ in range(batch)]).astype(np.int32)


# ----------------------------------------------------------------------------------------------------------------
# Output

def write_drafter(out, raw_config, flat):
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw_config, indent=2, sort_keys=True) + "\n")
    save_file({name: np.asarray(jnp.asarray(x).astype(jnp.bfloat16)) for name, x in flat.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})


def plot_log(log, path):
    plt = pyplot()
    if plt is None:
        return
    train, held_out = np.array(log["train"]), np.array([row[:3] for row in log["validation"]])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    ax.plot(train[:, 0], train[:, 1], lw=0.8, label="train")
    ax.plot(held_out[:, 0], held_out[:, 1], "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("weighted block cross-entropy (nats)")
    ax.legend()
    bx.plot(held_out[:, 0], held_out[:, 2], "o-")
    bx.set_xlabel("step")
    bx.set_ylabel(f"held-out acceptance length (block {log['args']['block']}, teacher forced)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=HERE / "default")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sequences", type=int, default=768, help="training continuations to generate")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--taps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 6])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--window", type=int, default=16, help="the first layer's sliding window (0: all full attention)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step")
    ap.add_argument("--gamma", type=float, default=7.0, help="loss decay over block slots (DFlash: 7 at block 16)")
    ap.add_argument("--steps", type=int, default=180)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, help="cache the generated sequences and features here (.npz)")
    args = ap.parse_args()
    start = time.perf_counter()

    def log(message):
        print(f"[{(time.perf_counter() - start) / 60:5.1f} min] {message}", flush=True)

    cfg, params = jax_impl.load(args.target)
    cfg = R.replace(cfg, eos_token_id=())                       # full-length continuations
    tokenizer = R.load_tokenizer(args.target)
    mask_token_id = cfg.vocab_size - 1                          # the target has no <|MASK|>: its last vocabulary row
    raw_config = drafter_config(cfg, args.taps, args.layers, args.block, mask_token_id, args.window)
    dcfg = R.dflash_config_from_dict(raw_config, cfg)
    rng = np.random.default_rng(args.seed)
    if args.data and args.data.exists():
        data = dict(np.load(args.data))
        log(f"read {args.data}")
    else:
        train_texts, held_out_texts, provenance = corpus()
        data = {}
        for split, texts, count in (("train", train_texts, args.sequences),
                                    ("held_out", held_out_texts, HELD_OUT_SEQUENCES)):
            prompts = np.array(prompts_from(texts, tokenizer, count, args.prompt_len, rng), np.int32)
            sampled = np.arange(count) % SAMPLED_EVERY == SAMPLED_EVERY - 1
            tokens = np.zeros((count, args.prompt_len + args.new_tokens), np.int32)
            for rows, temperature in ((~sampled, 0.0), (sampled, SAMPLED_TEMPERATURE)):
                tokens[rows] = continue_prompts(params, cfg, prompts[rows], args.new_tokens, temperature, args.seed)
                log(f"{split}: {rows.sum()} continuations at temperature {temperature:g}")
            data[f"{split}_tokens"] = tokens
            data[f"{split}_features"] = features_of(params, cfg, data[f"{split}_tokens"], tuple(args.taps))
            log(f"{split}: {len(prompts)} sequences of {data[f'{split}_tokens'].shape[1]} tokens, features "
                f"{data[f'{split}_features'].nbytes / 2 ** 20:.0f} MiB (fp16)")
        if args.data:
            np.savez(args.data, **data)
    embed = jnp.asarray(R.load_model(args.target)[1]["embed_tokens"])   # tied: the head is the embedding

    flat = jax.tree.map(jnp.asarray, init_drafter(cfg, dcfg, args.seed))
    warmup = min(50, args.steps // 4)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr * 0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.01))
    opt_state = optimizer.init(flat)
    block, gamma, L = args.block, args.gamma, args.prompt_len

    @jax.jit
    def step(flat, opt_state, features, tokens, anchors):
        def loss(p):
            value, hits, valid = batch_losses(p, embed, dcfg, features.astype(jnp.float32), tokens, anchors, block,
                                              gamma)
            return value, (hits, valid)
        (value, (hits, valid)), grads = jax.value_and_grad(loss, has_aux=True)(flat)
        updates, opt_state = optimizer.update(grads, opt_state, flat)
        return optax.apply_updates(flat, updates), opt_state, value, acceptance_length(hits, valid)

    @jax.jit
    def evaluate(flat, features, tokens, anchors):
        value, hits, valid = batch_losses(flat, embed, dcfg, features.astype(jnp.float32), tokens, anchors, block,
                                          gamma)
        by_slot = (hits.sum((0, 1)) / jnp.maximum(valid.sum((0, 1)), 1))
        return value, acceptance_length(hits, valid), by_slot

    held = data["held_out_tokens"]
    held_anchors = np.tile(np.arange(L, held.shape[1] - 1, 4, dtype=np.int32), (len(held), 1))   # fixed, spread
    n_params = sum(x.size for x in jax.tree.leaves(flat))
    train_log = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "target", "data")},   # no paths
                 "parameters": int(n_params), "mask_token_id": mask_token_id,
                 "sampled": {"every": SAMPLED_EVERY, "temperature": SAMPLED_TEMPERATURE},
                 "train": [], "validation": []}
    log(f"drafter: {n_params / 1e6:.2f}M parameters, {args.layers} layers, taps {args.taps}; {args.steps} steps of "
        f"{args.batch} sequences x {args.anchors} blocks of {block}")
    tokens_all, features_all = data["train_tokens"], data["train_features"]
    train_start = time.perf_counter()
    for i in range(1, args.steps + 1):
        rows = rng.integers(0, len(tokens_all), args.batch)
        anchors = sample_anchors(rng, L, tokens_all.shape[1], args.anchors, args.batch)
        flat, opt_state, loss, tau = step(flat, opt_state, jnp.asarray(features_all[rows]),
                                          jnp.asarray(tokens_all[rows]), jnp.asarray(anchors))
        train_log["train"].append([i, float(loss), float(tau)])
        if i % 10 == 0 or i == 1:
            elapsed = time.perf_counter() - train_start
            log(f"step {i}/{args.steps}  loss {float(loss):.3f}  acceptance length {float(tau):.2f}  "
                f"{elapsed / i:.2f} s/step  eta {elapsed / i * (args.steps - i) / 60:.0f} min")
        if i % 100 == 0 or i == args.steps:
            value, tau, by_slot = evaluate(flat, jnp.asarray(data["held_out_features"]), jnp.asarray(held),
                                           jnp.asarray(held_anchors))
            train_log["validation"].append([i, float(value), float(tau), np.asarray(by_slot).round(4).tolist()])
            log(f"  held-out: loss {float(value):.3f}, acceptance length {float(tau):.2f}, top-1 by slot "
                f"{' '.join(f'{a:.0%}' for a in np.asarray(by_slot))}")
            write_drafter(args.out, raw_config, jax.device_get(flat))      # a usable checkpoint at every evaluation
    train_log["seconds"] = {"total": time.perf_counter() - start, "training": time.perf_counter() - train_start}
    log_path = args.out.parent / f"{args.out.name}_train_log.json"
    log_path.write_text(json.dumps(train_log) + "\n")
    plot_log(train_log, args.out.parent / f"{args.out.name}_train_loss.png")
    log(f"wrote {args.out} and {log_path.name}")


if __name__ == "__main__":
    main()
