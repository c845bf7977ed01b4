"""llama.cpp through llama-cpp-python (CPU, float32 GGUF, float32 KV cache, no flash attention) as a peer engine.

Loading converts the checkpoint with llama.cpp's own HF -> GGUF converter. It ships in the llama-cpp-python sdist, not
in the wheel: LLAMA_CPP_CONVERTER may name the sdist's vendor/llama.cpp folder, otherwise the sdist of the installed
version is fetched once with `pip download` into conformance/_out/cache/. GGUFs are cached there too, by checkpoint
digest, llama-cpp-python version and CONVERSION (raise it after changing the conversion). The converter runs on an amended
copy of the checkpoint (`gguf_source`) with one patch (`convert`); neither touches a tensor, and
expectations/llama_cpp.json lists both under adapter_workarounds.

Cases are driven with token ids through libllama's C API (the bindings' thin wrappers; the high-level Llama class
cannot set n_rs_seq): one context per checkpoint, holding one sequence, with n_rs_seq recurrent-state snapshots so
that a speculative commit rolls back with llama_memory_seq_rm, as llama-server does. A serving trace gets a context of
its own with one sequence per request slot, and each of its batches is one llama_decode over all the batch's rows
(ServedTrace). expectations/llama_cpp.json says what is unsupported and why.
"""

import bisect
import ctypes
import json
import os
import runpy
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import NamedTuple

import llama_cpp
import numpy as np
from llama_cpp import _internals as internals

from .. import reference as R
from . import Engine, inverse_cdf_draw, register_engine
from ..format import HERE, ROOT, directory_sha256

CACHE = HERE / "_out" / "cache"
CONVERTER_ENV = "LLAMA_CPP_CONVERTER"
CONVERSION = 2             # the amendments' version, in a cached GGUF's name: 2 keeps the added tokens' ids
N_CTX = 512                # positions of the one-sequence context; no case needs 100 (a trace's: the checkpoint's)
MAX_DRAFT = 8              # recurrent-state snapshots kept per sequence: a verify may roll back this many positions
SEED = 0                   # only fixes llama.cpp's dist sampler; the case's uniforms make the draws
WHOLE_STATE = llama_cpp.LLAMA_STATE_SEQ_FLAGS_NONE   # a sequence's KV cells and recurrent state, on the host
GGML_LOG_LEVEL_ERROR = 4   # ggml.h enum ggml_log_level: DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
libllama_errors = []


# ----------------------------------------------------------------------------------------------------------------
# Conversion.

def vendored_llama_cpp(into, parts=None):
    """The installed version's llama.cpp source as its sdist vendors it: into/llama_cpp_python-VERSION/vendor/llama.cpp,
    fetched once with `pip download`, with only the top-level entries named in `parts` extracted (all if None)."""
    version = llama_cpp.__version__
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", tmp, f"llama-cpp-python=={version}"], check=True)
        with tarfile.open(next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))) as sdist:
            wanted = f"llama_cpp_python-{version}/vendor/llama.cpp/"
            members = [m for m in sdist.getmembers() if m.name.startswith(wanted) and
                       (parts is None or m.name[len(wanted):].split("/")[0] in parts)]
            sdist.extractall(into, members=members, filter="data")
    return vendored_folder(into)


def vendored_folder(into):
    return Path(into) / f"llama_cpp_python-{llama_cpp.__version__}" / "vendor" / "llama.cpp"


def converter_dir():
    """The sdist's vendor/llama.cpp folder (convert_hf_to_gguf.py, conversion/, gguf-py/) for the installed version."""
    if os.environ.get(CONVERTER_ENV):
        return Path(os.environ[CONVERTER_ENV])
    folder = vendored_folder(CACHE)
    if not (folder / "convert_hf_to_gguf.py").is_file():
        vendored_llama_cpp(CACHE, ("convert_hf_to_gguf.py", "conversion", "gguf-py"))
    return folder


def with_one_merge(tokenizer):
    """tokenizer.json with one BPE merge added under the next free id if it has none. llama.cpp refuses a BPE vocab
    without merges ("cannot find tokenizer merges in model file") and the tiny checkpoints' byte-level tokenizer has
    none; the ids the cases use keep their meaning (the suite drives engines with token ids only).

    The added tokens enter the model's vocab too, under their own ids: else the merge (257) leaves a gap at the added
    <|endoftext|> (256), tokenizers gives an added token the model lacks the id len(vocab), 257 as well, and which of
    the two the converter keeps depended on PYTHONHASHSEED: one conversion in three made 257 an end-of-generation
    token and 256 a [PAD256] (llama-server then stopped right after every `!"`)."""
    if tokenizer["model"].get("merges"):
        return tokenizer
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[:2]
    vocab.update({t["content"]: t["id"] for t in tokenizer["added_tokens"]})
    vocab[first + second] = 1 + max(vocab.values())
    tokenizer["model"]["merges"] = [[first, second]]
    return tokenizer


def with_mrope_section(config):
    """config.json with an explicit rope_parameters.mrope_section. Without one the converter writes Qwen3.5-9B's
    [11, 11, 10] (32 rotary pairs), and for fewer pairs llama.cpp's first decode aborts the process:
    GGML_ASSERT(sect_dims <= ne0) in ggml-cpu/ops.cpp. The same interleaved layout for this head: it gives text tokens
    (equal positions in every section) plain RoPE, as the reference computes."""
    text = config.get("text_config", config)
    rope = text["rope_parameters"]
    pairs = int(text["head_dim"] * rope.get("partial_rotary_factor", 1.0)) // 2
    rope.setdefault("mrope_section", [len(range(section, pairs, 3)) for section in range(3)])
    return config


def has_mtp(config):
    return bool(config.get("text_config", config).get("mtp_num_hidden_layers"))


def gguf_source(checkpoint_dir, folder):
    """A copy of the checkpoint for the converter: weights linked, tokenizer.json and config.json amended."""
    edits = {"tokenizer.json": with_one_merge, "config.json": with_mrope_section}
    for file in checkpoint_dir.iterdir():
        if file.name in edits:
            (folder / file.name).write_text(json.dumps(edits[file.name](json.loads(file.read_text()))))
        else:
            (folder / file.name).symlink_to(file.resolve())


def gguf_file(checkpoint_dir):
    """The checkpoint as a float32 GGUF, converted once and cached by digest."""
    checkpoint_dir = Path(checkpoint_dir)
    out = CACHE / "gguf" / f"{directory_sha256(checkpoint_dir)}-{llama_cpp.__version__}-{CONVERSION}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    converter = converter_dir()
    with tempfile.TemporaryDirectory() as tmp:
        gguf_source(checkpoint_dir, Path(tmp))
        # the converter asserts that an MTP export finds MTP layers: checkpoints without them need --no-mtp
        mtp = [] if has_mtp(json.loads((checkpoint_dir / "config.json").read_text())) else ["--no-mtp"]
        partial = out.with_suffix(f".{os.getpid()}.partial")   # concurrent runs each convert, then one wins
        # in a subprocess: the converter puts its own gguf-py and `conversion` package on sys.path
        done = subprocess.run([sys.executable, "-m", __name__, str(converter), tmp, str(partial), *mtp],
                              cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"convert_hf_to_gguf.py failed on {checkpoint_dir}:\n{done.stderr[-3000:]}")
    partial.rename(out)
    return out


def convert(converter, source, out, *options):
    """convert_hf_to_gguf.py SOURCE --outtype f32 --outfile OUT, with one patch: get_vocab_base_pre names the
    pre-tokenizer by hashing the token ids of a probe text and accepts only released tokenizers' hashes, which a
    home-made tokenizer never matches; name Qwen3.5's directly (tokens and merges still come from tokenizer.json)."""
    sys.path[:0] = [converter, str(Path(converter) / "gguf-py")]
    import conversion.base
    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
    script = str(Path(converter) / "convert_hf_to_gguf.py")
    sys.argv = [script, source, "--outtype", "f32", "--outfile", out, *options]
    runpy.run_path(script, run_name="__main__")


# ----------------------------------------------------------------------------------------------------------------
# The engine.

@llama_cpp.llama_log_callback
def keep_errors(level, text, user_data):
    """libllama's log: keep the errors, which say why a load failed, and drop the rest. (The bindings' own callback
    maps ggml's levels by an older enum, INFO 1 ... ERROR 3, so it prints warnings as errors and drops errors.)"""
    if level == GGML_LOG_LEVEL_ERROR:
        libllama_errors.append(text.decode(errors="replace").strip())


def new_context(model, n_ctx, n_batch, n_seq_max, kv_unified=False):
    """A float32 context (KV cache and recurrent states, no flash attention) for n_seq_max sequences, each keeping
    MAX_DRAFT recurrent-state snapshots, with n_ubatch = min(n_batch, llama.cpp's default 512)."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, min(n_batch, params.n_ubatch)
    params.n_seq_max = n_seq_max
    params.kv_unified = kv_unified
    params.n_rs_seq = MAX_DRAFT
    params.n_threads = params.n_threads_batch = min(4, os.cpu_count() or 1)
    params.type_k = params.type_v = llama_cpp.GGML_TYPE_F32
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    context = internals.LlamaContext(model=model, params=params, verbose=False)
    if llama_cpp.llama_n_rs_seq(context.ctx) != MAX_DRAFT:
        context.close()
        raise RuntimeError("llama.cpp keeps no recurrent-state snapshots for this model (n_rs_seq clamped to 0)")
    return context


class Session:
    """One llama.cpp context holding one sequence. A state is its length: valid until the next call changes it."""

    def __init__(self, gguf):
        libllama_errors.clear()
        try:
            self.model = internals.LlamaModel(path_model=str(gguf), params=llama_cpp.llama_model_default_params(),
                                              verbose=False)
        except ValueError as e:
            raise ValueError(f"{e}: {' / '.join(libllama_errors)}") from None
        self.context = new_context(self.model, n_ctx=N_CTX, n_batch=N_CTX, n_seq_max=1)
        self.batch = internals.LlamaBatch(n_tokens=N_CTX, embd=0, n_seq_max=1, verbose=False)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model.model))
        self.length = 0

    def run(self, state, tokens):
        """Append token ids to the sequence -> logits of every one of them (T, V)."""
        if state != self.length:
            raise RuntimeError(f"state of length {state} is stale: the context now holds {self.length} tokens")
        self.batch.set_batch([int(t) for t in tokens], n_past=self.length, logits_all=True)
        self.context.decode(self.batch)
        self.length += len(tokens)
        logits = np.ctypeslib.as_array(self.context.get_logits(), shape=(len(tokens), self.n_vocab))
        return logits.astype(np.float32, copy=True), self.length


class PrefixEntry(NamedTuple):
    """A prefix-cache entry: a sequence's state as llama_state_seq_get_data_ext serialises it, and its length."""
    data: ctypes.Array
    length: int


class ServedTrace:
    """One llama.cpp context serving a trace's requests as llama-server serves its slots: a unified KV cache (the
    server's default) with the checkpoint's positions, a sequence id per live request (the lowest free one: a released
    request's sequence is cleared and its id taken by the next new request), each sequence keeping MAX_DRAFT
    recurrent-state snapshots so that a speculative commit is llama_memory_seq_rm on that sequence, and prefix-cache
    entries held in host memory as the server's prompt cache holds them (llama_state_seq_get_data_ext, restored into
    the new request's sequence with llama_state_seq_set_data_ext)."""

    def __init__(self, session, slots):
        n_ctx = llama_cpp.llama_model_n_ctx_train(session.model.model)
        self.context = new_context(session.model, n_ctx=n_ctx, n_batch=n_ctx, n_seq_max=slots, kv_unified=True)
        self.n_vocab = session.n_vocab
        self.free = list(range(slots))
        self.seq, self.length = {}, {}          # request -> sequence id, positions it holds

    def close(self):
        self.context.close()

    def start(self, request):
        if not self.free:
            raise RuntimeError(f"request {request!r}: all {len(self.seq)} sequences are taken by live requests")
        self.seq[request], self.length[request] = self.free.pop(0), 0

    def release(self, request):
        seq = self.seq.pop(request)
        del self.length[request]
        if not llama_cpp.llama_memory_seq_rm(self.context.memory, seq, -1, -1):
            raise RuntimeError(f"llama_memory_seq_rm refused to clear sequence {seq}")
        bisect.insort(self.free, seq)

    def decode(self, rows):
        """Rows (request, token ids, n): each appended to its request's sequence, all in one llama_batch and one
        llama_decode, with logits for each row's last n tokens -> {request: logits (n, V)}."""
        total = sum(len(tokens) for _, tokens, _ in rows)
        batch = internals.LlamaBatch(n_tokens=total, embd=0, n_seq_max=1, verbose=False)
        try:
            wanted, i = {}, 0
            for request, tokens, n in rows:
                seq, start = self.seq[request], self.length[request]
                for j, token in enumerate(tokens):
                    batch.batch.token[i], batch.batch.pos[i] = int(token), start + j
                    batch.batch.n_seq_id[i], batch.batch.seq_id[i][0] = 1, seq
                    batch.batch.logits[i] = j >= len(tokens) - n
                    i += 1
                wanted[request] = range(i - n, i)
                self.length[request] += len(tokens)
            batch.batch.n_tokens = total
            libllama_errors.clear()
            code = llama_cpp.llama_decode(self.context.ctx, batch.batch)
            if code:
                raise RuntimeError(f"llama_decode returned {code}: {' / '.join(libllama_errors)}")
        finally:
            batch.close()
        return {request: np.stack([self.logits_of(i) for i in rows_out]) for request, rows_out in wanted.items()}

    def logits_of(self, i):
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.context.ctx, i),
                                     shape=(self.n_vocab,)).astype(np.float32, copy=True)

    def keep(self, request, start, n):
        """Keep the first n positions of those verified from `start`: the recurrent layers return to their snapshot
        of position start + n - 1, the attention layers drop the later KV cells."""
        if start + n < self.length[request]:
            if not llama_cpp.llama_memory_seq_rm(self.context.memory, self.seq[request], start + n, -1):
                raise RuntimeError(f"llama_memory_seq_rm refused to roll sequence {self.seq[request]} back to "
                                   f"position {start + n}")
        self.length[request] = start + n

    def save(self, request):
        seq = self.seq[request]
        size = llama_cpp.llama_state_seq_get_size_ext(self.context.ctx, seq, WHOLE_STATE)
        data = (ctypes.c_uint8 * size)()
        if llama_cpp.llama_state_seq_get_data_ext(self.context.ctx, data, size, seq, WHOLE_STATE) != size:
            raise RuntimeError(f"llama_state_seq_get_data_ext wrote less than the {size} bytes of sequence {seq}")
        return PrefixEntry(data, self.length[request])

    def restore(self, request, entry):
        self.start(request)
        seq = self.seq[request]
        size = len(entry.data)
        if llama_cpp.llama_state_seq_set_data_ext(self.context.ctx, entry.data, size, seq, WHOLE_STATE) != size:
            raise RuntimeError(f"llama_state_seq_set_data_ext could not restore a prefix-cache entry into sequence "
                               f"{seq}")
        self.length[request] = entry.length


def apply_sampler(sampler, row):
    """llama.cpp's sampler chain over one logits row -> (surviving ids, their probabilities as left by the chain,
    the selected id)."""
    candidates = internals.LlamaTokenDataArray(n_vocab=len(row))
    candidates.copy_logits(np.asarray(row, dtype=np.float32))
    llama_cpp.llama_sampler_apply(sampler.sampler, ctypes.byref(candidates.candidates))
    kept = candidates.candidates_data[:candidates.candidates.size]
    return kept.id.copy(), kept.p.copy(), int(kept.id[candidates.candidates.selected])


def greedy_sampler():
    sampler = internals.LlamaSampler()
    sampler.add_greedy()
    return sampler


def bindings_sampler(sampling, seed=SEED):
    """The chain Llama.sample / Llama.generate build for these settings (llama.py _init_sampler): top-k, top-p, then
    temperature, then the dist draw with its own generator, seeded (typical_p = 1 and min_p = 0 are no-ops); the
    greedy sampler at temperature 0."""
    if sampling["temperature"] == 0:
        return greedy_sampler()
    sampler = internals.LlamaSampler()
    sampler.add_top_k(sampling["top_k"])
    sampler.add_top_p(sampling["top_p"], 1)
    sampler.add_temp(sampling["temperature"])
    sampler.add_dist(seed)
    return sampler


@register_engine("llama_cpp")
class LlamaCpp(Engine):
    features = frozenset({"prefill", "decode", "extend", "greedy", "sampling", "speculative", "rollback:per-position",
                          "accept:greedy", "draws", "accept:draws", "moe", "untied_embeddings", "gva_ratio_3",
                          "unequal_head_dims", "conv_kernel_3", "partial_rotary_0.5", "multimodal_layout",
                          "per_expert_weights", "mtp_weights", "trace", "snapshot"})

    def __init__(self):
        llama_cpp.llama_log_set(keep_errors, ctypes.c_void_p(0))

    def load(self, checkpoint_dir):
        return Session(gguf_file(checkpoint_dir))

    def prefill(self, session, tokens):
        llama_cpp.llama_memory_clear(session.context.memory, True)
        session.length = 0
        return session.run(0, tokens)

    def decode(self, session, state, tokens):
        return session.run(state, tokens)

    def greedy(self, session, prompt, n):
        """llama.cpp's greedy sampler on each step's logits, decoding one token at a time."""
        sampler = greedy_sampler()
        logits, state = self.prefill(session, prompt)
        tokens = [apply_sampler(sampler, logits[-1])[2]]
        while len(tokens) < n:
            logits, state = session.run(state, tokens[-1:])
            tokens.append(apply_sampler(sampler, logits[-1])[2])
        return np.array(tokens, dtype=np.int64)

    def sample(self, logits, sampling, uniforms):
        """Probabilities as the bindings' sampler chain leaves them; the draw is the suite's inverse CDF with the
        case's uniforms, since llama.cpp's dist sampler draws from its own generator."""
        p = np.zeros(logits.shape, dtype=np.float32)
        for row, out in zip(logits, p):
            ids, probabilities, selected = apply_sampler(bindings_sampler(sampling), row)
            out[ids] = probabilities if sampling["temperature"] else ids == selected
        return p, inverse_cdf_draw(p, uniforms)

    def draw(self, logits, sampling, n, seed):
        """The bindings' sampler chain, its dist sampler drawing with llama.cpp's own generator (seeded once)."""
        sampler = bindings_sampler(sampling, seed)
        return np.array([[apply_sampler(sampler, row)[2] for _ in range(n)] for row in logits], dtype=np.int64)

    def accept_draws(self, draft, q, logits, sampling, n, seed):
        """common_sampler_sample_and_accept_n (common/sampling.cpp) with the bindings' chain: sample the target's token
        at each verified row with llama.cpp's own generator and accept while it equals the draft; q is not read."""
        sampler, rounds = bindings_sampler(sampling, seed), []
        for _ in range(n):
            for i, token in enumerate([*draft, None]):
                sampled = apply_sampler(sampler, logits[i])[2]
                if sampled != token:
                    rounds.append((i, sampled))
                    break
        return tuple(np.array(column, dtype=np.int64) for column in zip(*rounds))

    def verify(self, session, state, tokens, rollback):
        logits, _ = session.run(state, tokens)
        return logits, state

    def commit(self, session, start, n):
        """Drop the verified positions after the first n; the recurrent layers return to their snapshot of position
        start + n - 1 (kept because n_rs_seq > 0), the attention layers drop those KV cells."""
        if not llama_cpp.llama_memory_seq_rm(session.context.memory, 0, start + n, -1):
            raise RuntimeError(f"llama_memory_seq_rm refused to roll back to position {start + n}")
        session.length = start + n
        return session.length

    def accept(self, draft, q, logits, sampling, uniforms):
        """common_sampler_sample_and_accept_n (common/sampling.cpp) with the greedy sampler: sample each verified
        row, accept while the sample equals the draft."""
        accepted, tokens = self.accept_draws(draft, q, logits, {"temperature": 0}, 1, SEED)
        return int(accepted[0]), int(tokens[0])

    def run_trace(self, session, batches, rollback, slots):
        """The batched path: one context per trace with `slots` sequences (ServedTrace); each batch's rows in one
        llama_decode, then each verify row accepted (self.accept) and committed on its own sequence in step order."""
        accept = self.target(session, rollback).accept
        served, cache = ServedTrace(session, slots), {}
        try:
            for b, batch in enumerate(batches):
                logits = None
                for s, step in enumerate(batch):
                    if logits is None and step["op"] in TRACE_ROWS:
                        logits = served.decode(batch_rows(served, batch))
                    yield b, s, trace_step(served, cache, step, logits, accept)
        finally:
            served.close()


TRACE_ROWS = ("prefill", "verify")


def batch_rows(served, batch):
    """A batch's rows as ServedTrace.decode takes them, starting a sequence for each new request's prefill: a prefill
    row wants the logits of its last token, a verify row those of all its tokens."""
    rows = [step for step in batch if step["op"] in TRACE_ROWS]
    requests = [step["request"] for step in rows]
    if len(set(requests)) != len(requests):
        raise ValueError(f"a trace batch has two rows on one request: {requests}")
    for step in rows:
        if step["op"] == "prefill" and step["request"] not in served.seq:
            served.start(step["request"])
    return [(step["request"], step["tokens"], 1 if step["op"] == "prefill" else len(step["tokens"])) for step in rows]


def trace_step(served, cache, step, logits, accept):
    """One step after its batch's rows were decoded -> its outputs, as reference.run_trace names them (no state: it
    leaves llama.cpp only as opaque bytes)."""
    request, op = step["request"], step["op"]
    if op == "prefill":
        return {"logits": logits[request]}
    if op == "verify":
        tokens, rule = step["tokens"], step["commit"]
        start = served.length[request] - len(tokens)
        target = R.Target(None, lambda state, tokens: (logits[request], None, start),
                          lambda start, n: served.keep(request, start, n), accept, None)
        r = R.speculative_round(target, None, tokens, rule.get("q"), R.sampling_of(rule), rule.get("uniforms"),
                                rule.get("stop", ()), rule.get("keep"))
        decided = {} if r.committed is None else {"accepted": r.accepted, "committed": r.committed,
                                                  "finished": R.finished(r.committed, rule.get("stop", ()))}
        return {"logits": r.logits, **decided}
    if op == "snapshot":
        cache[step["key"]] = served.save(request)
    elif op == "restore":
        served.restore(request, cache[step["key"]])
    elif op == "release":
        served.release(request)
    else:
        raise ValueError(f"trace step on {request!r}: unknown op {op!r}")
    return {}


if __name__ == "__main__":
    convert(*sys.argv[1:])
