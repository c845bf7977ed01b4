"""The on-disk format of a case, written and read in this one place (INTERPRETING.md describes it for other languages).

    cases/<name>/case.json             the manifest: suite version, kind, spec anchor, features, attrs, checkpoint,
                                       per-output tolerances, sha256 of the two data files
    cases/<name>/inputs.safetensors    inputs; layer cases also carry the layer's weights under their checkpoint names
    cases/<name>/expected.safetensors  expected outputs (float32 or int64)

Float tensors are stored as float32 (the generator computes in float64 and they are rounded here, once), token ids
and lengths as int64.
"""

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import safetensors.numpy

SUITE_VERSION = 6          # bump on any change to the format or to what a case means (INTERPRETING.md)
REGENERATE = "python -m conformance generate"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent         # checkpoint paths in manifests are relative to this: the repository root in a clone,
                           # the qwen35 package of the installed kit (which holds weights/ too)
CASES_DIR = HERE / "cases"
MANIFEST, INPUTS, EXPECTED = "case.json", "inputs.safetensors", "expected.safetensors"
TOLERANCES = json.loads((HERE / "tolerances.json").read_text())
# An engine's arithmetic (Engine.precision). fp32 is the top-level bounds of tolerances.json; each other precision
# names the profile that replaces them, in each output kind that has one.
PRECISIONS = ("fp32", "bf16")
# Trained checkpoints (weights/README.md). On the random ones bf16 rounding moves whole-model outputs by units, so
# their logits and states have the `bf16_random` profile (tolerances.json says why).
TRAINED_CHECKPOINTS = ("default",)

# Every feature a case may require. An engine declares the ones it supports; a case needing any other is SKIP.
FEATURES = {
    # primitives and the gated delta rule (Engine.run_op)
    "rms_norm": "zero-centred RMSNorm, scale (1 + w)",
    "rms_norm_gated": "DeltaNet output norm: plain weight, then SiLU(z) gate",
    "l2norm": "x / sqrt(sum x^2 + eps)",
    "rope": "NeoX-style partial rotary embedding",
    "causal_conv1d": "depthwise causal conv with a carried window of W-1 inputs",
    "gated_delta_rule": "the gated delta rule over T tokens from an initial state",
    # one layer on given inputs and weights (Engine.run_op)
    "deltanet_layer": "Gated DeltaNet token mixer with conv window and recurrent state",
    "attention_layer": "gated full attention with a KV cache",
    "mlp_layer": "dense SwiGLU feed-forward",
    "moe_layer": "routed experts plus gated shared expert",
    # whole model (Engine.load / prefill / decode / greedy / export_state)
    "prefill": "logits of every position of a prompt from an empty state",
    "decode": "continue a state with one token",
    "extend": "continue a non-empty state with several tokens in one call",
    "greedy": "greedy continuation of a prompt",
    "state_export": "expose the state: DeltaNet S and conv window, attention K/V (outputs named state.*)",
    # sampling with supplied uniforms (Engine.sample)
    "sampling": "temperature / top-k / top-p probabilities and inverse-CDF draws from given uniforms",
    # speculative decoding (Engine.verify / commit / accept)
    "speculative": "verify K drafts in one pass, then commit the first n positions",
    "rollback:per-position": "commit by keeping every verified position's state",
    "rollback:replay": "commit by replaying the kept steps from the pre-verify state",
    "accept:greedy": "accept the longest draft prefix equal to the target argmax",
    "accept:sampling": "speculative sampling (Leviathan et al.) with given uniforms",
    # the MTP head as a drafter (Engine.mtp_hidden, mtp_draft; INTERPRETING.md section 4)
    "mtp": "the target's final-normed hidden states for the MTP head; the head over (hidden, next token) pairs with "
           "its own KV cache, chained on its own output hidden state",
    # a DFlash block drafter (Engine.load_dflash, dflash_features, dflash_draft; INTERPRETING.md section 4)
    "dflash": "the target layer outputs a DFlash drafter taps; the drafter's block [last committed token, MASK x K] "
              "over its context cache of projected, normed features, cropped back after each round",
    # the statistical pack: draws with the engine's own random numbers (Engine.draw, accept_draws; `sample` mode)
    "draws": "draw tokens from given logits many times with the engine's own random numbers",
    "accept:draws": "speculative sampling of given drafts many times with the engine's own random numbers",
    # draft trees (Engine.verify_tree / commit_tree / accept_tree; INTERPRETING.md section 4, "Draft trees")
    "tree": "verify a draft tree (tokens + parent indices) in one pass: DeltaNet from each node's parent state, conv "
            "windows along ancestor paths, attention over the prefix and ancestors at position prefix + depth; commit "
            "an accepted root-to-node path (both rollback strategies); greedy tree acceptance",
    "accept:tree-sampling": "multi-draft speculative sampling over a tree's siblings (recursive rejection) with given "
                            "uniforms",
    "accept:tree-draws": "multi-draft speculative sampling of a given tree many times with the engine's own random "
                         "numbers (the statistical pack)",
    "trace:tree": "tree rows in a serving trace: verify_tree steps (a draft tree, its acceptance, the accepted path "
                  "committed) in the batches beside prefill and verify rows",
    # serving traces (Engine.run_trace: batches of steps on named requests; INTERPRETING.md section 4)
    "trace": "run a serving trace: prefill and verify rows of several requests per batch, releases (tree rows: "
             "trace:tree)",
    "snapshot": "copy a request's committed state as a prefix-cache entry and start new requests from it",
    # checkpoint properties beyond the default model
    "moe": "qwen3_5_moe: every FFN is a routed MoE",
    "untied_embeddings": "lm_head.weight separate from embed_tokens",
    "gva_ratio_1": "as many DeltaNet value heads as key heads (Qwen3.5-0.8B's geometry: the shaped goldens)",
    "gva_ratio_3": "3 DeltaNet value heads per key head",
    "unequal_head_dims": "DeltaNet key and value head dims differ",
    "conv_kernel_3": "linear_conv_kernel_dim = 3",
    "partial_rotary_0.5": "RoPE on half of each head",
    "multimodal_layout": "Qwen3_5ForConditionalGeneration files: text_config, model.language_model. prefix",
    "per_expert_weights": "unfused experts.{e}.{gate,up,down}_proj tensors",
    "mtp_weights": "checkpoint also holds mtp.* tensors, which a plain forward ignores",
}

# Named groups of features: an engine may declare a group, and an expectations file may give one reason for a whole
# group (a feature's own entry takes precedence over its group's).
FEATURE_GROUPS = {
    "ops": ("rms_norm", "rms_norm_gated", "l2norm", "rope", "causal_conv1d"),
    "layers": ("deltanet_layer", "attention_layer", "mlp_layer", "moe_layer"),
    "rollback": ("rollback:per-position", "rollback:replay"),
    "acceptance": ("accept:greedy", "accept:sampling"),
    "speculative_decoding": ("speculative", "rollback:per-position", "rollback:replay", "accept:greedy",
                             "accept:sampling"),
    "serving": ("trace", "snapshot"),
    "trees": ("tree", "accept:tree-sampling", "accept:tree-draws", "trace:tree"),
    "statistical_pack": ("draws", "accept:draws"),
    "checkpoint_layouts": ("moe", "untied_embeddings", "gva_ratio_1", "gva_ratio_3", "unequal_head_dims", "conv_kernel_3",
                           "partial_rotary_0.5", "multimodal_layout", "per_expert_weights", "mtp_weights"),
}


def features_named(names):
    """Feature and group names -> {feature: the name that brought it in}, a feature named itself winning over its
    group. Raises ValueError naming what is neither."""
    unknown = sorted(str(n) for n in names if n not in FEATURES and n not in FEATURE_GROUPS)
    if unknown:
        raise ValueError(f"unknown features {unknown} (known: the features of conformance/format.py's FEATURES, "
                         f"and the groups {', '.join(FEATURE_GROUPS)})")
    named = {feature: group for group in names if group in FEATURE_GROUPS for feature in FEATURE_GROUPS[group]}
    return {**named, **{name: name for name in names if name in FEATURES}}


class GoldenError(Exception):
    """A case on disk is unusable: the message names the file, how to restore the shipped goldens, and the command
    that rebuilds them (for whoever changed the reference, the generator or a checkpoint)."""

    def __init__(self, path, problem):
        super().__init__(f"{path}: {problem}; restore the shipped goldens (`git checkout conformance/cases weights`, "
                         f"or reinstall the kit), or after changing reference.py, the generator or weights/ rebuild them "
                         f"with `{REGENERATE}`")


class Output(NamedTuple):
    tolerance: str               # a key of tolerances.json
    value: np.ndarray
    requires: str | None = None  # a feature without which this output is not compared (e.g. state_export)
    ties: dict | None = None     # greedy tokens: {step: [token, other token]} where the top-2 logits are within tolerance
    test: dict | None = None     # draws: the chi-square test (chisquare.py, sized by make/draws.py); its "bins" array is stored as <name>.bins


class Case(NamedTuple):
    name: str
    kind: str                    # how the runner drives the engine (INTERPRETING.md, "Kinds")
    spec: str                    # the reference.py function(s) it specifies
    description: str
    features: tuple
    attrs: dict
    inputs: dict                 # name -> array
    outputs: dict                # name -> Output
    checkpoint: str | None = None  # directory name under weights/


def state_tensors(state):
    """A State (reference.State's fields: layers, length) as the suite names it: state.layers.{i}.{S,conv}
    (DeltaNet), .{k,v} (attention) in the reference's layouts, state.length."""
    tensors = {"state.length": np.array([state.length], dtype=np.int64)}
    for i, layer in enumerate(state.layers):
        for field, value in layer._asdict().items():
            tensors[f"state.layers.{i}.{field}"] = value.astype(np.float32)
    return tensors


def trace_batches(attrs, inputs):
    """A trace case's steps as reference.run_trace takes them: the manifest's batches, each sampled commit rule (of a
    verify or verify_tree step) given its q and uniforms (inputs b<batch>.s<step>.q and .uniforms)."""
    batches = []
    for b, batch in enumerate(attrs["batches"]):
        batches.append([])
        for s, step in enumerate(batch):
            arrays = {name: inputs[f"b{b}.s{s}.{name}"] for name in ("q", "uniforms") if f"b{b}.s{s}.{name}" in inputs}
            batches[-1].append({**step, "commit": {**step["commit"], **arrays}} if arrays else step)
    return batches


def sha256_file(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def checkpoint_dir(name):
    return ROOT / "weights" / name


def directory_sha256(folder):
    """One digest for a model directory: sha256 of the lines "<file name> <sha256 of file>\\n", sorted by name."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    return hashlib.sha256("".join(f"{p.name} {sha256_file(p)}\n" for p in files).encode()).hexdigest()


def checkpoint_sha256(name):
    return directory_sha256(checkpoint_dir(name))


def checkpoint_entry(name):
    """How a manifest names a checkpoint directory under weights/ (the case's, and a dflash case's drafter)."""
    return {"name": name, "path": f"weights/{name}", "sha256": checkpoint_sha256(name)}


def bounds(tolerance):
    """A tolerances.json entry as a manifest carries it: without the `why`s, its precision profiles included."""
    return {k: bounds(v) if isinstance(v, dict) else v for k, v in tolerance.items() if k != "why"}


def output_bounds(kind, checkpoint):
    """tolerances.json's entry for an output kind; on a random checkpoint its `bf16_random` profile is the bf16 one."""
    entry = bounds(TOLERANCES[kind])
    random = entry.pop("bf16_random", None)
    if random is not None and checkpoint not in TRAINED_CHECKPOINTS:
        entry["bf16"] = random
    return entry


def manifest(case, file_digests):
    outputs = {}
    for name, out in sorted(case.outputs.items()):
        entry = {"tolerance": out.tolerance, **output_bounds(out.tolerance, case.checkpoint)}
        if out.requires:
            entry["requires"] = out.requires
        if out.ties:
            entry["ties"] = {str(step): tokens for step, tokens in sorted(out.ties.items())}
        if out.test:
            entry["test"] = {**out.test, "bins": f"{name}.bins"}
        outputs[name] = entry
    checkpoint = None if case.checkpoint is None else checkpoint_entry(case.checkpoint)
    return {"suite_version": SUITE_VERSION, "name": case.name, "kind": case.kind, "spec": case.spec,
            "description": case.description, "features": list(case.features), "attrs": case.attrs,
            "checkpoint": checkpoint, "outputs": outputs, "files": file_digests}


def stored(array):
    """A tensor as the files hold it: floats rounded once to float32, integers as int64."""
    array = np.asarray(array)
    return np.ascontiguousarray(array, np.float32 if array.dtype.kind == "f" else np.int64)


def write_case(cases_dir, case):
    unknown = [f for f in case.features if f not in FEATURES]
    if unknown:
        raise ValueError(f"case {case.name}: features {unknown} are not in format.FEATURES")
    folder = Path(cases_dir) / case.name
    folder.mkdir(parents=True)
    digests = {}
    expected = {n: o.value for n, o in case.outputs.items()}
    expected.update({f"{n}.bins": o.test["bins"] for n, o in case.outputs.items() if o.test})
    for file, tensors in ((INPUTS, case.inputs), (EXPECTED, expected)):
        data = safetensors.numpy.save({n: stored(a) for n, a in tensors.items()})
        (folder / file).write_bytes(data)
        digests[file] = hashlib.sha256(data).hexdigest()
    (folder / MANIFEST).write_text(json.dumps(manifest(case, digests), indent=1, sort_keys=True) + "\n")


def case_dirs(cases_dir=CASES_DIR):
    cases_dir = Path(cases_dir)
    if not cases_dir.is_dir():
        raise GoldenError(cases_dir, "no cases folder")
    return sorted(p for p in cases_dir.iterdir() if p.is_dir())


def read_manifest(folder):
    """case.json, checked: suite version, data files present and matching their sha256, checkpoint unchanged."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise GoldenError(path, "missing")
    try:
        meta = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GoldenError(path, f"not JSON ({e})") from None
    if meta.get("suite_version") != SUITE_VERSION:
        raise GoldenError(path, f"suite_version {meta.get('suite_version')!r}, this runner reads {SUITE_VERSION}")
    for file, digest in meta["files"].items():
        data_path = Path(folder) / file
        if not data_path.is_file():
            raise GoldenError(data_path, "missing")
        if sha256_file(data_path) != digest:
            raise GoldenError(data_path, "sha256 differs from case.json (corrupted or hand-edited)")
    for checkpoint in (meta.get("checkpoint"), (meta.get("attrs") or {}).get("drafter")):
        if checkpoint and not checkpoint_dir(checkpoint["name"]).is_dir():
            raise GoldenError(ROOT / checkpoint["path"], f"checkpoint named by {path} is missing")
        if checkpoint and checkpoint_sha256(checkpoint["name"]) != checkpoint["sha256"]:
            raise GoldenError(ROOT / checkpoint["path"], f"checkpoint changed since {path} was generated")
    return meta


def read_tensors(folder, file):
    return safetensors.numpy.load_file(str(Path(folder) / file))
