"""Run the cases against one engine: drive it as each case's kind says, compare outputs within the declared
tolerances, weigh the results against the engine's expectations, print a table, optionally write a JSON report."""

import fnmatch
import json
import re
import sys
import traceback
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import safetensors.numpy

from . import diagnosis, reference as R
from .chisquare import bin_totals, chi_square
from .engines import get_engine
from .format import (CASES_DIR, EXPECTED, HERE, INPUTS, ROOT, SUITE_VERSION, case_dirs, checkpoint_dir, features_named,
                     read_manifest, read_tensors, trace_batches)

# Actual outputs of failing cases, for inspection: relative, so under the directory the run starts in (never inside
# the installed kit).
OUT_DIR = Path("qwen35-conformance-out")
SHOWN_MISMATCHES = 5


# ----------------------------------------------------------------------------------------------------------------
# Driving an engine through one case. Each returns {output name: array}.

def at_precision(spec, precision):
    """An output's comparison for an engine computing in `precision`: the output's profile of that name, where it has
    one, replaces the fp32 bounds (INTERPRETING.md section 6)."""
    return {**spec, **spec.get(precision, {})}


def sampling_settings(attrs):
    return {k: attrs[k] for k in ("temperature", "top_k", "top_p")}


def drive_op(engine, meta, inputs, expected, model):
    return engine.run_op(meta["kind"], inputs, meta["attrs"])


def drive_forward(engine, meta, inputs, expected, model):
    chunks, tokens = meta["attrs"]["chunks"], inputs["tokens"]
    logits, state = engine.prefill(model, tokens[:chunks[0]])
    parts, start = [logits], chunks[0]
    for size in chunks[1:]:
        logits, state = engine.decode(model, state, tokens[start:start + size])
        parts.append(logits)
        start += size
    actual = {"logits": np.concatenate(parts)}
    if "state_export" in engine.features:
        actual.update(engine.export_state(model, state))
    return actual


def drive_greedy(engine, meta, inputs, expected, model):
    return {"tokens": engine.greedy(model, inputs["prompt"], meta["attrs"]["n"])}


def drive_sampling(engine, meta, inputs, expected, model):
    p, tokens = engine.sample(inputs["logits"], sampling_settings(meta["attrs"]), inputs["uniforms"])
    return {"probabilities": p, "tokens": tokens}


def decisions_compared(meta, engine):
    """False at a precision whose profile leaves decisions out (bf16): the golden's decisions are then committed, so
    that what follows them stays comparable (INTERPRETING.md section 6)."""
    return all(at_precision(spec, engine.precision).get("compared", True) for spec in meta["outputs"].values()
               if spec["tolerance"] == "decision")


def drive_speculative(engine, meta, inputs, expected, model):
    """Prefill, then reference.speculative_round on the engine (verify [last + drafts], accept, commit), then decode
    the new token."""
    attrs, tokens = meta["attrs"], inputs["verify_tokens"]
    target = engine.target(model, attrs["rollback"])
    _, state = target.extend(None, inputs["prompt"])
    keep = None if decisions_compared(meta, engine) else len(expected["committed"])
    r = R.speculative_round(target, state, tokens, inputs.get("q"), R.sampling_of(attrs), inputs.get("uniforms"),
                            keep=keep)
    actual = {"verify_logits": r.logits}
    if r.committed is not None:
        actual.update(accepted=np.array([r.accepted]), committed=np.array(r.committed))
    if "state_export" in engine.features:
        actual.update(engine.export_state(model, r.state))
    token = r.committed[-1] if r.committed is not None else int(expected["committed"][-1])
    actual["next_logits"] = target.extend(r.state, [token])[0]
    return actual


def drive_tree(engine, meta, inputs, expected, model):
    """Prefill, verify the draft tree in one pass, accept (greedy, or multi-draft sampling with the given q and
    uniforms), commit the accepted path, then decode the new token (INTERPRETING.md section 4, "Draft trees")."""
    attrs, tokens, parents = meta["attrs"], inputs["tree_tokens"], inputs["tree_parents"]
    _, state = engine.prefill(model, inputs["prompt"])
    logits, pending = engine.verify_tree(model, state, tokens, parents, attrs["rollback"])
    actual = {"tree_logits": logits}
    if decisions_compared(meta, engine):
        path, token = engine.accept_tree(tokens, parents, inputs.get("q"), logits, sampling_settings(attrs),
                                         inputs.get("uniforms"))
        path, token = [int(node) for node in path], int(token)
        actual.update(path=np.array(path), committed=np.array([int(tokens[node]) for node in path[1:]] + [token]))
    else:                       # the golden's decision, so that the commit and what follows stay comparable
        path, token = [int(node) for node in expected["path"]], int(expected["committed"][-1])
    state = engine.commit_tree(model, pending, path)
    if "state_export" in engine.features:
        actual.update(engine.export_state(model, state))
    actual["next_logits"] = engine.decode(model, state, np.array([token], dtype=np.int64))[0]
    return actual


def drive_trace(engine, meta, inputs, expected, model):
    """The trace's batches through engine.run_trace; outputs named b<batch>.s<step>.<output>."""
    batches = trace_batches(meta["attrs"], inputs)
    if not decisions_compared(meta, engine):
        batches = [[golden_commit(step, f"b{b}.s{s}.", expected) for s, step in enumerate(batch)]
                   for b, batch in enumerate(batches)]
    actual = {}
    for b, s, out in engine.run_trace(model, batches, meta["attrs"].get("rollback"), meta["attrs"]["slots"]):
        actual.update({f"b{b}.s{s}.{name}": np.atleast_1d(np.asarray(value)) for name, value in out.items()})
    return actual


def golden_commit(step, prefix, expected):
    """A deciding trace row with the golden's decision forced: the kept positions of a verify row, the committed path
    of a verify_tree row."""
    if prefix + "committed" not in expected:
        return step
    n = len(expected[prefix + "committed"])
    if step["op"] == "verify_tree":
        return {**step, "commit": {"path": [int(node) for node in expected[prefix + "path"][:n]]}}
    return {**step, "commit": {"keep": n}}


def drive_mtp(engine, meta, inputs, expected, model):
    """Rounds of the MTP head as a drafter (INTERPRETING.md section 4): the target consumes each round's tokens (its
    hidden states are compared); the head, fed the round's given hidden states and next tokens, drafts on the given
    chain. Outputs named r<round>.<output>."""
    state = mtp_state = None
    actual = {}
    for r in range(meta["attrs"]["rounds"]):
        def named(name):
            return f"r{r}.{name}"
        actual[named("target_hidden")], state = engine.mtp_hidden(model, state, inputs[named("tokens")])
        logits, hidden, mtp_state = engine.mtp_draft(model, mtp_state, inputs[named("next")], inputs[named("hidden")],
                                                     inputs[named("chain")])
        actual.update({named("draft_logits"): logits, named("draft_hidden"): hidden})
        if "state_export" in engine.features:
            actual.update({named(f"mtp_{n}"): v for n, v in engine.export_mtp_state(model, mtp_state).items()})
    return actual


def drive_dflash(engine, meta, inputs, expected, model):
    """Rounds of a DFlash drafter (INTERPRETING.md section 4): the target consumes each round's tokens (the features
    it taps are compared); the drafter, fed the round's given features, drafts the block after the given last token.
    Outputs named r<round>.<output>."""
    drafter = engine.load_dflash(model, checkpoint_dir(meta["attrs"]["drafter"]["name"]))
    state = dflash_state = None
    actual = {}
    for r, k in enumerate(meta["attrs"]["draft_lens"]):
        def named(name):
            return f"r{r}.{name}"
        actual[named("target_features")], state = engine.dflash_features(model, drafter, state, inputs[named("tokens")])
        actual[named("block_logits")], dflash_state = engine.dflash_draft(
            model, drafter, dflash_state, inputs[named("features")], int(inputs[named("last")][0]), k)
        if "state_export" in engine.features:
            actual.update({named(f"dflash_{n}"): v for n, v in
                           engine.export_dflash_state(model, drafter, dflash_state).items()})
    return actual


def drive_sampling_draws(engine, meta, inputs, expected, model):
    """The statistical pack: n tokens drawn from each row with the engine's own random numbers -> their counts."""
    logits, n = inputs["logits"], meta["attrs"]["draws"]
    tokens = np.asarray(engine.draw(logits, sampling_settings(meta["attrs"]), n, meta["seed"]))
    if tokens.shape != (len(logits), n) or tokens.dtype.kind not in "iu" or not (
            (0 <= tokens) & (tokens < logits.shape[-1])).all():
        raise ValueError(f"draw returned {tokens.dtype}{list(tokens.shape)} (min {tokens.min(initial=0)}, max "
                         f"{tokens.max(initial=0)}); expected ids in [0, {logits.shape[-1]}), shape {[len(logits), n]}")
    return {"outcomes": np.stack([np.bincount(row, minlength=logits.shape[-1]) for row in tokens])}


def drive_speculative_draws(engine, meta, inputs, expected, model):
    """The statistical pack: n rounds of speculative sampling of the same drafts with the engine's own random numbers
    -> counts of (drafts accepted, next token)."""
    logits, drafts, n = inputs["verify_logits"], inputs["drafts"], meta["attrs"]["draws"]
    accepted, tokens = (np.asarray(a) for a in engine.accept_draws(drafts, inputs["q"], logits,
                                                                   sampling_settings(meta["attrs"]), n, meta["seed"]))
    shape = (len(drafts) + 1, logits.shape[-1])
    if accepted.shape != (n,) or tokens.shape != (n,) or not ((0 <= accepted) & (accepted < shape[0])).all() or not (
            (0 <= tokens) & (tokens < shape[1])).all():
        raise ValueError(f"accept_draws returned accepted {list(accepted.shape)}, tokens {list(tokens.shape)} outside "
                         f"[0, {shape[0]}) x [0, {shape[1]}), or not {n} of each")
    counts = np.zeros(shape, np.int64)
    np.add.at(counts, (accepted.astype(np.int64), tokens.astype(np.int64)), 1)
    return {"outcomes": counts}


def drive_tree_draws(engine, meta, inputs, expected, model):
    """The statistical pack: n rounds of the engine's acceptance of the same tree with its own random numbers ->
    counts of (the last accepted node, next token)."""
    logits, tokens, n = inputs["tree_logits"], inputs["tree_tokens"], meta["attrs"]["draws"]
    ends, drawn = (np.asarray(a) for a in engine.accept_tree_draws(tokens, inputs["tree_parents"], inputs["q"], logits,
                                                                   sampling_settings(meta["attrs"]), n, meta["seed"]))
    if ends.shape != (n,) or drawn.shape != (n,) or not ((0 <= ends) & (ends < len(tokens))).all() or not (
            (0 <= drawn) & (drawn < logits.shape[-1])).all():
        raise ValueError(f"accept_tree_draws returned ends {list(ends.shape)}, tokens {list(drawn.shape)} outside "
                         f"[0, {len(tokens)}) x [0, {logits.shape[-1]}), or not {n} of each")
    counts = np.zeros(logits.shape, np.int64)
    np.add.at(counts, (ends.astype(np.int64), drawn.astype(np.int64)), 1)
    return {"outcomes": counts}


DRIVERS = {"forward": drive_forward, "greedy": drive_greedy, "sampling": drive_sampling,
           "speculative": drive_speculative, "tree": drive_tree, "trace": drive_trace, "mtp": drive_mtp,
           "dflash": drive_dflash, "sampling_draws": drive_sampling_draws, "speculative_draws": drive_speculative_draws,
           "tree_draws": drive_tree_draws}
STATISTICAL = ("sampling_draws", "speculative_draws", "tree_draws")      # the cases of `sample` mode, which `run` leaves out


# ----------------------------------------------------------------------------------------------------------------
# Comparing.

class Comparison(NamedTuple):
    ok: bool
    max_abs: float | None          # float outputs only
    rel: float | None              # max abs error / max |expected|
    lines: tuple                   # why it failed, or a note on how it passed


def compare_tokens(actual, expected, ties):
    """Exact, except that at a listed near-tie step the other token is also right (and the paths part there)."""
    for step, (a, e) in enumerate(zip(actual.tolist(), expected.tolist())):
        if a == e:
            continue
        if a in ties.get(str(step), ()):
            return Comparison(True, None, None, (f"took the other near-tie token at step {step}; later steps not compared",))
        return Comparison(False, None, None, (f"first mismatch at index {step}: expected {e}, actual {a}",
                                              f"expected {expected.tolist()}", f"actual   {actual.tolist()}"))
    return Comparison(True, None, None, ())


def compare_draws(spec, counts, P, bins, draws):
    """Pearson's chi-square test of the engine's counts against the exact distribution, as the case fixes it."""
    test = spec["test"]
    statistic, impossible = chi_square(counts, P, bins, draws)
    verdict = (f"chi-square {statistic:.1f} on {test['degrees_of_freedom']} degrees of freedom, "
               f"{'over' if statistic > test['critical'] else 'within'} {test['critical']:.1f} (false-alarm rate "
               f"{spec['alpha']:g})")
    lines = [verdict]
    if impossible:
        where = [", ".join(f"{axis} {i}" for axis, i in zip(test["axes"], index))
                 for index in zip(*np.nonzero((counts > 0) & (bins < 0)))]
        lines.append(f"{impossible} draws of outcomes with no chance: {'; '.join(where[:SHOWN_MISMATCHES])}")
    expected, observed = bin_totals(draws * P.astype(np.float64), bins), bin_totals(counts.astype(np.float64), bins)
    shown = SHOWN_MISMATCHES if statistic > test["critical"] else 0
    for b in np.argsort(-(observed - expected) ** 2 / expected)[:shown]:
        members = list(zip(*np.nonzero(bins == b)))
        what = ", ".join(f"{axis} {i}" for axis, i in zip(test["axes"], members[0])) if len(members) == 1 else \
            f"{len(members)} outcomes pooled"
        lines.append(f"  {what}: expected {expected[b]:.1f}, drawn {observed[b]:.0f}")
    return Comparison(statistic <= test["critical"] and not impossible, None, None, tuple(lines))


def compare(spec, actual, expected, others=None, attrs=None):
    """One output against its golden; `others` (the case's expected tensors) and `attrs` for a chi-square test."""
    if actual is None:
        return Comparison(False, None, None, ("the engine did not return this output",))
    actual = np.asarray(actual)
    if actual.shape != expected.shape:
        return Comparison(False, None, None, (f"shape {actual.shape}, expected {expected.shape}",))
    if spec["tolerance"] == "draws":
        return compare_draws(spec, actual, expected, others[spec["test"]["bins"]], attrs["draws"])
    if spec["tolerance"] in ("exact", "decision"):
        return compare_tokens(actual, expected, spec.get("ties", {}))
    err = np.abs(actual.astype(np.float64) - expected)
    allowed = spec["atol"] + spec["rtol"] * np.abs(expected.astype(np.float64))
    bad = ~(err <= allowed)                                   # NaN counts as bad
    max_abs = float(err.max(initial=0))
    rel = max_abs / max(float(np.abs(expected).max(initial=0)), 1e-30)
    lines = [f"{int(bad.sum())} of {bad.size} elements outside atol={spec['atol']:g} + rtol={spec['rtol']:g} * |expected|"]
    for index in list(zip(*np.nonzero(bad)))[:SHOWN_MISMATCHES]:
        lines.append(f"  [{', '.join(map(str, index))}]  expected {expected[index]: .7g}  actual {actual[index]: .7g}  "
                     f"diff {err[index]:.3g}  allowed {allowed[index]:.3g}")
    return Comparison(not bad.any(), max_abs, rel, tuple(lines) if bad.any() else ())


# ----------------------------------------------------------------------------------------------------------------
# Expectations and results.

class ExpectationsError(ValueError):
    """Expectations that cannot be used: one line on the command line, exit 2."""


def own_expectations(engine):
    """The engine's expectations file: its `expectations` attribute (a path: how an engine in another package ships
    its own), else expectations/<name>.json of a shipped adapter. None: every declared feature must pass."""
    path = getattr(engine, "expectations", None)
    if path is None and re.fullmatch(r"[a-z][a-z0-9_]*", engine.name):
        path = HERE / "expectations" / f"{engine.name}.json"
        return path if path.is_file() else None
    return path


def read_expectations(path):
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise ExpectationsError(f"{path}: cannot read it ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExpectationsError(f"{path}: not JSON ({e})") from None


def checked_expectations(data, source):
    """{"unsupported": {feature or group: {reason, evidence}}, "known_failures": {case name or glob: {expected: FAIL
    or ERROR, reason, evidence}}} -> ({feature: its entry}, known failures). A group's entry covers each of its
    features that has no entry of its own."""
    if not isinstance(data, dict):
        raise ExpectationsError(f"{source}: expected a JSON object")
    unsupported, known = data.get("unsupported", {}), data.get("known_failures", {})
    if not (isinstance(unsupported, dict) and all(isinstance(entry, dict) and isinstance(entry.get("reason"), str)
                                                  for entry in unsupported.values())):
        raise ExpectationsError(f"{source}: `unsupported` must map features to {{\"reason\": ..., \"evidence\": ...}}")
    if not (isinstance(known, dict) and all(isinstance(entry, dict) and entry.get("expected") in ("FAIL", "ERROR")
                                            and isinstance(entry.get("reason"), str) for entry in known.values())):
        raise ExpectationsError(f"{source}: `known_failures` must map case names or globs to {{\"expected\": "
                                "\"FAIL\" or \"ERROR\", \"reason\": ..., \"evidence\": ...}")
    try:
        named = features_named(unsupported)
    except ValueError as e:
        raise ExpectationsError(f"{source}: `unsupported` names {e}") from None
    return {feature: unsupported[name] for feature, name in named.items()}, known


class Result(NamedTuple):
    name: str
    status: str                    # PASS, FAIL, ERROR, SKIP
    unexpected: bool
    note: str
    max_abs: float | None
    rel: float | None
    details: tuple
    outputs: dict
    diagnosis: tuple = ()          # a FAIL's matching mistakes (diagnosis.py), when diagnosed


def skip_result(name, missing, unsupported):
    unexplained = [f for f in missing if f not in unsupported]
    if unexplained:
        return Result(name, "SKIP", True, f"lacks {', '.join(unexplained)}, with no reason recorded in the "
                      "engine's expectations", None, None, (), {})
    reasons = dict.fromkeys(unsupported[f]["reason"] for f in missing)
    return Result(name, "SKIP", False, f"lacks {', '.join(missing)}: {' / '.join(reasons)}", None, None, (), {})


def outputs_named(names, specs):
    """Output names for a note: listed when few, else counted by tolerance kind (a trace has hundreds)."""
    if len(names) <= 6:
        return ", ".join(names)
    kinds = [specs[name]["tolerance"] for name in names]
    return ", ".join(f"{kinds.count(kind)} {kind} outputs" for kind in dict.fromkeys(kinds))


def run_case(engine, folder, meta, unsupported, known_failures, load_model, out_dir, diagnose_with=None):
    name = meta["name"]
    missing = [f for f in meta["features"] if f not in engine.features]
    if missing:
        return skip_result(name, missing, unsupported)
    specs = {out: at_precision(spec, engine.precision) for out, spec in meta["outputs"].items()}
    uncompared = sorted(out for out, spec in specs.items() if not spec.get("compared", True))
    if uncompared and all(spec["tolerance"] == "exact" for out, spec in specs.items() if out not in uncompared):
        # nothing left but lengths to compare: the case says nothing about the engine at this precision
        return Result(name, "SKIP", False, f"{outputs_named(uncompared, specs)}: not compared at {engine.precision} "
                      "(tolerances.json says why)", None, None, (), {})
    inputs, expected = read_tensors(folder, INPUTS), read_tensors(folder, EXPECTED)
    try:
        model = load_model(meta["checkpoint"]) if meta["checkpoint"] else None
        actual = DRIVERS.get(meta["kind"], drive_op)(engine, meta, inputs, expected, model)
        compared = {out: compare(spec, actual.get(out), expected[out], expected, meta["attrs"])
                    for out, spec in specs.items()
                    if spec.get("requires") in (None, *engine.features) and out not in uncompared}
    except Exception as e:  # an adapter or engine crash is a result of the case, not of the run
        status, compared = "ERROR", {}
        details = (f"{type(e).__name__}: {e}", *traceback.format_exc().splitlines()[-4:-1])
    else:
        status = "PASS" if all(c.ok for c in compared.values()) else "FAIL"
        details = tuple(f"{out}: {line}" for out, c in compared.items() for line in c.lines if not c.ok)
    skipped_outputs = sorted({spec["requires"] for spec in meta["outputs"].values()
                              if spec.get("requires") and spec["requires"] not in engine.features})
    notes = [f"{out}: {line}" for out, c in compared.items() if c.ok for line in c.lines]
    notes += [f"outputs needing {f} not compared" for f in skipped_outputs]
    notes += [f"{outputs_named(uncompared, specs)}: not compared at {engine.precision}"] if uncompared else []
    known = next((v for pattern, v in known_failures.items() if fnmatch.fnmatchcase(name, pattern)), None)
    if known:
        unexpected = status != known["expected"]
        notes.insert(0, f"expected {known['expected']}: {known['reason']}" if not unexpected else
                     f"expected {known['expected']} ({known['reason']}) but got {status}: update the expectations")
    else:
        unexpected = status in ("FAIL", "ERROR")
    floats = [c for c in compared.values() if c.max_abs is not None]
    matches = ()
    if status == "FAIL":
        save_actual(out_dir, engine.name, name, actual)
        if unexpected and diagnose_with and diagnosis.candidates(meta["kind"]):
            matches, line = diagnose(diagnose_with, meta, inputs, expected, actual, {o: specs[o] for o in compared})
            details += (line,)
    return Result(name, status, unexpected, "; ".join(notes),
                  max((c.max_abs for c in floats), default=None), max((c.rel for c in floats), default=None), details,
                  {out: c._asdict() for out, c in compared.items()}, matches)


class Diagnoser(NamedTuple):
    """What diagnose recomputes a case with: the reference adapter and its models by checkpoint."""
    engine: object
    load_model: object


def reference_diagnoser():
    engine = get_engine("reference")
    return Diagnoser(engine, model_loader(engine))


def diagnose(diagnoser, meta, inputs, expected, actual, specs):
    """The catalogued mistakes (diagnosis.py) whose outputs on this case the engine's match within the case's
    tolerances, among those the case tells from the spec -> (their names, a line for the details)."""
    told, matches = [], []
    model = diagnoser.load_model(meta["checkpoint"]) if meta["checkpoint"] else None
    for mistake in diagnosis.candidates(meta["kind"]):
        with diagnosis.applied(mistake):
            try:
                variant = DRIVERS.get(meta["kind"], drive_op)(diagnoser.engine, meta, inputs, expected, model)
            except Exception:       # a mistake that cannot run on this case (a shape it breaks) tells nothing here
                continue
        names = [out for out in specs if out in variant and np.shape(variant[out]) == expected[out].shape]
        if not names or all(compare(specs[out], variant[out], expected[out]).ok for out in names):
            continue                # the case cannot tell this mistake from the spec
        told.append(mistake.name)
        if all(compare({**specs[out], "ties": {}}, actual.get(out), np.asarray(variant[out])).ok for out in names):
            matches.append(mistake.name)
    if matches:
        return tuple(matches), (f"diagnosis: the outputs match {' and '.join(f'`{m}`' for m in matches)} ("
                                f"{'; '.join(diagnosis.MISTAKES[m].description for m in matches)}); INTERPRETING.md "
                                "section 9")
    return (), (f"diagnosis: the outputs match none of the {len(told)} catalogued mistakes this case tells apart "
                "(INTERPRETING.md section 9)")


def actual_dir(out_dir, engine_name):
    """Where the outputs of an engine's failing cases go (`exec:./engine --flag` is an engine name too)."""
    return Path(out_dir) / re.sub(r"[^A-Za-z0-9_.-]+", "_", engine_name)


def save_actual(out_dir, engine_name, case_name, actual):
    folder = actual_dir(out_dir, engine_name)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {n: np.ascontiguousarray(a) for n, a in actual.items() if isinstance(a, np.ndarray)}
    safetensors.numpy.save_file(tensors, str(folder / f"{case_name}.safetensors"))


# ----------------------------------------------------------------------------------------------------------------
# The run.

def fmt(x):
    return "-" if x is None else f"{x:.2e}"


def print_table(results, out):
    rows = [("case", "status", "max abs err", "rel err", "note")]
    rows += [(r.name, r.status + ("!" if r.unexpected else ""), fmt(r.max_abs), fmt(r.rel), r.note) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4], file=out)
    for r in results:
        if r.details:
            print(f"\n{r.name}: {r.status}", file=out)
            for line in r.details:
                print(f"  {line}", file=out)


def runs_of(meta):
    """A trace with drafts (in chains or trees) and a tree case run once per rollback strategy (their goldens hold for
    both), named <case>@<strategy>; every other case runs once."""
    drafts = {"speculative", "trace:tree"} & set(meta["features"])
    if not (meta["kind"] == "trace" and drafts or meta["kind"] == "tree"):
        return [meta]
    return [{**meta, "name": f"{meta['name']}@{strategy}", "features": [*meta["features"], f"rollback:{strategy}"],
             "attrs": {**meta["attrs"], "rollback": strategy}} for strategy in R.ROLLBACK_STRATEGIES]


def select_cases(cases_dir, pattern, statistical=False):
    """(folder, manifest) of each run of the cases whose name matches the regular expression (runs_of): the
    statistical pack's (STATISTICAL kinds) or the others; any unusable golden stops the run."""
    return [(folder, run) for folder in case_dirs(cases_dir) if not pattern or re.search(pattern, folder.name)
            for run in runs_of(read_manifest(folder)) if (run["kind"] in STATISTICAL) == statistical]


def counted(runs):
    """What a selection of runs (select_cases) covers: "121 cases (149 runs: 28 traces run once per rollback strategy,
    per-position and replay)" (traces and tree cases run twice), or "7 cases" where every case runs once."""
    cases = len({folder for folder, _ in runs})
    text = f"{cases} case{'s' * (cases != 1)}"
    if len(runs) == cases:
        return text
    folders = [folder for folder, _ in runs]
    twice = {}                        # kind -> the folders run more than once
    for folder, meta in runs:
        if folders.count(folder) > 1:
            twice.setdefault(meta["kind"], set()).add(folder)
    named = {"trace": ("trace", "traces"), "tree": ("tree case", "tree cases")}
    kinds = [f"{len(group)} {named[kind][len(group) != 1]}" for kind, group in twice.items()]
    return (f"{text} ({len(runs)} runs: {' and '.join(kinds)} run once per rollback strategy, "
            f"{' and '.join(R.ROLLBACK_STRATEGIES)})")


def seeded(meta, seed):
    """A statistical case with the seed its engine draws with: one stream per case and run seed."""
    return {**meta, "seed": zlib.crc32(f"{meta['name']}#{seed}".encode())}


def run(engine_name, pattern=None, report=None, cases_dir=CASES_DIR, expectations=None, out=None, progress=None,
        out_dir=OUT_DIR, timeout=None, fail_fast=False, statistical=False, seed=0, diagnose=True):
    """Returns (results, exit code): 1 when any result is unexpected. `engine_name`: anything get_engine takes (a
    name, package.module:Class, exec:COMMAND; `timeout` is a process engine's per-request limit). `expectations`: a
    dict or a JSON file, by default the engine's own (own_expectations). The table goes to `out` (stdout), progress
    lines to `progress` (stderr), outputs of failing cases to `out_dir`/<engine>/. fail_fast: stop after the first
    unexpected result (the results then end with it). statistical: run the statistical pack (`sample` mode), its
    engine seeded from `seed`, instead of the other cases. diagnose: name the catalogued mistake each unexpected FAIL
    matches (diagnosis.py)."""
    out, progress = out or sys.stdout, progress or sys.stderr
    engine = get_engine(engine_name, timeout)
    try:
        return run_engine(engine, engine_name, pattern, report, cases_dir, expectations, out, progress, out_dir,
                          fail_fast, statistical, seed, diagnose)
    finally:
        engine.close()


def engine_expectations(engine, expectations):
    """`expectations` (a dict, a JSON file, or None: the engine's own, own_expectations) -> (its file or None, the
    unsupported features, the known failures)."""
    if expectations is None:
        expectations = own_expectations(engine)
    source = expectations if isinstance(expectations, (str, Path)) else None
    data = read_expectations(source) if source else {} if expectations is None else expectations
    return (source, *checked_expectations(data, source or "the expectations given"))


def model_loader(engine):
    """A case's checkpoint -> the engine's model of it, each checkpoint loaded once."""
    models = {}

    def load_model(checkpoint):
        if checkpoint["name"] not in models:
            models[checkpoint["name"]] = engine.load(ROOT / checkpoint["path"])
        return models[checkpoint["name"]]
    return load_model


def run_engine(engine, engine_name, pattern, report, cases_dir, expectations, out, progress, out_dir, fail_fast=False,
               statistical=False, seed=0, diagnose=True):
    source, unsupported, known_failures = engine_expectations(engine, expectations)
    cases = [(folder, seeded(meta, seed) if statistical else meta)
             for folder, meta in select_cases(cases_dir, pattern, statistical)]
    load_model = model_loader(engine)
    results, diagnoser = [], reference_diagnoser() if diagnose and not statistical else None
    for i, (folder, meta) in enumerate(cases, 1):
        results.append(run_case(engine, folder, meta, unsupported, known_failures, load_model, out_dir, diagnoser))
        print(f"[{i}/{len(cases)}] {results[-1].status:<5} {meta['name']}", file=progress, flush=True)
        if fail_fast and results[-1].unexpected:
            break
    print_table(results, out)
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "ERROR", "SKIP")}
    unexpected = [r.name for r in results if r.unexpected]
    print(f"\n{engine_name}: {counted(cases[:len(results)])}: " + ", ".join(f"{n} {s.lower()}" for s, n in counts.items())
          + (f"; {len(unexpected)} unexpected (marked !)" if unexpected else "; all as expected"), file=out)
    if counts["FAIL"]:
        print(f"outputs of the failing cases: {actual_dir(out_dir, engine.name).resolve()}", file=out)
    if report:
        Path(report).write_text(json.dumps({
            "suite_version": SUITE_VERSION, "engine": engine_name, "precision": engine.precision,
            "mode": "sample" if statistical else "run", **({"seed": seed} if statistical else {}),
            "features": sorted(engine.features), "expectations": source and str(source),
            "summary": {**counts, "unexpected": unexpected},
            "cases": [{"name": r.name, "status": r.status, "unexpected": r.unexpected, "note": r.note,
                       "max_abs_error": r.max_abs, "rel_error": r.rel, "details": list(r.details),
                       "outputs": r.outputs, **({"diagnosis": list(r.diagnosis)} if r.diagnosis else {})} for r in results]}, indent=1) + "\n")
    return results, 1 if unexpected else 0
