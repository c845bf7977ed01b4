"""`python -m conformance serve --engine NAME`: a Python adapter behind the engine protocol (INTERPRETING.md section
8), answering requests from stdin on stdout. Served this way the reference passes the whole suite through the
protocol (tests/test_process_engine.py), which makes this the protocol's reference implementation; it also runs any
Python adapter in a process of its own.
"""

import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

from .engines import EngineError, get_engine
from .format import SUITE_VERSION
from .protocol import PROTOCOL_VERSION, MAX_LINE_BYTES, from_wire, new_files, to_wire, write_files


class Handles:
    """The engine's objects (models, states, pending verifies) by the keys the runner holds."""

    def __init__(self):
        self.objects, self.keys = {}, (f"h{i}" for i in itertools.count(1))

    def new(self, value):
        key = next(self.keys)
        self.objects[key] = value
        return key

    def __getitem__(self, key):
        if key not in self.objects:
            raise KeyError(f"unknown handle {key!r} (freed, or never given)")
        return self.objects[key]

    def free(self, keys):
        for key in keys:
            self.objects.pop(key, None)


def requests(engine, handles, batched_traces):
    """op -> (request -> answer fields). Each takes the request with tensors as arrays."""
    model = lambda r: handles[r["model"]]              # noqa: E731
    state = lambda r, field="state": handles[r[field]]  # noqa: E731

    def prefill(r):
        logits, new = engine.prefill(model(r), r["tokens"])
        return {"logits": logits, "state": handles.new(new)}

    def decode(r):
        logits, new = engine.decode(model(r), state(r), r["tokens"])
        return {"logits": logits, "state": handles.new(new)}

    def verify(r):
        logits, pending = engine.verify(model(r), state(r), r["tokens"], r["rollback"])
        return {"logits": logits, "pending": handles.new(pending)}

    def verify_tree(r):
        logits, pending = engine.verify_tree(model(r), state(r), r["tokens"], r["parents"], r["rollback"])
        return {"logits": logits, "pending": handles.new(pending)}

    def accept_tree(r):
        path, token = engine.accept_tree(r["tokens"], r["parents"], r["q"], r["logits"], r["sampling"], r["uniforms"])
        return {"path": [int(node) for node in path], "token": int(token)}

    def accept_tree_draws(r):
        ends, tokens = engine.accept_tree_draws(r["tokens"], r["parents"], r["q"], r["logits"], r["sampling"], r["n"],
                                                r["seed"])
        return {"ends": ends, "tokens": tokens}

    def sample(r):
        probabilities, tokens = engine.sample(r["logits"], r["sampling"], r["uniforms"])
        return {"probabilities": probabilities, "tokens": tokens}

    def accept(r):
        accepted, token = engine.accept(r["draft"], r["q"], r["logits"], r["sampling"], r["uniforms"])
        return {"accepted": int(accepted), "token": int(token)}

    def draw(r):
        return {"tokens": engine.draw(r["logits"], r["sampling"], r["n"], r["seed"])}

    def accept_draws(r):
        accepted, tokens = engine.accept_draws(r["draft"], r["q"], r["logits"], r["sampling"], r["n"], r["seed"])
        return {"accepted": accepted, "tokens": tokens}

    def mtp_hidden(r):
        hidden, new = engine.mtp_hidden(model(r), None if r["state"] is None else state(r), r["tokens"])
        return {"hidden": hidden, "state": handles.new(new)}

    def mtp_draft(r):
        mtp_state = None if r["mtp_state"] is None else state(r, "mtp_state")
        logits, hidden, new = engine.mtp_draft(model(r), mtp_state, r["tokens"], r["hidden"], r["chain"])
        return {"logits": logits, "hidden": hidden, "mtp_state": handles.new(new)}

    def dflash_features(r):
        features, new = engine.dflash_features(model(r), handles[r["drafter"]],
                                               None if r["state"] is None else state(r), r["tokens"])
        return {"features": features, "state": handles.new(new)}

    def dflash_draft(r):
        dflash_state = None if r["dflash_state"] is None else state(r, "dflash_state")
        logits, new = engine.dflash_draft(model(r), handles[r["drafter"]], dflash_state, r["features"],
                                          r["last_token"], r["k"])
        return {"logits": logits, "dflash_state": handles.new(new)}

    def run_trace(r):
        steps = engine.run_trace(model(r), r["batches"], r["rollback"], r["slots"])
        return {"steps": [{"batch": b, "step": s, "outputs": out} for b, s, out in steps]}

    ops = {
        "load": lambda r: {"model": handles.new(engine.load(r["checkpoint"]))},
        "prefill": prefill,
        "decode": decode,
        "export_state": lambda r: {"tensors": engine.export_state(model(r), state(r))},
        "greedy": lambda r: {"tokens": engine.greedy(model(r), r["prompt"], r["n"])},
        "run_op": lambda r: {"outputs": engine.run_op(r["kind"], r["inputs"], r["attrs"])},
        "sample": sample,
        "verify": verify,
        "commit": lambda r: {"state": handles.new(engine.commit(model(r), state(r, "pending"), r["n"]))},
        "accept": accept,
        "verify_tree": verify_tree,
        "commit_tree": lambda r: {"state": handles.new(engine.commit_tree(model(r), state(r, "pending"), r["path"]))},
        "accept_tree": accept_tree,
        "accept_tree_draws": accept_tree_draws,
        "draw": draw,
        "accept_draws": accept_draws,
        "mtp_hidden": mtp_hidden,
        "mtp_draft": mtp_draft,
        "export_mtp_state": lambda r: {"tensors": engine.export_mtp_state(model(r), state(r, "mtp_state"))},
        "load_dflash": lambda r: {"drafter": handles.new(engine.load_dflash(model(r), r["drafter"]))},
        "dflash_features": dflash_features,
        "dflash_draft": dflash_draft,
        "export_dflash_state": lambda r: {"tensors": engine.export_dflash_state(model(r), handles[r["drafter"]],
                                                                                state(r, "dflash_state"))},
        "copy_state": lambda r: {"state": handles.new(engine.copy_state(model(r), state(r)))},
        "free": lambda r: handles.free(r["handles"]) or {},
    }
    if batched_traces:
        ops["run_trace"] = run_trace
    return ops


def hello(engine, tensors, batched_traces):
    return {"protocol": PROTOCOL_VERSION, "features": sorted(engine.features), "precision": engine.precision,
            "tensors": tensors, "optional_ops": ["greedy"] + (["run_trace"] if batched_traces else [])}


def answer(line, ops, hello_fields, files):
    """One request line -> the answer object."""
    try:
        request = json.loads(line)
        rid, op = request["id"], request["op"]
    except (ValueError, KeyError, TypeError) as e:
        return {"id": None, "ok": False, "error": f"not a request ({type(e).__name__}: {e})"}
    try:
        if op == "hello":
            if request.get("suite_version") != SUITE_VERSION:
                raise ValueError(f"suite version {request.get('suite_version')!r}: this server has {SUITE_VERSION}")
            fields = hello_fields
        elif op in ops:
            fields = to_wire(ops[op](from_wire(request)), files=files)
        else:
            raise ValueError(f"unknown op {op!r}")
    except Exception as e:       # the engine's failure is the answer, and the server goes on
        return {"id": rid, "ok": False, "error": f"{type(e).__name__}: {e}".replace("\n", " ")}
    return {"id": rid, "ok": True, **fields}


def serve(spec, tensors="inline", batched_traces=False, stdin=None, stdout=None):
    """Answer requests until stdin ends. With the default streams, anything else the engine prints on stdout (a C
    library's printf) goes to stderr, so that stdout carries protocol lines only."""
    if spec.startswith("exec:"):
        raise EngineError("serve takes a Python adapter (a name or package.module:Class), not exec:")
    if stdout is None:
        stdout = os.fdopen(os.dup(1), "wb", buffering=0)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
    stdin = stdin or sys.stdin.buffer
    engine = get_engine(spec)
    handles, hello_fields = Handles(), hello(engine, tensors, batched_traces)
    ops = requests(engine, handles, batched_traces)
    with tempfile.TemporaryDirectory(prefix="qwen35-serve-") as folder:
        previous = None
        for n, line in enumerate(iter(lambda: stdin.readline(MAX_LINE_BYTES + 1), b"")):
            if previous is not None:         # the runner has read the previous answer's file by now
                previous.unlink(missing_ok=True)
            files = new_files(Path(folder) / f"{n}.safetensors") if tensors == "files" else None
            reply = answer(line, ops, hello_fields, files)
            if files is not None:
                write_files(files)
                previous = files["path"]
            stdout.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
            stdout.flush()
    engine.close()
    return 0
