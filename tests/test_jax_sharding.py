"""Tensor parallelism on 4 forced host devices (a subprocess: XLA reads the device count at start-up) gives the
tokens of one device, with the weights, the KV cache and the DeltaNet state really split."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax_impl

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 17, 42, 99, 3, 17, 42, 7, 8, 9, 100, 200, 17, 42, 7]
# (the 1-device runs share test_jax_generate's compiled programs)
RUNS = [("tiny-moe", dict(draft="ngram", draft_len=4))]  # MoE, DeltaNet and attention layers, speculative loop

CHILD = """
import json, sys
from functools import partial
import jax, jax.numpy as jnp, numpy as np
import jax_impl, reference
from jax_impl.spec_decode import prefill_device
runs, prompt = json.loads(sys.argv[1]), json.loads(sys.argv[2])
mesh = jax_impl.make_mesh(4)
out = {"devices": len(jax.devices()), "runs": []}
for name, spec in runs:
    cfg, params = jax_impl.load(f"weights/{name}", mesh=mesh)
    out["runs"].append(jax_impl.generate(params, cfg, prompt, 16, mesh=mesh, **spec)[0])
cfg, params = jax_impl.load("weights/tiny-moe", mesh=mesh)
pre = jax.jit(partial(prefill_device, cfg=cfg, sampling=reference.Sampling(), capacity=64, mesh=mesh))(
    params, prompt=jnp.array(prompt + [0]), prompt_len=len(prompt), key=jax.random.key(0))
spec = lambda x: [str(a) for a in x.sharding.spec]
out["specs"] = {"in_proj_qkv": spec(params["layers"][0]["linear_attn"]["in_proj_qkv"]),
                "experts.down_proj": spec(params["layers"][0]["mlp"]["experts"]["down_proj"]),
                "S": spec(pre.state.layers[0].S), "kv": spec(pre.state.layers[3].k)}
print(json.dumps(out))
"""


def test_four_devices_give_the_tokens_of_one():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(RUNS), json.dumps(PROMPT)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    assert out["specs"] == {"in_proj_qkv": ["None", "tp"], "experts.down_proj": ["None", "None", "tp"],
                            "S": ["tp"], "kv": []}  # S by value head; Hkv = 2 does not split 4 ways
    for (name, spec), tokens in zip(RUNS, out["runs"]):
        cfg, params = jax_impl.load(ROOT / "weights" / name)
        assert tokens == jax_impl.generate(params, cfg, PROMPT, 16, **spec)[0], (name, spec)
