"""Train the embedded default model: a Qwen3.5-architecture model (6 Gated DeltaNet + 2 gated attention layers) with
one MTP layer trained jointly, on the Python standard library's own source, and write it in the Hugging Face layout.

    python -m weights.train --out weights/default            # 62 minutes on 2 CPU cores (train_log.json)
    python -m weights.train --out /tmp/smoke --steps 3 --batch 2

Main loss: next token (t+1). MTP loss: the pair (hidden_t, token_{t+1}) predicts token_{t+2}, as Qwen3.5's MTP head
is trained (weight MTP_WEIGHT). The forward is jax_impl's, mapped over the batch; the optimizer is optax AdamW.
Deterministic for a given seed, corpus and software versions (weights/README.md says how close reruns land).
"""

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax
from safetensors.numpy import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

import reference as R
from jax_impl.model import empty_state, forward_hidden, lm_head
from jax_impl.spec_decode import mtp_hidden
from weights.plots import pyplot

EOS = "<|endoftext|>"
VOCAB = 4096
SEQ = 256
MTP_WEIGHT = 0.3
VALIDATION_EVERY = 20          # every 20th corpus file (sorted by path) is held out
# Qwen3.5's pre-tokenizer split (letters with marks, single digits, punctuation runs, newline runs, whitespace).
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CONFIG = dict(
    model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], vocab_size=VOCAB, hidden_size=256,
    num_hidden_layers=8, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, full_attention_interval=4, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=4096, tie_word_embeddings=True, attention_bias=False, mtp_num_hidden_layers=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    torch_dtype="bfloat16")


# ----------------------------------------------------------------------------------------------------------------
# Corpus and tokenizer

def corpus_files():
    """The standard library's .py files (tests, idlelib tests, lib2to3 and site-packages left out), sorted."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "lib2to3", "__pycache__"}
    return lib, sorted(p for p in lib.rglob("*.py") if not skip & set(p.relative_to(lib).parts))


def corpus():
    """(train texts, validation texts, provenance): every VALIDATION_EVERY-th file is held out."""
    lib, files = corpus_files()
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    digest = hashlib.sha256()
    for p, text in zip(files, texts):
        digest.update(f"{p.relative_to(lib)}\n{len(text)}\n".encode() + text.encode())
    provenance = {"source": f"Python {sys.version.split()[0]} standard library", "files": len(files),
                  "bytes": sum(len(t.encode()) for t in texts), "sha256": digest.hexdigest()}
    train = [t for i, t in enumerate(texts) if i % VALIDATION_EVERY]
    held_out = [t for i, t in enumerate(texts) if not i % VALIDATION_EVERY]
    return train, held_out, provenance


def train_tokenizer(texts):
    """Byte-level BPE (VOCAB ids, <|endoftext|> = 0) with Qwen3.5's pre-tokenizer split."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def token_stream(tokenizer, texts):
    """All texts as one int32 stream, each followed by EOS."""
    eos = tokenizer.token_to_id(EOS)
    return np.concatenate([np.append(e.ids, eos) for e in tokenizer.encode_batch(texts)]).astype(np.int32)


# ----------------------------------------------------------------------------------------------------------------
# Model

def init_params(cfg, seed):
    """{checkpoint name: array} with transformers' initialisation: N(0, 0.02) matrices, zero norm offsets, gated
    norm 1, dt_bias 1, A_log = log U(1, 16), conv1d U(-1/sqrt(W), 1/sqrt(W)) (PyTorch's depthwise conv default).
    The trained pytree is this flat dict, so the checkpoint is written without renaming."""
    rng = np.random.default_rng(seed)
    shapes = R.checkpoint_shapes(cfg, with_mtp=True)
    del shapes["lm_head.weight"]                                   # tied to the embedding

    def init(name, shape):
        if name.endswith("A_log"):
            return np.log(rng.uniform(1, 16, shape))
        if name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            return np.ones(shape)
        if name.endswith("conv1d.weight"):
            return rng.uniform(-1, 1, shape) / math.sqrt(shape[-1])
        if len(shape) == 1:
            return np.zeros(shape)
        return rng.normal(0, 0.02, shape)
    return {name: init(name, shape).astype(np.float32) for name, shape in shapes.items()}


def nested(flat):
    """The flat checkpoint dict as jax_impl's weights tree (jax_impl.weights: matrices other than the embedding
    stored (in, out), a tied lm_head as (D, V)). Inside jit the transposes fold into the matmuls."""
    params = R.nested_params({n: x.T if x.ndim == 2 and "embed_tokens" not in n else x for n, x in flat.items()})
    return {**params, "lm_head": params["embed_tokens"].T}


def cross_entropy(logits, targets):  # (..., V), (...) -> mean over tokens
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))


def sequence_losses(params, cfg, tokens):
    """(SEQ + 2,) tokens -> (main loss, MTP loss, MTP top-1 accuracy) for one sequence."""
    inputs = tokens[:-2]                                                        # (T,)
    hidden, _, _ = forward_hidden(params, cfg, inputs, empty_state(cfg, SEQ))   # (T, D)
    main = cross_entropy(lm_head(params, hidden), tokens[1:-1])
    mtp_state = empty_state(R.replace(cfg, num_hidden_layers=1, layer_types=("full_attention",)), SEQ)
    mtp, _ = mtp_hidden(params, cfg, tokens[1:-1], hidden, mtp_state)            # (T, D): pairs (h_t, x_{t+1})
    mtp_logits = lm_head(params, mtp)
    return main, cross_entropy(mtp_logits, tokens[2:]), jnp.mean(mtp_logits.argmax(-1) == tokens[2:])


def batch_losses(flat, cfg, batch):  # (B, SEQ + 2) -> means over the batch
    """Sequences one after another (lax.map): vmap over the batch runs many times slower on XLA:CPU here."""
    params = nested(flat)
    main, mtp, accuracy = lax.map(lambda t: sequence_losses(params, cfg, t), batch)
    return main.mean(), mtp.mean(), accuracy.mean()


def make_step(cfg, optimizer):
    def loss(params, batch):
        main, mtp, _ = batch_losses(params, cfg, batch)
        return main + MTP_WEIGHT * mtp, (main, mtp)

    @jax.jit
    def step(params, opt_state, batch):
        (_, (main, mtp)), grads = jax.value_and_grad(loss, has_aux=True)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, main, mtp
    return step


def batches(stream, batch, seed):
    """Random windows of SEQ + 2 tokens, an endless deterministic sequence of (batch, SEQ + 2) arrays."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(stream) - SEQ - 2, batch)
        yield np.stack([stream[s:s + SEQ + 2] for s in starts])


def evaluate(params, cfg, stream, windows=32):
    """Mean (main loss, MTP loss, MTP top-1 accuracy) over fixed held-out windows."""
    starts = np.linspace(0, len(stream) - SEQ - 3, windows).astype(int)
    batch = jnp.asarray(np.stack([stream[s:s + SEQ + 2] for s in starts]))
    return [float(x) for x in jax.jit(lambda p, b: batch_losses(p, cfg, b))(params, batch)]


# ----------------------------------------------------------------------------------------------------------------
# Output

def write_checkpoint(out, flat, tokenizer):
    """config.json, generation_config.json, tokenizer.json and a bf16 model.safetensors named as Qwen3.5's are."""
    out.mkdir(parents=True, exist_ok=True)
    eos = tokenizer.token_to_id(EOS)
    (out / "config.json").write_text(json.dumps({**CONFIG, "eos_token_id": eos}, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    save_file({name: np.asarray(x.astype(jnp.bfloat16)) for name, x in flat.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    train_texts, held_out_texts, provenance = corpus()
    tokenizer = train_tokenizer(train_texts)
    train, held_out = token_stream(tokenizer, train_texts), token_stream(tokenizer, held_out_texts)
    print(f"corpus: {provenance['source']}, {provenance['files']} files, sha256 {provenance['sha256'][:16]}...; "
          f"{len(train)} train / {len(held_out)} held-out tokens", flush=True)
    cfg = R.config_from_dict({**CONFIG, "eos_token_id": tokenizer.token_to_id(EOS)})
    params = jax.tree.map(jnp.asarray, init_params(cfg, args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    warmup = min(50, args.steps // 4)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr * 0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.1))
    opt_state, step = optimizer.init(params), make_step(cfg, optimizer)
    log = {"provenance": provenance, "parameters": n_params, "args": {k: str(v) for k, v in vars(args).items() if k != "out"},
           "train": [], "validation": []}
    print(f"model: {n_params / 1e6:.2f}M parameters; {args.steps} steps of {args.batch} x {SEQ} tokens", flush=True)
    start = time.perf_counter()
    for i, batch in zip(range(1, args.steps + 1), batches(train, args.batch, args.seed)):
        params, opt_state, main_loss, mtp_loss = step(params, opt_state, jnp.asarray(batch))
        log["train"].append([i, float(main_loss), float(mtp_loss)])
        elapsed = time.perf_counter() - start
        print(f"\rstep {i}/{args.steps}  loss {float(main_loss):.3f}  mtp {float(mtp_loss):.3f}  "
              f"{i * args.batch * SEQ / elapsed:.0f} tok/s  eta {elapsed / i * (args.steps - i) / 60:.0f} min",
              end="", flush=True)
        if i % 100 == 0 or i == args.steps:
            log["validation"].append([i, *evaluate(params, cfg, held_out)])
            print(f"\n  held-out: loss {log['validation'][-1][1]:.3f}, mtp loss {log['validation'][-1][2]:.3f}, "
                  f"mtp top-1 {log['validation'][-1][3]:.1%}", flush=True)
    log["seconds"] = time.perf_counter() - start
    write_checkpoint(args.out, jax.device_get(params), tokenizer)
    (args.out.parent / "train_log.json").write_text(json.dumps(log) + "\n")
    plot_losses(log, args.out.parent / "train_loss.png")
    print(f"\nwrote {args.out} in {log['seconds'] / 60:.0f} min")


def plot_losses(log, path):
    plt = pyplot()
    if plt is None:
        return
    train, held_out = np.array(log["train"]), np.array(log["validation"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(train[:, 0], train[:, 1], lw=0.8, label="train (t+1)")
    ax.plot(train[:, 0], train[:, 2], lw=0.8, label="train MTP (t+2)")
    ax.plot(held_out[:, 0], held_out[:, 1], "o-", label="held-out (t+1)")
    ax.plot(held_out[:, 0], held_out[:, 2], "s-", label="held-out MTP (t+2)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
