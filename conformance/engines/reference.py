"""The reference adapter: reference.py behind the Engine interface (the suite must pass against its own generator)."""

import numpy as np

from .. import reference as R
from . import Engine, layer_config, layer_params, moe_config, register_engine
from ..format import FEATURES, state_tensors


def deltanet_layer(inputs, attrs):
    cfg = layer_config(attrs, inputs["x"].shape[-1])
    state = R.DeltaState(inputs["state.conv"], inputs["state.S"])
    y, state, _ = R.gated_deltanet(inputs["x"], state, cfg, **layer_params(inputs, attrs["prefix"])["linear_attn"])
    return {"y": y, "state.conv": state.conv, "state.S": state.S}


def attention_layer(inputs, attrs):
    cfg = layer_config(attrs, inputs["x"].shape[-1], layer_types=("full_attention",))
    state = R.AttnState(inputs["state.k"], inputs["state.v"])
    y, state = R.gated_attention(inputs["x"], state, inputs["positions"], cfg,
                                 **layer_params(inputs, attrs["prefix"])["self_attn"])
    return {"y": y, "state.k": state.k, "state.v": state.v}


def mlp_layer(inputs, attrs):
    return {"y": R.mlp(inputs["x"], **layer_params(inputs, attrs["prefix"])["mlp"])}


def moe_layer(inputs, attrs):
    cfg = moe_config(attrs, inputs["x"].shape[-1])
    return {"y": R.sparse_moe(inputs["x"], cfg, **layer_params(inputs, attrs["prefix"])["mlp"])}


def gated_delta_rule(inputs, attrs):
    rule = R.gated_delta_chunked if attrs["form"] == "chunked" else R.gated_delta_recurrent
    o, S, _ = rule(*(inputs[n] for n in ("q", "k", "v", "g", "beta", "initial_state")))
    return {"o": o, "final_state": S}


OPS = {
    "rms_norm": lambda i, a: {"y": R.rms_norm(i["x"], i["weight"], a["eps"])},
    "rms_norm_gated": lambda i, a: {"y": R.rms_norm_gated(i["x"], i["z"], i["weight"], a["eps"])},
    "l2norm": lambda i, a: {"y": R.l2norm(i["x"], a["eps"])},
    "rope": lambda i, a: {"y": R.rope(i["x"], i["positions"], a["rope_theta"],
                                      int(i["x"].shape[-1] * a["partial_rotary_factor"]))},
    "causal_conv1d": lambda i, a: dict(zip(("y", "window"), R.causal_conv1d(i["x"], i["window"], i["weight"]))),
    "gated_delta_rule": gated_delta_rule,
    "deltanet_layer": deltanet_layer,
    "attention_layer": attention_layer,
    "mlp_layer": mlp_layer,
    "moe_layer": moe_layer,
}


@register_engine("reference")
class Reference(Engine):
    features = frozenset(FEATURES)

    def load(self, checkpoint_dir):
        return R.load_model(checkpoint_dir)

    def prefill(self, model, tokens):
        return self.decode(model, R.empty_state(model[0]), tokens)

    def decode(self, model, state, tokens):
        cfg, params = model
        logits, _, state, _ = R.forward(params, cfg, tokens, state)
        return logits, state

    def export_state(self, model, state):
        return state_tensors(state)

    def run_op(self, kind, inputs, attrs):
        return OPS[kind](inputs, attrs)

    def sample(self, logits, sampling, uniforms):
        p = R.probabilities(logits, R.sampling_of(sampling))
        return p, np.array([R.sample(row, u) for row, u in zip(p, uniforms)], dtype=np.int64)

    def draw(self, logits, sampling, n, seed):
        """reference.sample with uniforms from a np.random.Generator, as generate() draws."""
        rng, p = np.random.default_rng(seed), R.probabilities(logits, R.sampling_of(sampling))
        return np.array([[R.sample(row, u) for u in rng.random(n)] for row in p], dtype=np.int64)

    def accept_draws(self, draft, q, logits, sampling, n, seed):
        rng, sampling = np.random.default_rng(seed), R.sampling_of(sampling)
        rounds = [R.accept(list(draft), q, logits, sampling, rng.random(len(draft) + 1)) for _ in range(n)]
        return tuple(np.array(column, dtype=np.int64) for column in zip(*rounds))

    def verify(self, model, state, tokens, rollback):
        cfg, params = model
        logits, _, verified = R.verify(params, cfg, state, tokens, rollback)
        return logits, verified

    def commit(self, model, verified, n):
        return R.commit(verified, n)

    def accept(self, draft, q, logits, sampling, uniforms):
        return R.accept(list(draft), q, logits, R.sampling_of(sampling), uniforms)

    def verify_tree(self, model, state, tokens, parents, rollback):
        cfg, params = model
        logits, _, verified = R.verify_tree(params, cfg, state, tokens, parents, rollback)
        return logits, verified

    def commit_tree(self, model, verified, path):
        return R.commit_tree(verified, [int(node) for node in path])

    def accept_tree(self, tokens, parents, q, logits, sampling, uniforms):
        return R.accept_tree([int(t) for t in tokens], R.check_tree(parents), q, logits, R.sampling_of(sampling),
                             uniforms)

    def accept_tree_draws(self, tokens, parents, q, logits, sampling, n, seed):
        rng, sampling = np.random.default_rng(seed), R.sampling_of(sampling)
        tokens, parents = [int(t) for t in tokens], R.check_tree(parents)
        rounds = [R.accept_tree(tokens, parents, q, logits, sampling, rng.random(len(tokens))) for _ in range(n)]
        return np.array([path[-1] for path, _ in rounds], np.int64), np.array([t for _, t in rounds], np.int64)

    def copy_state(self, model, state):
        return state                    # a reference State is a value: no call ever changes one

    def mtp_hidden(self, model, state, tokens):
        cfg, params = model
        _, hidden, state, _ = R.forward(params, cfg, tokens, R.empty_state(cfg) if state is None else state)
        return hidden, state

    def mtp_draft(self, model, mtp_state, tokens, hidden, chain):
        cfg, params = model
        mtp_state = R.mtp_drafter(params, cfg).initial_state if mtp_state is None else mtp_state
        picks = iter(chain)
        return R.mtp_chain(params, cfg, mtp_state, tokens, hidden, len(chain) + 1, lambda logits: int(next(picks)))

    def load_dflash(self, model, drafter_dir):
        return R.load_dflash(drafter_dir, model[0])

    def dflash_features(self, model, drafter, state, tokens):
        cfg, params = model
        _, features, state, _ = R.forward(params, cfg, tokens, R.empty_state(cfg) if state is None else state,
                                          R.dflash_taps(drafter[0]))
        return features, state

    def dflash_draft(self, model, drafter, dflash_state, features, last_token, k):
        (cfg, params), (dcfg, dparams) = model, drafter
        dflash_state = R.dflash_empty_state(dcfg) if dflash_state is None else dflash_state
        return R.dflash_round(params, dparams, dcfg, dflash_state, features, last_token, k)

    def export_dflash_state(self, model, drafter, dflash_state):
        return state_tensors(dflash_state)
