"""The hybrid verification cost model: FLOPs and bytes of decoding one token and of verifying K drafts on a
Qwen3.5-class hybrid, per layer kind and rollback design; a roofline turns them into seconds, and expected tokens
per verify turn those into a predicted speculative-decoding speedup. Pure functions; nothing here measures.

Counting conventions (per pass over T tokens of each of B sequences, with `context` tokens already cached):
  * FLOPs: 2 per multiply-add of every matmul and of the DeltaNet / attention cores. Elementwise work (norms, gates,
    activations, RoPE, softmax) is not counted: under 1% of the FLOPs at these shapes.
  * Weight bytes: every weight byte is read once per pass, whatever B*T (one GEMM with B*T rows). The embedding table
    is not: its B*T gathered rows count as activation bytes. A MoE layer reads the union of the experts its B*T
    tokens route to.
  * State bytes: the DeltaNet state S (Hv*Dk*Dv, fp32) and conv window ((W-1)*C) are read once and written once per
    pass: the state is held on chip across the T tokens, as chunked and fused-recurrent kernels do.
  * KV bytes: attention reads the cached keys and values once per pass (all queries of a GQA group together, as
    flash attention does) and writes the T new ones.
  * Activation bytes: each kernel reads its inputs and writes its outputs once; logits are fp32.

Roofline assumption: a pass is a sequence of kernels (one per layer part) that do not overlap. A kernel takes
max(FLOPs / peak FLOP/s, bytes / bandwidth), where the weight bytes move at the rate a matmul with that many rows
achieves: the peak bandwidth on datasheet hardware, a measured curve on this CPU (its BLAS streams weights several
times slower for 2-64 rows than for 1). Fixed per-call costs (interpreter, dispatch) are a separate, measured
Overhead and are zero for datasheet hardware: its times are lower bounds. A fixed cost per pass would move every
verify/decode ratio toward 1 (better speedups with a free drafter) and every MTP drafting step toward a full step
(worse speedups with the MTP drafter).

Speculative decoding: a drafter proposes K tokens, one verify pass runs K+1 (the last committed token and the
drafts), each draft is accepted with probability a independently of the others, so n, the positions kept, is
n = i + 1 with P(i accepted) = a^i (1 - a) for i < K and a^K for i = K, and the expected tokens per verify are
(1 - a^(K+1)) / (1 - a). Speedup = expected tokens * decode seconds / (draft + verify + expected commit seconds).
Rollback designs (docs/cost-model.md has who uses which):
  re-forward:   snapshot the DeltaNet states before verify; on a partial accept restore them and run the n kept
                tokens through the whole model again: a second weight pass.
  per-position: verify writes the state and conv window after every one of its K+1 positions; commit is an index.
  replay:       verify writes a tape (delta, k, g, qkv per step); on a partial accept n rank-1 updates rebuild the
                state from the pre-verify snapshot: one state read and write, no weights.
"""

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import reference as R

DESIGNS = ("re-forward", "per-position", "replay")
CHUNK = 64  # the chunked gated-delta form's chunk (reference.gated_delta_chunked)


# ----------------------------------------------------------------------------------------------------------------
# Published configurations (docs/architecture.md, "Published configurations"), in config.json field names.

COMMON = dict(model_type="qwen3_5_text", vocab_size=248320, head_dim=256, linear_num_key_heads=16,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
              rms_norm_eps=1e-6, max_position_embeddings=262144, mtp_num_hidden_layers=1,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
MOE = dict(model_type="qwen3_5_moe_text", tie_word_embeddings=False)

# name -> (fields over COMMON, the fields not read from an official config.json). tie_word_embeddings changes the
# memory footprint only: lm_head is read in full every pass either way.
PUBLISHED = {
    "0.8B": (dict(num_hidden_layers=24, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                  num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True), ()),
    "2B": (dict(num_hidden_layers=24, hidden_size=2048, intermediate_size=6144, num_attention_heads=8,
                num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True),
           ("intermediate_size", "linear_num_value_heads", "tie_word_embeddings")),
    "4B": (dict(num_hidden_layers=32, hidden_size=2560, intermediate_size=9216, num_attention_heads=16,
                num_key_value_heads=4, linear_num_value_heads=32, tie_word_embeddings=True), ("tie_word_embeddings",)),
    "9B": (dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=12288, num_attention_heads=16,
                num_key_value_heads=4, linear_num_value_heads=32, tie_word_embeddings=False), ("tie_word_embeddings",)),
    "27B": (dict(num_hidden_layers=64, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                 num_key_value_heads=4, linear_num_value_heads=48, tie_word_embeddings=False), ()),
    "35B-A3B": (dict(MOE, num_hidden_layers=40, hidden_size=2048, num_experts=256, num_experts_per_tok=8,
                     moe_intermediate_size=512, shared_expert_intermediate_size=512, num_attention_heads=16,
                     num_key_value_heads=2, linear_num_value_heads=32), ()),
    "397B-A17B": (dict(MOE, num_hidden_layers=60, hidden_size=4096, num_experts=512, num_experts_per_tok=10,
                       moe_intermediate_size=1024, shared_expert_intermediate_size=1024, num_attention_heads=32,
                       num_key_value_heads=2, linear_num_value_heads=64), ("linear_num_value_heads",)),
}


def published_config(name):
    return R.config_from_dict({**COMMON, **PUBLISHED[name][0]})


def parameters(cfg, active=False):
    """Parameters of the text model without MTP, lm_head counted once when tied; active: per token (k of E experts)."""
    shapes = R.checkpoint_shapes(cfg, with_mtp=False)
    tied = cfg.tie_word_embeddings
    total = sum(math.prod(s) for name, s in shapes.items() if not (tied and name == "lm_head.weight"))
    if active and cfg.is_moe:
        idle = cfg.num_experts - cfg.num_experts_per_tok
        total -= cfg.num_hidden_layers * idle * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return total


# ----------------------------------------------------------------------------------------------------------------
# Precision and hardware

@dataclass(frozen=True)
class Precision:
    """Bytes per element."""
    name: str
    weight: float
    activation: float      # activations, conv windows, tape k and qkv
    state: float           # DeltaNet recurrent state, tape delta and g (fp32 in every Qwen3.5 runtime)
    kv: float


BF16 = Precision("bf16", 2, 2, 4, 2)              # the published checkpoints
Q4 = Precision("4-bit", 0.5 + 4 / 64, 2, 4, 2)    # MLX 4-bit: bf16 scale and bias per group of 64
FP32 = Precision("fp32", 4, 4, 4, 4)              # this project's CPU benchmarks


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float                  # peak matmul FLOP/s at the model's precision
    bandwidth: float              # memory bandwidth, bytes/s
    source: str
    matmul_rates: tuple = ()      # ((rows, weight bytes/s a matmul over `rows` activation rows streams), ...)

    def weight_bandwidth(self, rows):
        """Bytes/s at which a matmul with `rows` rows reads its weights: the measured curve, log-interpolated in
        rows and clamped at its ends, or the peak bandwidth."""
        if not self.matmul_rates:
            return self.bandwidth
        points = sorted(self.matmul_rates)
        if rows <= points[0][0]:
            return points[0][1]
        for (r0, b0), (r1, b1) in zip(points, points[1:]):
            if rows <= r1:
                w = math.log(rows / r0) / math.log(r1 / r0)
                return b0 ** (1 - w) * b1 ** w
        return points[-1][1]


H200 = Hardware("H200", 989e12, 4.8e12, "NVIDIA H200 SXM datasheet: 989 TFLOP/s dense bf16 tensor cores, "
                                        "HBM3e 4.8 TB/s")
M4_MAX = Hardware("M4 Max", 18e12, 546e9, "Apple M4 Max, 40-core GPU: 546 GB/s unified memory (Apple); about "
                                          "18 TFLOP/s fp16/fp32 (40 cores x 128 lanes x 2 x ~1.8 GHz, an estimate)")
DATASHEET = (H200, M4_MAX)


@dataclass(frozen=True)
class Overhead:
    """Fixed seconds per call that no roofline sees (interpreter, dispatch), measured per engine on a micro model
    (bench/measure.py). forward: ((T, s), ...) per forward pass over T tokens; verify: ((design, s), ...) what a
    design adds to a verify pass; commit: ((design, n, s), ...) per partial-accept commit keeping n positions.
    A lookup takes the nearest measured T or n; tuples keep a Setting hashable, so round costs can be cached.
    round: seconds per speculative round beyond its passes (drafter and acceptance bookkeeping)."""
    forward: tuple = ()
    verify: tuple = ()
    commit: tuple = ()
    round: float = 0.0

    def forward_s(self, T):
        return nearest(self.forward, T)

    def verify_s(self, design):
        return sum(s for d, s in self.verify if d == design)

    def commit_s(self, design, n):
        return nearest(tuple((m, s) for d, m, s in self.commit if d == design), n)


def nearest(pairs, key):
    """The value whose key is nearest `key` (the smaller key on a tie); 0 without pairs."""
    return min(pairs, key=lambda p: (abs(p[0] - key), p[0]))[1] if pairs else 0.0


# ----------------------------------------------------------------------------------------------------------------
# Kernels: one per layer part

@dataclass(frozen=True)
class Kernel:
    layer: str                 # the breakdown key: embedding, deltanet, attention, mlp, moe, lm_head, rollback
    name: str
    rows: float = 1            # activation rows each weight meets (B*T; tokens per loaded expert for MoE)
    flops: float = 0.0
    weight_bytes: float = 0.0
    state_bytes: float = 0.0
    kv_bytes: float = 0.0
    act_bytes: float = 0.0

    @property
    def bytes(self):
        return self.weight_bytes + self.state_bytes + self.kv_bytes + self.act_bytes


def kernel_seconds(kernel, hw):
    memory = (kernel.weight_bytes / hw.weight_bandwidth(kernel.rows)
              + (kernel.state_bytes + kernel.kv_bytes + kernel.act_bytes) / hw.bandwidth)
    return max(kernel.flops / hw.flops, memory)


def seconds(kernels, hw):
    return sum(kernel_seconds(k, hw) for k in kernels)


def totals(kernels):
    """{layer kind: {flops, weight_bytes, state_bytes, kv_bytes, act_bytes}} summed over its kernels."""
    out = {}
    for k in kernels:
        row = out.setdefault(k.layer, dict.fromkeys(("flops", "weight_bytes", "state_bytes", "kv_bytes", "act_bytes"),
                                                    0.0))
        for name in row:
            row[name] += getattr(k, name)
    return out


def matmul(layer, name, params, rows, inputs, outputs, p, vectors=0):
    """A group of matmuls over `params` weights applied to `rows` activation rows of `inputs` -> `outputs` features;
    `vectors`: norm weights and biases read along (bytes, no FLOPs counted)."""
    return Kernel(layer, name, rows, flops=2 * rows * params, weight_bytes=(params + vectors) * p.weight,
                  act_bytes=rows * (inputs + outputs) * p.activation)


def gated_delta_flops(T, Dk, Dv):
    """Core FLOPs of the chunked gated delta rule per value head over T tokens, chunk by chunk (c <= 64 tokens):
    Wk S, Q S, K^T Delta (2 c Dk Dv each), the decay of S (Dk Dv), beta K K^T and Q K^T (2 c^2 Dk each), the masked
    (Q K^T) Delta (2 c^2 Dv) and the two triangular solves (c^2 Dv + c^2 Dk). At T = 1 this is the recurrent step's
    7 Dk Dv (decay 1, S^T k 2, rank-1 update 2, S^T q 2) plus 5 Dk + 3 Dv."""
    chunks = [CHUNK] * (T // CHUNK) + ([T % CHUNK] if T % CHUNK else [])
    return sum(6 * c * Dk * Dv + Dk * Dv + c * c * (5 * Dk + 3 * Dv) for c in chunks)


def deltanet_sizes(cfg, p):
    """Bytes per DeltaNet layer and sequence: the state S, the conv window, one step of the replay tape."""
    Hk, Hv, Dk, Dv, C = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim, cfg.conv_dim)
    tape_step = Hv * Dv * p.state + Hk * Dk * p.activation + Hv * p.state + C * p.activation   # delta, k, g, qkv
    return Hv * Dk * Dv * p.state, (cfg.linear_conv_kernel_dim - 1) * C * p.activation, tape_step


def deltanet_kernels(cfg, T, p, batch):
    D, C, Vd, Hk, Hv, Dk, Dv, W = (cfg.hidden_size, cfg.conv_dim, cfg.value_dim, cfg.linear_num_key_heads,
                                   cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                   cfg.linear_conv_kernel_dim)
    rows = batch * T
    state, window, _ = deltanet_sizes(cfg, p)
    # in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj; vectors: input norm, dt_bias, A_log, gated norm
    projections = matmul("deltanet", "projections", (C + Vd + 2 * Hv) * D + D * Vd, rows, D + Vd,
                         C + Vd + 2 * Hv + D, p, vectors=D + 2 * Hv + Dv)
    conv = Kernel("deltanet", "conv", rows, flops=2 * rows * C * W, weight_bytes=C * W * p.weight,
                  state_bytes=2 * batch * window, act_bytes=2 * rows * C * p.activation)
    core = Kernel("deltanet", "recurrence", rows, flops=batch * Hv * gated_delta_flops(T, Dk, Dv),
                  state_bytes=2 * batch * state, act_bytes=rows * (2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv) * p.activation)
    return [projections, conv, core]


def attention_kernels(cfg, T, context, p, batch):
    D, Hq, Hkv, Dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rows = batch * T
    params = (2 * Hq * Dh + 2 * Hkv * Dh) * D + D * Hq * Dh                       # q (with its gate), k, v, o
    projections = matmul("attention", "projections", params, rows, D + Hq * Dh, 2 * Hq * Dh + 2 * Hkv * Dh + D, p,
                         vectors=D + 2 * Dh)                                       # input norm, q_norm, k_norm
    visible = T * context + T * (T + 1) // 2                                       # keys seen, summed over queries
    entry = 2 * Hkv * Dh * p.kv                                                    # one token's key and value
    sdpa = Kernel("attention", "sdpa", rows, flops=batch * 4 * Hq * Dh * visible,
                  kv_bytes=batch * ((context + T) * entry + T * entry), act_bytes=rows * 2 * Hq * Dh * p.activation)
    return [projections, sdpa]


def expert_union(E, k, tokens):
    """Expected distinct experts among `tokens` tokens that each route to k of E, chosen uniformly and
    independently: an expert is missed by one token with probability 1 - k/E. Real routing is correlated across
    neighbouring tokens, so this is the pessimistic end."""
    return E * (1 - (1 - k / E) ** tokens)


def ffn_kernels(cfg, T, p, batch):
    D, rows = cfg.hidden_size, batch * T
    if not cfg.is_moe:
        F = cfg.intermediate_size
        return [matmul("mlp", "swiglu", 3 * D * F, rows, D + F, 2 * F + D, p, vectors=D)]   # + post-attention norm
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    F, Fs = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    router = matmul("moe", "router", (E + 1) * D, rows, D, E + 1, p, vectors=D)   # gate, shared_expert_gate, norm
    shared = matmul("moe", "shared expert", 3 * D * Fs, rows, D + Fs, 2 * Fs + D, p)
    loaded = expert_union(E, k, rows)
    experts = Kernel("moe", "experts", rows * k / loaded, flops=2 * rows * k * 3 * D * F,
                     weight_bytes=loaded * 3 * D * F * p.weight, act_bytes=rows * k * (D + 3 * F + D) * p.activation)
    return [router, shared, experts]


def layer_kernels(cfg, kind, T, context, p, batch):
    mixer = (deltanet_kernels(cfg, T, p, batch) if kind == "linear_attention" else
             attention_kernels(cfg, T, context, p, batch))
    return mixer + ffn_kernels(cfg, T, p, batch)


def head_kernels(cfg, T, p, batch):
    D, V, rows = cfg.hidden_size, cfg.vocab_size, batch * T
    lm_head = Kernel("lm_head", "lm_head", rows, flops=2 * rows * V * D, weight_bytes=(V * D + D) * p.weight,
                     act_bytes=rows * (D * p.activation + V * 4))                  # + final norm; fp32 logits
    return [Kernel("embedding", "embedding", rows, act_bytes=2 * rows * D * p.activation), lm_head]


def forward_kernels(cfg, T, context, p, batch=1, sequential_deltanet=False):
    """One pass over T new tokens per sequence. sequential_deltanet: the premise of the "1.33x" argument, each
    DeltaNet decoder layer run as T one-token steps (its weights and state read T times)."""
    embedding, lm_head = head_kernels(cfg, T, p, batch)
    kernels = [embedding]
    for kind in cfg.layer_types:
        if sequential_deltanet and kind == "linear_attention":
            kernels += [k for t in range(T) for k in layer_kernels(cfg, kind, 1, context + t, p, batch)]
        else:
            kernels += layer_kernels(cfg, kind, T, context, p, batch)
    return kernels + [lm_head]


def mtp_step_kernels(cfg, context, p, batch=1):
    """One drafted token of the MTP head: fc over [embedding; hidden] (2D -> D), a full-attention decoder layer,
    the shared lm_head."""
    D = cfg.hidden_size
    fc = matmul("mtp", "fc", 2 * D * D, batch, 2 * D, D, p, vectors=3 * D)         # + its three norms
    layer = [replace(k, layer="mtp") for k in layer_kernels(cfg, "full_attention", 1, context, p, batch)]
    return [fc] + layer + head_kernels(cfg, 1, p, batch)[1:]


# ----------------------------------------------------------------------------------------------------------------
# Rollback designs

def deltanet_layers(cfg):
    return sum(kind == "linear_attention" for kind in cfg.layer_types)


def rollback_memory(cfg, K, design, p, batch=1):
    """Bytes a design holds besides the live state while K drafts are verified, by part: `snapshot` (the pre-verify
    states and windows: free where arrays are immutable, as in MLX and reference.py), `states` (per-position: the
    state and window after each of the K+1 positions), `tape` (replay)."""
    state, window, tape_step = deltanet_sizes(cfg, p)
    per_layer = {"re-forward": {"snapshot": state + window},
                 "per-position": {"states": (K + 1) * (state + window)},
                 "replay": {"snapshot": state + window, "tape": (K + 1) * tape_step}}[design]
    return {part: batch * deltanet_layers(cfg) * size for part, size in per_layer.items()}


def rollback_at_verify(cfg, K, design, p, batch=1):
    """What a design adds to the verify pass over K+1 tokens, per DeltaNet layer."""
    T = K + 1
    state, window, tape_step = deltanet_sizes(cfg, p)
    Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    extra = {
        "re-forward": Kernel("rollback", "snapshot copy", state_bytes=2 * batch * (state + window)),
        # each S_t: decay and rank-1 update (3 Dk Dv per head), written with its conv window
        "per-position": Kernel("rollback", "keep K+1 states", batch * T, flops=batch * T * Hv * 3 * Dk * Dv,
                               state_bytes=batch * T * (state + window)),
        "replay": Kernel("rollback", "write tape", batch * T, state_bytes=batch * T * tape_step),
    }[design]
    return [extra] * deltanet_layers(cfg)


def rollback_at_commit(cfg, K, n, design, p, batch=1):
    """Keeping the first n of the K+1 verified positions, per DeltaNet layer. Full acceptance (n = K+1) costs
    nothing in any design: the verify pass left the right state; attention truncates its KV cache (free).
    re-forward also runs the n kept tokens through the model again (reforwarded)."""
    if n == K + 1:
        return []
    state, window, tape_step = deltanet_sizes(cfg, p)
    Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kernels = {
        "re-forward": [Kernel("rollback", "restore snapshot", state_bytes=2 * batch * (state + window))],
        "per-position": [],                                                  # an index into the kept states
        "replay": [Kernel("rollback", "replay", batch * n, flops=batch * n * Hv * 3 * Dk * Dv,
                          state_bytes=batch * (2 * state + 2 * window), act_bytes=batch * n * tape_step)],
    }[design]
    return kernels * deltanet_layers(cfg)


def reforwarded(K, n, design):
    """Tokens a commit runs through the whole model again."""
    return n if design == "re-forward" and n <= K else 0


# ----------------------------------------------------------------------------------------------------------------
# Speculative decoding

def kept_distribution(a, K):
    """[(n, P(n))] for n = 1 .. K+1 positions kept, drafts accepted independently with probability a."""
    return [(i + 1, a ** i * (1 - a) if i < K else a ** K) for i in range(K + 1)]


def expected_tokens(a, K):
    """Tokens per verify: (1 - a^(K+1)) / (1 - a), K+1 at a = 1."""
    return K + 1 if a == 1 else (1 - a ** (K + 1)) / (1 - a)


def claim_speedup(N, linear_share=0.75):
    """The "1.33x ceiling" (docs/cost-model.md): verifying N tokens costs N steps in the DeltaNet share of the model
    and 1 in the rest, all N accepted: N / (0.75 N + 0.25), which tends to 4/3."""
    return N / (linear_share * N + 1 - linear_share)


@dataclass(frozen=True)
class Setting:
    """Everything but the model that a prediction depends on."""
    hw: Hardware
    p: Precision = BF16
    context: int = 4096
    batch: int = 1
    drafter: str = "free"      # "free": draft cost 0 (n-gram, prompt lookup); "mtp": K steps of the MTP head
    overhead: Overhead = Overhead()


@lru_cache(maxsize=None)
def pass_seconds(cfg, T, context, p, batch, hw):
    """Roofline seconds of one forward over T tokens (cached: the speedup searches ask for the same passes)."""
    return seconds(forward_kernels(cfg, T, context, p, batch), hw)


def decode_seconds(cfg, s):
    return pass_seconds(cfg, 1, s.context, s.p, s.batch, s.hw) + s.overhead.forward_s(1)


def verify_seconds(cfg, K, design, s):
    fixed = s.overhead.forward_s(K + 1) + s.overhead.verify_s(design)
    return (pass_seconds(cfg, K + 1, s.context, s.p, s.batch, s.hw)
            + seconds(rollback_at_verify(cfg, K, design, s.p, s.batch), s.hw) + fixed)


def commit_seconds(cfg, K, n, design, s):
    if n == K + 1:
        return 0.0
    again = reforwarded(K, n, design)
    fixed = s.overhead.forward_s(n) if again else s.overhead.commit_s(design, n)
    forward = pass_seconds(cfg, again, s.context, s.p, s.batch, s.hw) if again else 0.0
    return seconds(rollback_at_commit(cfg, K, n, design, s.p, s.batch), s.hw) + forward + fixed


def draft_seconds(cfg, K, s):
    return K * seconds(mtp_step_kernels(cfg, s.context, s.p, s.batch), s.hw) if s.drafter == "mtp" else 0.0


@lru_cache(maxsize=None)
def round_seconds(cfg, K, design, s):
    """(draft, verify and bookkeeping seconds, commit seconds for n = 1 .. K+1): a round's costs, whatever the
    acceptance."""
    return (draft_seconds(cfg, K, s) + verify_seconds(cfg, K, design, s) + s.overhead.round,
            tuple(commit_seconds(cfg, K, n, design, s) for n in range(1, K + 2)))


def cycle_seconds(cfg, K, a, design, s):
    """Expected seconds of one round: draft, verify, commit."""
    fixed, commits = round_seconds(cfg, K, design, s)
    return fixed + sum(prob * commits[n - 1] for n, prob in kept_distribution(a, K))


def speedup(cfg, K, a, design, s):
    return expected_tokens(a, K) * decode_seconds(cfg, s) / cycle_seconds(cfg, K, a, design, s)


def best_k(cfg, a, design, s, max_k=32):
    """(K, speedup) with the highest predicted speedup for K in 1 .. max_k."""
    return max(((K, speedup(cfg, K, a, design, s)) for K in range(1, max_k + 1)), key=lambda r: r[1])


# ----------------------------------------------------------------------------------------------------------------
# Draft trees (docs/trees.md). Verifying a tree of N drafted nodes is one pass over N + 1 tokens, as verifying a
# chain of K = N drafts is: the ancestor mask and the path decay move the DeltaNet chunk's and attention's FLOPs
# around without changing their count here (the tree's triangular system is the chain's (N+1) x (N+1) one; a node
# attends to fewer keys, which counts as the chain's upper bound), and per-position rollback keeps N + 1 states.
# What a tree changes is the tokens a round commits for that cost, and its MTP drafting: DEPTH head steps, not N.

def tree_cycle_seconds(cfg, nodes, depth, tokens_per_call, design, s):
    """Seconds of a round that drafts `nodes` nodes at most `depth` deep and commits tokens_per_call tokens on
    average: the draft (depth MTP steps), the verify pass over nodes + 1 tokens, and the commit of that many
    positions (rounded; nothing when everything verified is kept)."""
    kept = min(max(round(tokens_per_call), 1), nodes + 1)
    return (draft_seconds(cfg, depth, s) + verify_seconds(cfg, nodes, design, s) + s.overhead.round
            + commit_seconds(cfg, nodes, kept, design, s))


def tree_speedup(cfg, nodes, depth, tokens_per_call, design, s):
    """Predicted speedup over plain decoding of rounds of `nodes` drafted nodes, `depth` deep, that commit
    tokens_per_call tokens each on average (a chain of K drafts: nodes = depth = K)."""
    return tokens_per_call * decode_seconds(cfg, s) / tree_cycle_seconds(cfg, nodes, depth, tokens_per_call, design, s)


# ----------------------------------------------------------------------------------------------------------------
# Serving: B sequences decoded at once (jax_impl.scheduler). Every pass carries B rows per token position, so the
# weights are read once for B*T rows: tokens/s grows with B while the weight bytes dominate, and stops growing once
# the passes turn compute-bound. Speculation multiplies the rows of a pass by K+1 for (1 - a^(K+1)) / (1 - a) tokens
# a row, so it stops paying at a smaller batch than plain decoding stops scaling.

def matmul_times(cfg, T, s):
    """(FLOP seconds, weight-streaming seconds) of the weight matmuls (projections, MLP or experts, lm_head) of one
    forward over T tokens of each of s.batch sequences."""
    kernels = [k for k in forward_kernels(cfg, T, s.context, s.p, s.batch) if k.weight_bytes]
    return (sum(k.flops for k in kernels) / s.hw.flops,
            sum(k.weight_bytes / s.hw.weight_bandwidth(k.rows) + k.act_bytes / s.hw.bandwidth for k in kernels))


def compute_bound_batch(cfg, T, s, limit=1 << 16):
    """The smallest batch at which the weight matmuls of a pass of T tokens a sequence spend more time on FLOPs
    than on reading their weights (None up to `limit`): where plain decoding (T = 1) stops gaining from a bigger
    batch, and verifying K drafts (T = K+1) stops costing about one decode step. Per-sequence bytes (KV cache,
    DeltaNet state) grow with the batch whatever it is and are left out: at long contexts they bound a step first."""
    def compute_bound(B):
        flops, memory = matmul_times(cfg, T, replace(s, batch=B))
        return flops >= memory
    B = 1
    while not compute_bound(B):
        B *= 2
        if B > limit:
            return None
    low = B // 2 + 1
    while low < B:   # bisect between the last memory-bound power of two and B
        mid = (low + B) // 2
        low, B = (low, mid) if compute_bound(mid) else (mid + 1, B)
    return B


def serving_tokens_per_second(cfg, s, K=0, a=0.0, design="replay"):
    """Tokens/s of s.batch sequences decoded together: plain (K = 0) one token a row per decode pass; speculative,
    expected_tokens(a, K) a row per round (draft, verify, commit of every row)."""
    if K == 0:
        return s.batch / decode_seconds(cfg, s)
    return s.batch * expected_tokens(a, K) / cycle_seconds(cfg, K, a, design, s)


def acceptance_of(tokens_per_call, K):
    """The per-draft acceptance a whose expected tokens per verify, (1 - a^(K+1)) / (1 - a), is tokens_per_call
    (bisection; expected_tokens grows with a from 1 to K+1)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens(mid, K) < tokens_per_call else (low, mid)
    return (low + high) / 2
