"""The engine protocol's messages (INTERPRETING.md section 8), for both ends: the runner's (engines/process.py) and
`python -m conformance serve`'s (adapter_server.py). One JSON object per line; a tensor is an object, either inline

    {"dtype": "F32", "shape": [2, 3], "data": "<base64 of the little-endian values, row-major>"}

or in a safetensors file that the sender wrote

    {"file": "/tmp/.../7.safetensors", "name": "logits"}
"""

import base64
import binascii
import math
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy

PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 2**30            # one message; the suite's largest is a few MiB
DTYPES = {"F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8")}
SENT_DTYPES = {"f": "F32", "i": "I64", "u": "I64", "b": "I64"}   # what the runner sends: the goldens' F32 and I64


class ProtocolError(RuntimeError):
    """A message that breaks the protocol (not JSON, a missing field, a malformed tensor)."""


def is_tensor(value):
    return isinstance(value, dict) and ("data" in value and "dtype" in value or "file" in value and "name" in value)


def to_wire(value, handle=None, files=None):
    """Arrays -> tensor objects (inline; or, with `files` a dict, named entries of one safetensors file the caller
    writes: {"file": files["path"], "name": ...}), NumPy scalars -> numbers, other objects -> handle(object)."""
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value, DTYPES[SENT_DTYPES[value.dtype.kind]])
        if files is not None:
            name = f"t{len(files['tensors'])}"
            files["tensors"][name] = array
            return {"file": str(files["path"]), "name": name}
        return {"dtype": SENT_DTYPES[value.dtype.kind], "shape": list(array.shape),
                "data": base64.b64encode(array.tobytes()).decode("ascii")}
    if isinstance(value, dict):
        return {str(k): to_wire(v, handle, files) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_wire(v, handle, files) for v in value]
    if isinstance(value, (np.integer, np.bool_)):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if handle is None:
        raise TypeError(f"cannot send a {type(value).__name__} in a message")
    return handle(value)


def new_files(path):
    """A collector for to_wire's `files`: the tensors of one message, written together by write_files."""
    return {"path": Path(path), "tensors": {}}


def write_files(files):
    if files["tensors"]:
        safetensors.numpy.save_file(files["tensors"], str(files["path"]))


def from_wire(value):
    """Tensor objects -> read-only NumPy arrays, everywhere in a message."""
    if is_tensor(value):
        return tensor(value)
    if isinstance(value, dict):
        return {k: from_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    return value


def tensor(spec):
    if "file" in spec:
        return file_tensor(spec)
    dtype, shape, data = DTYPES.get(spec["dtype"]), spec.get("shape"), spec["data"]
    if dtype is None:
        raise ProtocolError(f"tensor dtype {spec['dtype']!r}: expected one of {', '.join(DTYPES)}")
    if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
        raise ProtocolError(f"tensor shape {shape!r:.100}: expected a list of non-negative integers")
    if not isinstance(data, str):
        raise ProtocolError("tensor data must be a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error as e:
        raise ProtocolError(f"tensor data is not base64 ({e})") from None
    if len(raw) != math.prod(shape) * dtype.itemsize:       # checked before anything is shaped from it
        raise ProtocolError(f"tensor of shape {shape} {spec['dtype']} needs {math.prod(shape) * dtype.itemsize} "
                            f"bytes, its data has {len(raw)}")
    return np.frombuffer(raw, dtype).reshape(shape)


def file_tensor(spec):
    path, name = spec["file"], spec["name"]
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            if name not in f.keys():
                raise ProtocolError(f"{path} has no tensor {name!r}")
            array = f.get_tensor(name)
    except ProtocolError:
        raise
    except Exception as e:   # a missing or malformed file: safetensors raises its own error types
        raise ProtocolError(f"tensor {name!r} of {path}: {type(e).__name__}: {e}") from None
    if array.dtype not in DTYPES.values():
        raise ProtocolError(f"tensor {name!r} of {path}: dtype {array.dtype}, expected one of {', '.join(DTYPES)}")
    return array
