"""An engine in another process, in any language: `--engine exec:"COMMAND ARGS"`.

The runner starts COMMAND once and speaks the engine protocol with it (INTERPRETING.md section 8): one request per
Engine method, one JSON line each way on the process's stdin and stdout; its stderr is passed through. Models, states
and pending verifies stay in the engine, which names them with handles; when the runner no longer holds a handle the
engine is told to free it. An engine that crashes, hangs past the timeout or breaks the protocol fails the case it
was running, and the next request starts a fresh process.
"""

import concurrent.futures
import json
import shlex
import subprocess
import tempfile
import weakref
from pathlib import Path

import numpy as np

from . import Engine, EngineError, validated_engine
from ..format import SUITE_VERSION
from ..protocol import (MAX_LINE_BYTES, PROTOCOL_VERSION, ProtocolError, from_wire, new_files, to_wire,
                        write_files)

DEFAULT_TIMEOUT = 600.0          # seconds for one answer; the suite's slowest request takes a few seconds
OPTIONAL_OPS = ("greedy", "run_trace")


class EngineFailed(RuntimeError):
    """The engine answered a request with {"ok": false, "error": ...}."""


class Handle:
    """A state or pending verify living in the engine process, named by `key` (a JSON string or integer)."""
    __slots__ = ("key", "generation", "__weakref__")

    def __init__(self, key, generation):
        self.key, self.generation = key, generation

    def __repr__(self):
        return f"Handle({self.key!r})"


class ModelRef:
    """A loaded checkpoint: loaded again, by path, in a process that replaced a crashed one."""
    __slots__ = ("path",)

    def __init__(self, path):
        self.path = path


class ProcessEngine(Engine):
    def __init__(self, command, timeout=DEFAULT_TIMEOUT):
        try:
            self.argv = shlex.split(command)
        except ValueError as e:
            raise EngineError(f"exec:{command}: {e}") from None
        if not self.argv:
            raise EngineError("exec: needs a command, e.g. exec:\"./my_engine --threads 1\"")
        self.timeout, self.process, self.generation = timeout, None, 0
        self.io = concurrent.futures.ThreadPoolExecutor(max_workers=1)   # a request's write and read, timed out
        self.files_dir = tempfile.TemporaryDirectory(prefix="qwen35-exec-")
        try:
            hello = self.start()
        except (ProtocolError, EngineFailed) as e:
            self.refuse(f"exec:{command}: {e}")
        self.features = hello.get("features")
        self.precision = hello.get("precision", "fp32")
        self.optional_ops = set(hello.get("optional_ops", ()))
        unknown = self.optional_ops - set(OPTIONAL_OPS)
        if hello.get("tensors", "inline") not in ("inline", "files") or unknown:
            self.refuse(f"exec:{command}: hello answered tensors={hello.get('tensors')!r} (inline or files) and "
                        f"optional_ops {sorted(unknown)} (known: {', '.join(OPTIONAL_OPS)})")
        try:
            validated_engine(self, f"exec:{command}")    # its features and precision, here so that a refusal stops it
        except EngineError as e:
            self.refuse(str(e))

    # The process.

    def start(self):
        try:
            self.process = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        except OSError as e:
            raise ProtocolError(f"cannot start {self.argv[0]!r}: {e.strerror}") from None
        self.generation += 1
        self.handles, self.dropped, self.models, self.next_id = {}, [], {}, 0
        self.tensor_files = False
        hello = self.request("hello", protocol=PROTOCOL_VERSION, suite_version=SUITE_VERSION)
        if hello.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolError(f"hello answered protocol {hello.get('protocol')!r}, this runner speaks "
                                f"{PROTOCOL_VERSION}")
        self.tensor_files = hello.get("tensors") == "files"
        return hello

    def stop(self):
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def refuse(self, message):
        """A handshake that failed: the process is killed (it may not read its input any more) -> EngineError."""
        self.stop()
        self.close()
        raise EngineError(message) from None

    def close(self):
        if self.process is not None:    # end of input: the engine exits
            try:
                self.process.stdin.close()
                self.process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.stop()
            self.process = None
        self.io.shutdown()
        self.files_dir.cleanup()

    # One request.

    def request(self, op, **fields):
        """Send {id, op, **fields}, return the answer's fields with tensors as arrays; EngineFailed when the engine
        says it failed, ProtocolError (and the process stopped) when the exchange itself went wrong."""
        if self.process is None:
            self.start()
        if op not in ("hello", "free") and self.dropped:
            dropped, self.dropped = self.dropped, []
            self.request("free", handles=dropped)
        files = new_files(Path(self.files_dir.name) / f"{op}.safetensors") if self.tensor_files else None
        fields = to_wire(fields, self.key_of, files)     # first: a model handle may need a `load` (after a restart)
        self.next_id += 1
        if files is not None:
            write_files(files)
        try:
            line = json.dumps({"id": self.next_id, "op": op, **fields}, separators=(",", ":")).encode() + b"\n"
            answer = self.exchange(op, line)
        finally:
            if files is not None:
                files["path"].unlink(missing_ok=True)
        if answer.get("ok") is not True:
            raise EngineFailed(f"{op}: {answer.get('error', 'failed, without an error message')}")
        return from_wire(answer)

    def exchange(self, op, line):
        process = self.process
        future = self.io.submit(write_then_read, process, line)
        try:
            reply = future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            self.stop()
            raise ProtocolError(f"no answer to {op} within {self.timeout:g} s: stopped the engine process") from None
        if not reply:
            status = process.wait()
            self.process = None
            raise ProtocolError(f"the engine process exited (status {status}) during {op}")
        problem = None
        if not reply.endswith(b"\n"):
            problem = f"the answer to {op} is longer than {MAX_LINE_BYTES} bytes"
        else:
            try:
                answer = json.loads(reply)
            except (UnicodeDecodeError, json.JSONDecodeError):
                problem = f"the answer to {op} is not a JSON line (stdout is for protocol lines only): {reply[:200]!r}"
            else:
                if not isinstance(answer, dict) or answer.get("id") != self.next_id:
                    problem = f"the answer to {op} (id {self.next_id}) is not an object with that id: {reply[:200]!r}"
        if problem:
            self.stop()          # the stream is out of step: start afresh
            raise ProtocolError(problem)
        return answer

    # Handles.

    def key_of(self, value):
        if isinstance(value, ModelRef):
            return self.model_key(value.path)
        if isinstance(value, Handle):
            if value.generation != self.generation:
                raise ProtocolError(f"handle {value.key!r} belongs to an engine process that has exited")
            return value.key
        raise TypeError(f"cannot send a {type(value).__name__} to an engine process")

    def handle(self, answer, field, op):
        key = handle_key(answer, field, op)
        existing = self.handles.get(key)
        handle = existing() if existing else None
        if handle is None:                    # an engine that updates a state in place may answer the same key
            handle = Handle(key, self.generation)
            self.handles[key] = weakref.ref(handle)
            weakref.finalize(handle, self.drop, self.generation, key)
        return handle

    def drop(self, generation, key):
        if generation == self.generation and self.process is not None:
            self.handles.pop(key, None)
            self.dropped.append(key)

    def model_key(self, path):
        if path not in self.models:
            self.models[path] = handle_key(self.request("load", checkpoint=path), "model", "load")
        return self.models[path]

    # The Engine methods, one request each.

    def load(self, checkpoint_dir):
        path = str(Path(checkpoint_dir).resolve())
        self.model_key(path)
        return ModelRef(path)

    def prefill(self, model, tokens):
        answer = self.request("prefill", model=model, tokens=np.asarray(tokens, np.int64))
        return required(answer, "logits", "prefill"), self.handle(answer, "state", "prefill")

    def decode(self, model, state, tokens):
        answer = self.request("decode", model=model, state=state, tokens=np.asarray(tokens, np.int64))
        return required(answer, "logits", "decode"), self.handle(answer, "state", "decode")

    def export_state(self, model, state):
        return required(self.request("export_state", model=model, state=state), "tensors", "export_state")

    def greedy(self, model, prompt, n):
        if "greedy" not in self.optional_ops:
            return super().greedy(model, prompt, n)
        answer = self.request("greedy", model=model, prompt=np.asarray(prompt, np.int64), n=n)
        return np.asarray(required(answer, "tokens", "greedy"), np.int64)

    def run_op(self, kind, inputs, attrs):
        return required(self.request("run_op", kind=kind, inputs=inputs, attrs=attrs), "outputs", "run_op")

    def sample(self, logits, sampling, uniforms):
        answer = self.request("sample", logits=logits, sampling=sampling, uniforms=uniforms)
        return required(answer, "probabilities", "sample"), np.asarray(required(answer, "tokens", "sample"), np.int64)

    def verify(self, model, state, tokens, rollback):
        answer = self.request("verify", model=model, state=state, tokens=np.asarray(tokens, np.int64),
                              rollback=rollback)
        return required(answer, "logits", "verify"), self.handle(answer, "pending", "verify")

    def commit(self, model, pending, n):
        return self.handle(self.request("commit", model=model, pending=pending, n=int(n)), "state", "commit")

    def accept(self, draft, q, logits, sampling, uniforms):
        answer = self.request("accept", draft=[int(t) for t in draft], q=q, logits=logits, sampling=sampling,
                              uniforms=uniforms)
        return int(required(answer, "accepted", "accept")), int(required(answer, "token", "accept"))

    def verify_tree(self, model, state, tokens, parents, rollback):
        answer = self.request("verify_tree", model=model, state=state, tokens=[int(t) for t in tokens],
                              parents=[int(p) for p in parents], rollback=rollback)
        return required(answer, "logits", "verify_tree"), self.handle(answer, "pending", "verify_tree")

    def commit_tree(self, model, pending, path):
        return self.handle(self.request("commit_tree", model=model, pending=pending, path=[int(n) for n in path]),
                           "state", "commit_tree")

    def accept_tree(self, tokens, parents, q, logits, sampling, uniforms):
        answer = self.request("accept_tree", tokens=[int(t) for t in tokens], parents=[int(p) for p in parents], q=q,
                              logits=logits, sampling=sampling, uniforms=uniforms)
        return ([int(n) for n in required(answer, "path", "accept_tree")],
                int(required(answer, "token", "accept_tree")))

    def accept_tree_draws(self, tokens, parents, q, logits, sampling, n, seed):
        answer = self.request("accept_tree_draws", tokens=[int(t) for t in tokens], parents=[int(p) for p in parents],
                              q=q, logits=logits, sampling=sampling, n=int(n), seed=int(seed))
        return (np.asarray(required(answer, "ends", "accept_tree_draws"), np.int64),
                np.asarray(required(answer, "tokens", "accept_tree_draws"), np.int64))

    def draw(self, logits, sampling, n, seed):
        answer = self.request("draw", logits=logits, sampling=sampling, n=int(n), seed=int(seed))
        return np.asarray(required(answer, "tokens", "draw"), np.int64)

    def accept_draws(self, draft, q, logits, sampling, n, seed):
        answer = self.request("accept_draws", draft=[int(t) for t in draft], q=q, logits=logits, sampling=sampling,
                              n=int(n), seed=int(seed))
        return (np.asarray(required(answer, "accepted", "accept_draws"), np.int64),
                np.asarray(required(answer, "tokens", "accept_draws"), np.int64))

    def mtp_hidden(self, model, state, tokens):
        answer = self.request("mtp_hidden", model=model, state=state, tokens=np.asarray(tokens, np.int64))
        return required(answer, "hidden", "mtp_hidden"), self.handle(answer, "state", "mtp_hidden")

    def mtp_draft(self, model, mtp_state, tokens, hidden, chain):
        answer = self.request("mtp_draft", model=model, mtp_state=mtp_state, tokens=np.asarray(tokens, np.int64),
                              hidden=hidden, chain=[int(t) for t in chain])
        return (required(answer, "logits", "mtp_draft"), required(answer, "hidden", "mtp_draft"),
                self.handle(answer, "mtp_state", "mtp_draft"))

    def export_mtp_state(self, model, mtp_state):
        answer = self.request("export_mtp_state", model=model, mtp_state=mtp_state)
        return required(answer, "tensors", "export_mtp_state")

    def load_dflash(self, model, drafter_dir):
        answer = self.request("load_dflash", model=model, drafter=str(Path(drafter_dir).resolve()))
        return self.handle(answer, "drafter", "load_dflash")

    def dflash_features(self, model, drafter, state, tokens):
        answer = self.request("dflash_features", model=model, drafter=drafter, state=state,
                              tokens=np.asarray(tokens, np.int64))
        return required(answer, "features", "dflash_features"), self.handle(answer, "state", "dflash_features")

    def dflash_draft(self, model, drafter, dflash_state, features, last_token, k):
        answer = self.request("dflash_draft", model=model, drafter=drafter, dflash_state=dflash_state,
                              features=np.asarray(features, np.float32), last_token=int(last_token), k=int(k))
        return required(answer, "logits", "dflash_draft"), self.handle(answer, "dflash_state", "dflash_draft")

    def export_dflash_state(self, model, drafter, dflash_state):
        answer = self.request("export_dflash_state", model=model, drafter=drafter, dflash_state=dflash_state)
        return required(answer, "tensors", "export_dflash_state")

    def copy_state(self, model, state):
        return self.handle(self.request("copy_state", model=model, state=state), "state", "copy_state")

    def run_trace(self, model, batches, rollback, slots):
        if "run_trace" not in self.optional_ops:
            yield from super().run_trace(model, batches, rollback, slots)
            return
        answer = self.request("run_trace", model=model, batches=batches, rollback=rollback, slots=slots)
        for step in required(answer, "steps", "run_trace"):
            yield required(step, "batch", "run_trace"), required(step, "step", "run_trace"), required(
                step, "outputs", "run_trace")


def write_then_read(process, line):
    """One exchange on the pipes (in the I/O thread, so that the caller can time it out); b"" when the process has
    gone."""
    try:
        process.stdin.write(line)
        process.stdin.flush()
    except OSError:          # a broken pipe: the process exited
        return b""
    return process.stdout.readline(MAX_LINE_BYTES + 1)


def required(answer, field, op):
    if not isinstance(answer, dict) or field not in answer:
        raise ProtocolError(f"the answer to {op} lacks {field!r}")
    return answer[field]


def handle_key(answer, field, op):
    key = required(answer, field, op)
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise ProtocolError(f"the answer to {op}: {field} must be a handle (a string or an integer), not {key!r:.100}")
    return key
