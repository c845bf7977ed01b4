"""Model-level goldens on production-shaped checkpoints, generated on the user's machine.

    qwen35-conformance shaped --like Qwen3.5-0.8B --out DIR     # then: qwen35-conformance run --engine E --dir DIR

A shaped checkpoint (published.py: a published model's exact layer geometry, 4 layers, vocabulary 512, its MTP head)
is some 150 MB in bf16 and its goldens (states at Hv 16, K = V = 128) several MB a case: past the golden budget. So
the kit ships a recipe and digests instead (conformance/shaped_pack.json): the checkpoint is drawn from its seed into
the kit's weights/ folder (weights/shaped-<model>-L<layers>-V<vocab>, checked against its stored sha256), the cases
are computed by reference.py in float64 with the suite's own generator, and each case's float64 outputs are checked
against a stored fingerprint before they are written, so a drifted oracle stops the command instead of judging
engines. The cases are ordinary suite cases (format.py) and run with `run --dir`.
"""

import json
import sys
from pathlib import Path

from . import published, reference as R
from .format import ROOT, checkpoint_dir, directory_sha256, write_case
from .kernels import fingerprint, fingerprint_drift

PACK_FILE = Path(__file__).resolve().parent / "shaped_pack.json"
LAYERS, VOCAB, SEED = 4, 512, 0
# the published geometries whose float64 generation fits a laptop: 0.8B (about 2 GB, a minute; in CI) and 4B, the
# smallest with more value heads than key heads (32 against 16: the head mapping symmetric 0.8B and 2B cannot show;
# 569 M parameters at 4 layers, a 1.1 GB checkpoint, several GB and minutes: by hand, INTERPRETING.md section 10)
RECIPES = ("Qwen3.5-0.8B", "Qwen3.5-4B")


def checkpoint_name(like):
    return f"shaped-{like}-L{LAYERS}-V{VOCAB}"


ACCEPT_COUNTS = (0, 2, 4)


# serving traces (conformance/make/traces.py), greedy: rows accepting different counts in one batch, a zero-draft
# step right after an accept (vllm#52942), a snapshot after a partial accept restored later (vllm#43559)
TRACE_SCENARIOS = ("mixed-accepts", "zero-draft-after-accept", "snapshot-after-partial-accept")


def shaped_cases(name):
    """The model-level cases of the suite's generator on checkpoint `name`: prefill, decode with the state, a
    chunk-crossing extend, greedy, speculative rounds accepting 0, 2 and 4 drafts under both rollbacks, and a few
    serving traces."""
    from .make import build as G, traces
    yield G.forward_case(name, "prefill-T70", (70,), with_state=False)
    yield G.forward_case(name, "decode", (20,) + (1,) * 8, with_state=True)
    yield G.forward_case(name, "extend", (2, 66, 1), with_state=True)
    yield G.greedy_case(name)
    yield from G.spec_greedy_cases(name, ACCEPT_COUNTS, distinct_last=False)  # a random tied model repeats tokens
    for scenario in TRACE_SCENARIOS:
        yield traces.trace_case(scenario, name, traces.GREEDY)


def materialise_checkpoint(like, pinned_sha256, progress):
    """weights/<name>: drawn from the recipe's seed unless it is there already; -> its name. Checked by sha256."""
    name = checkpoint_name(like)
    folder = checkpoint_dir(name)
    if not folder.is_dir():
        print(f"drawing {folder} ...", file=progress, flush=True)
        try:
            published.write_checkpoint(folder, published.published_config(like, LAYERS, VOCAB), SEED)
        except OSError as e:
            raise R.UserError(f"{folder}: cannot write the shaped checkpoint there ({e.strerror})") from None
    digest = directory_sha256(folder)
    if pinned_sha256 is not None and digest != pinned_sha256:
        raise R.UserError(f"{folder}: sha256 {digest}, the recipe pins {pinned_sha256}: the checkpoint drawn from the "
                          "seed changed (numpy's random streams or published.py), or the folder was edited; delete "
                          "it to draw it again")
    return name, digest


def case_fingerprint(case):
    return fingerprint({name: out.value.astype("float64") for name, out in case.outputs.items()})


def materialise(like, out_dir, pack=None, progress=sys.stderr):
    """Write the shaped cases of `like` into out_dir (must not exist or be empty), each checked against the pack."""
    pack = json.loads(PACK_FILE.read_text()) if pack is None else pack
    if like not in pack["recipes"]:
        raise R.UserError(f"--like {like!r}: no shaped recipe (recipes: {', '.join(pack['recipes'])})")
    recipe = pack["recipes"][like]
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise R.UserError(f"--out {out_dir}: exists and is not an empty folder")
    name, _ = materialise_checkpoint(like, recipe["checkpoint_sha256"], progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    count = 0
    for count, case in enumerate(shaped_cases(name), 1):
        pinned = recipe["fingerprints"].get(case.name)
        drift = "no pinned fingerprint" if pinned is None else fingerprint_drift(pinned, case_fingerprint(case))
        if drift:
            raise R.UserError(f"{case.name}: the reference's float64 result does not match shaped_pack.json "
                              f"({drift}): the oracle changed")
        write_case(out_dir, case)
        print(f"[{count}] {case.name}", file=progress, flush=True)
    print(f"wrote {count} cases to {out_dir} (checkpoint {checkpoint_dir(name).relative_to(ROOT)} of the kit); "
          f"run them with: qwen35-conformance run --engine ENGINE --dir {out_dir}", file=progress)
    return count


def measure(likes=RECIPES, pack=None, progress=sys.stderr):
    """The pack as the generator computes it here: each recipe's checkpoint sha256 and case fingerprints (the recipes
    in `likes`; the others kept from `pack`)."""
    recipes = dict(pack["recipes"]) if pack else {}
    for like in likes:
        name, digest = materialise_checkpoint(like, None, progress)
        prints = {}
        for case in shaped_cases(name):
            prints[case.name] = case_fingerprint(case)
            print(case.name, file=progress, flush=True)
        recipes[like] = {"layers": LAYERS, "vocab": VOCAB, "seed": SEED, "checkpoint": name,
                         "checkpoint_sha256": digest, "fingerprints": prints}
    return {"why": "shaped goldens are generated on the user's machine (conformance/shaped.py); these digests pin "
                   "the drawn checkpoint (sha256) and the reference's float64 outputs (sums, norms, 8 sampled values, "
                   "within 1e-9)", "recipes": recipes}


def add_arguments(parser):
    parser.add_argument("--like", default=RECIPES[0], choices=RECIPES, help=f"the published geometry (default "
                        f"{RECIPES[0]}; {LAYERS} layers, vocabulary {VOCAB})")
    parser.add_argument("--out", type=Path, required=True, help="cases folder to write (must not exist or be empty)")


def shaped_command(args):
    materialise(args.like, args.out)
    return 0


if __name__ == "__main__":  # python -m conformance.shaped [LIKE ...]: rewrite shaped_pack.json (those recipes) here
    likes = sys.argv[1:] or RECIPES
    if not set(likes) <= set(RECIPES):
        print(f"expected recipes among {', '.join(RECIPES)}", file=sys.stderr)
        sys.exit(2)
    old = json.loads(PACK_FILE.read_text()) if PACK_FILE.is_file() else None
    PACK_FILE.write_text(json.dumps(measure(likes, old), indent=1, sort_keys=True) + "\n")
    print(f"wrote {PACK_FILE}")
