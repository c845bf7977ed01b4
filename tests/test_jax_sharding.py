"""Tensor parallelism on 4 forced host devices (a subprocess: XLA reads the device count at start-up) gives the
tokens of one device, with the weights, the KV cache and the DeltaNet state really split, in the single-request loop
and in the batched serving engine; so does a 4-device mesh spanning two processes (jax.distributed, the multi-host
path) through the command line."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import jax_impl

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 17, 42, 99, 3, 17, 42, 7, 8, 9, 100, 200, 17, 42, 7]
# (the 1-device runs share test_jax_generate's compiled programs)
RUNS = [("tiny-moe", dict(draft="ngram", draft_len=4))]  # MoE, DeltaNet and attention layers, speculative loop
# requests served together on the mesh: several prompts, plain and speculative rows side by side
SERVED = [dict(prompt=PROMPT, max_new_tokens=16, draft="ngram"), dict(prompt=PROMPT[:6], max_new_tokens=12),
          dict(prompt=PROMPT[4:], max_new_tokens=9, draft="ngram", draft_len=2)]

CHILD = """
import json, sys
from functools import partial
import jax, jax.numpy as jnp, numpy as np
import jax_impl, reference
from jax_impl.spec_decode import prefill_device
from jax_impl.scheduler import Server
runs, prompt, served = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
mesh = jax_impl.make_mesh(4)
out = {"devices": len(jax.devices()), "runs": []}
for name, spec in runs:
    cfg, params = jax_impl.load(f"weights/{name}", mesh=mesh)
    out["runs"].append(jax_impl.generate(params, cfg, prompt, 16, mesh=mesh, **spec)[0])
cfg, params = jax_impl.load("weights/tiny-moe", mesh=mesh)
pre = jax.jit(partial(prefill_device, cfg=cfg, sampling=reference.Sampling(), capacity=64, mesh=mesh))(
    params, prompt=jnp.array(prompt + [0]), prompt_len=len(prompt), key=jax.random.key(0))
server = Server(params, cfg, 2, context=64, mesh=mesh)
out["served"] = [tokens for tokens, _ in server.generate(served)]
spec = lambda x: [str(a) for a in x.sharding.spec]
out["specs"] = {"in_proj_qkv": spec(params["layers"][0]["linear_attn"]["in_proj_qkv"]),
                "experts.down_proj": spec(params["layers"][0]["mlp"]["experts"]["down_proj"]),
                "S": spec(pre.state.layers[0].S), "kv": spec(pre.state.layers[3].k),
                "served S": spec(server.slots.state.layers[0].S)}
print(json.dumps(out))
"""


def test_four_devices_give_the_tokens_of_one():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(RUNS), json.dumps(PROMPT), json.dumps(SERVED)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    # S by value head (after the slot axis when served); Hkv = 2 does not split 4 ways
    assert out["specs"] == {"in_proj_qkv": ["None", "tp"], "experts.down_proj": ["None", "None", "tp"],
                            "S": ["tp"], "kv": [], "served S": ["None", "tp"]}
    for (name, spec), tokens in zip(RUNS, out["runs"]):
        cfg, params = jax_impl.load(ROOT / "weights" / name)
        assert tokens == jax_impl.generate(params, cfg, PROMPT, 16, **spec)[0], (name, spec)
    cfg, params = jax_impl.load(ROOT / "weights" / "tiny-moe")
    for request, tokens in zip(SERVED, out["served"]):
        assert tokens == jax_impl.generate(params, cfg, **request)[0], request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_the_tokens_of_one(draft="ngram"):
    """2 processes x 2 host devices joined on localhost (cross-process collectives: gloo, XLA:CPU's default), one
    4-device "tp" mesh; only process 0 prints, and its --json stdout is exactly the JSON."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jax_impl", "--model", "weights/tiny-moe", "--prompt-ids", ",".join(map(str, PROMPT)),
           "--devices", "4", "--max-new-tokens", "16", "--json", "--draft", draft,
           "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.monotonic() + 300  # a hang (a peer gone, an XLA:CPU deadlock) fails instead of blocking
    try:
        outs = [p.communicate(timeout=max(1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("timed out; stderr:\n" + "\n".join(p.communicate()[1][-2000:] for p in procs))
    finally:
        for p in procs:
            p.kill()
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, (i, err[-3000:])
    assert outs[1][0] == ""
    tokens = json.loads(outs[0][0])["tokens"]
    cfg, params = jax_impl.load(ROOT / "weights" / "tiny-moe")
    assert tokens == jax_impl.generate(params, cfg, PROMPT, 16, draft=draft)[0]
