"""Engine adapters: one small class per engine, registered by name, declaring the features it supports.

An engine that can only "load a checkpoint directory, run token ids -> logits, continue with more tokens" implements
load, prefill and decode and declares {"prefill", "decode", "greedy"} plus the checkpoint features it handles; every
other case is SKIP with the reason recorded in its expectations file. INTERPRETING.md has the full contract; an engine
outside Python runs as a process (process.py, INTERPRETING.md section 8).

Arrays cross the interface as NumPy: token ids int64 (T,), logits float32 (T, V). `state` and `model` are whatever
the engine likes; the runner only passes them back. Sampling settings are a dict {temperature, top_k, top_p}.
"""

import importlib
import re
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import reference as R
from ..format import PRECISIONS, features_named

ENGINES = {}
ENTRY_POINT_GROUP = "qwen35.conformance.engines"   # where installed packages register Engine classes by name
# The extra (pyproject.toml) that installs what each shipped adapter imports.
EXTRAS = {"jax": "jax", "jax_bf16": "jax", "transformers": "transformers", "llama_cpp": "llama-cpp", "mlx": "mlx"}
SHIPPED = sorted({p.stem for p in Path(__file__).parent.glob("*.py")} - {"__init__", "process"})


class EngineError(Exception):
    """An engine that cannot be run as asked: unknown, a dependency missing, a bad class or process (one line on the
    command line, exit 2)."""


class UnknownEngine(EngineError, LookupError):
    pass


def register_engine(name):
    def register(cls):
        cls.name = name
        ENGINES[name] = cls
        return cls
    return register


def get_engine(spec, timeout=None):
    """The engine `spec` names, started and checked:
        NAME                  a shipped adapter (conformance/engines/NAME.py), one registered with @register_engine,
                              or one an installed package registers under the entry-point group ENTRY_POINT_GROUP
        package.module:Class  an Engine subclass in any importable module
        exec:COMMAND ARGS     a process that speaks the engine protocol (process.py); `timeout`: seconds it may take
                              to answer one request
    An adapter's optional dependencies are imported only when its engine is asked for."""
    if spec.startswith("exec:"):
        from .process import ProcessEngine
        engine = ProcessEngine(spec[len("exec:"):], **({"timeout": timeout} if timeout else {}))
    else:
        cls = imported_class(spec) if ":" in spec else registered_class(spec)
        try:
            engine = cls()
        except Exception as e:
            raise EngineError(f"engine {spec}: creating {cls!r} failed: {type(e).__name__}: {e}") from None
    try:
        return validated_engine(engine, spec)
    except EngineError:
        if isinstance(engine, Engine):   # a refused engine holds nothing afterwards (a process engine: its process)
            engine.close()
        raise


def installed_engines():
    """{name: entry point} of the engines installed packages register (ENTRY_POINT_GROUP)."""
    return {point.name: point for point in entry_points(group=ENTRY_POINT_GROUP)}


def known_engines():
    """The names --engine takes: the shipped adapters, those registered here and those installed packages register."""
    return sorted({*SHIPPED, *ENGINES, *installed_engines()})


def registered_class(name):
    if name not in ENGINES and name in SHIPPED:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            raise EngineError(str(R.missing_extra(e, EXTRAS.get(name, "test"), f"engine {name}"))) from None
    if name in ENGINES:
        return ENGINES[name]
    registered = installed_engines()
    if name in registered:
        return imported_class(registered[name].value)
    raise UnknownEngine(f"no engine {name!r}; known: {', '.join(known_engines())}, or give "
                        "package.module:Class or exec:COMMAND (INTERPRETING.md sections 7 and 8)")


def imported_class(spec):
    """package.module:Class -> the class, with one-line errors for what cannot be imported."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise EngineError(f"engine {spec}: no module {e.name!r} (install its package, or put its folder on "
                              "PYTHONPATH)") from None
        raise EngineError(f"engine {spec}: {module_name} needs {e.name}, which is not installed") from None
    except Exception as e:   # the engine's own module failing to import: its message, not our traceback
        raise EngineError(f"engine {spec}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        raise EngineError(f"engine {spec}: module {module_name} has no {attr!r}")
    return getattr(module, attr)


def validated_engine(engine, spec):
    """The engine with its features expanded from groups (format.FEATURE_GROUPS) and its precision checked."""
    features = getattr(engine, "features", None)
    if not isinstance(features, (set, frozenset, list, tuple)) or not all(isinstance(f, str) for f in features):
        raise EngineError(f"engine {spec}: `features` must be a set of feature names, not {features!r:.200}")
    try:
        engine.features = frozenset(features_named(features))
    except ValueError as e:
        raise EngineError(f"engine {spec}: {e}") from None
    precision = getattr(engine, "precision", None)
    if precision not in PRECISIONS:
        raise EngineError(f"engine {spec}: precision {precision!r}, expected one of {', '.join(PRECISIONS)}")
    if getattr(engine, "name", "?") == "?":
        engine.name = spec
    return engine


class Timed(NamedTuple):
    """A greedy run timed (Engine.timed_greedy): what the benchmarks read."""
    tokens: list
    prefill_s: float            # the prompt's forward and the first token
    decode_s: float             # the other len(tokens) - 1 tokens
    compile_s: float = 0.0      # jit compilation before the timed run, where the engine has one
    stats: dict = None          # the engine's own generation stats (jax_impl: tokens per call, acceptance)

    @property
    def decode_tok_s(self):
        return (len(self.tokens) - 1) / self.decode_s


class Engine:
    """Subclass, set `features`, implement the methods the declared features need:

        feature                          methods
        prefill                          load, prefill
        decode / extend                  decode (one token / several tokens after a non-empty state)
        greedy                           greedy (the default here drives prefill + decode + argmax)
        (benchmarks)                     timed_greedy (the same default, timed)
        state_export                     export_state
        rms_norm ... moe_layer           run_op
        sampling                         sample
        speculative, rollback:*          verify, commit
        accept:greedy, accept:sampling   accept
        tree, accept:tree-sampling       verify_tree, commit_tree, accept_tree
        accept:tree-draws                accept_tree_draws (the statistical pack)
        trace                            (the default run_trace drives the methods above, one step at a time)
        trace:tree                       (tree rows in a trace: the default run_trace drives the tree methods)
        snapshot                         copy_state (or a run_trace override that keeps prefix-cache entries itself)
        mtp                              mtp_hidden, mtp_draft (export_mtp_state with state_export)
        dflash                           load_dflash, dflash_features, dflash_draft (export_dflash_state with
                                         state_export)
        draws, accept:draws              draw, accept_draws (the statistical pack: `python -m conformance sample`)
    """
    name = "?"
    features = frozenset() # feature names, or groups of them (format.FEATURE_GROUPS)
    precision = "fp32"     # the arithmetic (format.PRECISIONS): "bf16" compares with tolerances.json's bf16 profile
    expectations = None    # the path of the engine's expectations file, for engines shipped in other packages

    def load(self, checkpoint_dir):
        """Checkpoint directory (config.json + safetensors, Hugging Face layout) -> model handle."""
        raise NotImplementedError

    def prefill(self, model, tokens):
        """Token ids (T,) from an empty state -> (logits (T, V), state)."""
        raise NotImplementedError

    def decode(self, model, state, tokens):
        """Continue `state` with token ids (T,) -> (logits (T, V), new state). May consume `state`: the runner never
        uses a state again after passing it here."""
        raise NotImplementedError

    def export_state(self, model, state):
        """The state as arrays named as in INTERPRETING.md (state.layers.{i}.S, ...). Must not change `state`."""
        raise NotImplementedError

    def greedy(self, model, prompt, n):
        """n greedy tokens after the prompt (no stop at EOS) -> int64 (n,)."""
        return np.array(self.timed_greedy(model, prompt, n).tokens, dtype=np.int64)

    def timed_greedy(self, model, prompt, n):
        """greedy, timed: the benchmarks' measure (bench/). The default drives prefill + decode + argmax; the
        timers stop when the token is on the host."""
        start = time.perf_counter()
        logits, state = self.prefill(model, np.asarray(prompt, dtype=np.int64))
        tokens = [int(np.argmax(logits[-1]))]
        prefilled = time.perf_counter()
        while len(tokens) < n:
            logits, state = self.decode(model, state, np.array(tokens[-1:], dtype=np.int64))
            tokens.append(int(np.argmax(logits[-1])))
        return Timed(tokens, prefilled - start, time.perf_counter() - prefilled)

    def run_op(self, kind, inputs, attrs):
        """A primitive or layer case: inputs and attrs as in the manifest -> {output name: array}."""
        raise NotImplementedError

    def sample(self, logits, sampling, uniforms):
        """Logits (N, V), uniforms (N,) -> (probabilities (N, V), token ids (N,))."""
        raise NotImplementedError

    def verify(self, model, state, tokens, rollback):
        """One pass over [last committed token, K drafts], keeping what `rollback` needs -> (logits (K+1, V), pending)."""
        raise NotImplementedError

    def commit(self, model, pending, n):
        """Keep the first n verified positions -> state."""
        raise NotImplementedError

    def accept(self, draft, q, logits, sampling, uniforms):
        """Drafts (K,), draft distributions q (K, V) or None, verify logits (K+1, V), uniforms (K+1,) or None ->
        (number of accepted drafts, the target's next token)."""
        raise NotImplementedError

    def verify_tree(self, model, state, tokens, parents, rollback):
        """One pass over a draft tree: tokens (N,), parents (N,) (parents[0] = -1: node 0 is the root, the last
        committed token; every other node's parent precedes it), keeping what `rollback` needs -> (logits (N, V): row
        i the next-token logits after the root-to-node-i path, pending)."""
        raise NotImplementedError

    def commit_tree(self, model, pending, path):
        """Keep an accepted root-to-node path [0, ..., L] (node indices) -> the state after consuming its tokens."""
        raise NotImplementedError

    def accept_tree(self, tokens, parents, q, logits, sampling, uniforms):
        """A tree's acceptance: tokens, parents (N,), q (N-1, V) or None (row c-1: node c's draft distribution),
        verify logits (N, V), uniforms (N,) or None -> (the accepted path [0, ..., L], the target's next token)."""
        raise NotImplementedError

    def accept_tree_draws(self, tokens, parents, q, logits, sampling, n, seed):
        """n independent rounds of the engine's acceptance of the same tree (tokens, parents (N,), q (N-1, V), verify
        logits (N, V)) with its own random numbers -> (the last accepted node of each round (n,), the next token (n,))."""
        raise NotImplementedError

    def draw(self, logits, sampling, n, seed):
        """Logits (N, V) -> int64 (N, n): n tokens drawn from each row with the engine's own random numbers, as it
        samples when it generates (seeded with `seed` where the engine takes a seed)."""
        raise NotImplementedError

    def accept_draws(self, draft, q, logits, sampling, n, seed):
        """n independent rounds of the engine's speculative acceptance of the same drafts (K,), draft distributions
        q (K, V) and verify logits (K+1, V), with its own random numbers -> (accepted drafts (n,), next tokens (n,))."""
        raise NotImplementedError

    def mtp_hidden(self, model, state, tokens):
        """Continue the target (state None: from empty) with token ids (T,) -> (the hidden states (T, D) the engine
        feeds its MTP head for these positions, new state). May consume `state`."""
        raise NotImplementedError

    def mtp_draft(self, model, mtp_state, tokens, hidden, chain):
        """The MTP head as a drafter (mtp_state None: an empty cache). First over the new pairs (hidden (n, D), the
        target's hidden state at each kept position; tokens (n,), the token after it), then chained len(chain) times,
        each depth fed the head's own output hidden state of the previous depth and the next token of `chain` ->
        (logits (len(chain) + 1, V) and output hidden states (len(chain) + 1, D) at depths 1, 2, ..., the head's
        state after the new pairs only: the chain's entries dropped). Must not change `mtp_state`."""
        raise NotImplementedError

    def export_mtp_state(self, model, mtp_state):
        """The MTP head's state as arrays named as a state is (state.layers.0.k, .v, state.length)."""
        return self.export_state(model, mtp_state)

    def load_dflash(self, model, drafter_dir):
        """A DFlash drafter's checkpoint directory (z-lab's layout: docs/dflash.md) for this target -> drafter handle."""
        raise NotImplementedError

    def dflash_features(self, model, drafter, state, tokens):
        """Continue the target (state None: from empty) with token ids (T,) -> (the features (T, len(taps) D) the
        engine feeds its drafter for these positions: the outputs of the drafter's target_layer_ids, concatenated in
        that order, before fc; new state). May consume `state`."""
        raise NotImplementedError

    def dflash_draft(self, model, drafter, dflash_state, features, last_token, k):
        """One drafting round (dflash_state None: an empty context): append the features (n, len(taps) D) of the n
        newly verified positions to the drafter's context, run the block [last_token, MASK x k] at the next k + 1
        positions -> (the logits (k, V) of the k mask slots, the drafter's state covering the context only: the
        block cropped back out). Must not change `dflash_state`."""
        raise NotImplementedError

    def export_dflash_state(self, model, drafter, dflash_state):
        """The drafter's context cache as arrays named as a state is (state.layers.{i}.k, .v per drafter layer, k
        after k_norm and RoPE, and state.length)."""
        raise NotImplementedError

    def copy_state(self, model, state):
        """A copy of `state` that later calls cannot change: a prefix-cache entry that new requests start from."""
        raise NotImplementedError

    def close(self):
        """Release what the engine holds once the run is over (a process engine's process)."""

    def target(self, model, rollback):
        """The engine as a reference.Target, which reference.speculative_round, tree_round and run_trace drive. A row
        without drafts is a plain decoding step: decode, then the argmax or a draw with the supplied uniform."""
        def extend(state, tokens):
            tokens = np.asarray(tokens, dtype=np.int64)
            return self.prefill(model, tokens) if state is None else self.decode(model, state, tokens)

        def verify(state, tokens):
            if len(tokens) == 1:
                logits, state = extend(state, tokens)
                return logits, None, Plain(state)
            logits, pending = self.verify(model, state, np.asarray(tokens, dtype=np.int64), rollback)
            return logits, None, pending

        def commit(pending, n):
            return pending.state if isinstance(pending, Plain) else self.commit(model, pending, n)

        def accept(draft, q, logits, sampling, uniforms):
            if draft:
                return self.accept(draft, q, logits, sampling._asdict(), uniforms)
            if sampling.temperature == 0:
                return 0, int(np.argmax(logits[0]))
            return 0, int(self.sample(logits[:1], sampling._asdict(), uniforms[:1])[1][0])

        def verify_tree(state, tokens, parents):
            logits, pending = self.verify_tree(model, state, np.asarray(tokens, dtype=np.int64),
                                               np.asarray(parents, dtype=np.int64), rollback)
            return logits, None, pending

        def accept_tree(tokens, parents, q, logits, sampling, uniforms):
            path, token = self.accept_tree(tokens, parents, q, logits, sampling._asdict(), uniforms)
            return [int(node) for node in path], int(token)
        return R.Target(extend, verify, commit, accept, lambda state: self.copy_state(model, state), verify_tree,
                        lambda pending, path: self.commit_tree(model, pending, path), accept_tree)

    def run_trace(self, model, batches, rollback, slots):
        """A serving trace (INTERPRETING.md section 4) -> yields (batch, step, outputs) after each step, as
        reference.run_trace, with a state output as export_state names it (dropped without state_export). This
        default runs the steps one by one; an engine with a batched path overrides it and runs each batch's rows
        together, in at most `slots` request slots."""
        for b, s, out in R.run_trace(self.target(model, rollback), batches):
            state = out.pop("state", None)
            if state is not None and "state_export" in self.features:
                out.update(self.export_state(model, state))
            yield b, s, out


class Plain(NamedTuple):
    """What a verify row without drafts leaves for its commit: the decoded state, nothing to roll back."""
    state: object


def inverse_cdf_draw(p, uniforms):
    """The suite's draw (INTERPRETING.md section 4): per row, the first token whose cumulative probability exceeds
    u * total. For engines whose own draw takes no supplied uniform."""
    cdf = np.cumsum(p, axis=-1, dtype=np.float64)
    return np.array([min(np.searchsorted(c, u * c[-1], side="right"), len(c) - 1) for c, u in zip(cdf, uniforms)],
                    dtype=np.int64)


# A case's attrs and weights in reference.py's types, for adapters that run on reference.Config (reference,
# jax). The attrs are named as config.json keys (INTERPRETING.md).

def layer_params(inputs, prefix):
    """Weights stored under checkpoint names -> the nested dict reference.py layers take."""
    return R.nested_params({"model." + n[len(prefix):]: a for n, a in inputs.items() if n.startswith(prefix)})


def layer_config(attrs, hidden_size, **fields):
    """A Config carrying the attrs a layer reads; the rest are filler that the layer does not use."""
    base = dict(model_type="qwen3_5_text", vocab_size=1, hidden_size=hidden_size, num_hidden_layers=1,
                layer_types=("linear_attention",), num_attention_heads=1, num_key_value_heads=1, head_dim=2,
                linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=1, linear_value_head_dim=1,
                linear_conv_kernel_dim=2, rms_norm_eps=1e-6, rope_theta=1.0, partial_rotary_factor=1.0,
                max_position_embeddings=1, tie_word_embeddings=True, intermediate_size=1)
    return R.Config(**{**base, **{k: v for k, v in attrs.items() if k in base}, **fields})


def moe_config(attrs, hidden_size):
    """A Config for one MoE layer: the case's router and expert sizes, no dense FFN."""
    return layer_config(attrs, hidden_size, model_type="qwen3_5_moe_text", intermediate_size=0,
                        **{k: attrs[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                   "shared_expert_intermediate_size")})
