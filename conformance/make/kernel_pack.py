"""Write conformance/kernel_pack.json: the float64 reference's fingerprint of every kernel case, for both input dtypes,
and the tolerances, from the rounding the float32 NumPy engine measures (its worst error times HEADROOM).

    python -m conformance.make.kernel_pack [--check]
"""

import argparse
import json
import sys

import numpy as np

from .. import kernels as K

HEADROOM = 8
FLOOR = 1e-6


def measure():
    fingerprints, worst = {}, {}
    engine = K.NumpyKernels()
    for dtype in ("float32", "bfloat16"):
        fingerprints[dtype] = {}
        for case in K.pack_cases():
            inputs, want = K.prepared(case, dtype)
            fingerprints[dtype][case.name] = K.fingerprint(want)
            got = K.engine_outputs(engine, case, inputs, dtype)
            for output, w in want.items():
                if output == "ids":  # compared exactly
                    continue
                key = (K.family(case), dtype, output if output in ("o", "y", "weights") else "states")
                err = float(np.abs(got[output] - w).max())
                worst[key] = max(worst.get(key, 0.0), err)
            print(f"{dtype} {case.name}", file=sys.stderr)
    tolerances = {}
    for (family, dtype, output), err in sorted(worst.items()):
        tolerances.setdefault(family, {}).setdefault(dtype, {})[output] = {
            "atol": float(f"{max(err * HEADROOM, FLOOR):.2g}"), "rtol": 0,
            "measured": float(f"{err:.3g}")}
    return {"why": "tolerances: the float32 NumPy engine's worst absolute error against the float64 reference over "
                   f"the pack (measured), times {HEADROOM}; bfloat16 inputs: outputs rounded to bf16 (what kernels "
                   "return), states float32; the router's expert ids are compared exactly; rope adds "
                   f"{K.ANGLE_RTOL!r} * angle * pair radius on the rotary dims (float32 angles are implementation-"
                   "defined within an ulp or two: kernels.rope_bound)", "tolerances": tolerances,
            "fingerprints": fingerprints}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare the fingerprints with the committed file")
    args = ap.parse_args()
    pack = measure()
    if args.check:
        stored = K.load_pack()
        stale = [f"{d} {n}: {drift}" for d in pack["fingerprints"] for n, fp in pack["fingerprints"][d].items()
                 if (drift := K.fingerprint_drift(stored["fingerprints"][d].get(n, {"?": {"shape": []}}), fp))]
        print("\n".join(stale) or "kernel_pack.json: fresh")
        sys.exit(1 if stale else 0)
    K.PACK_FILE.write_text(json.dumps(pack, indent=1, sort_keys=True) + "\n")
    print(f"wrote {K.PACK_FILE}")


if __name__ == "__main__":
    main()
