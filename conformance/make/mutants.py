"""The suite proves its power: a catalogue of realistic one-line bugs in the slots engine (conformance/engines/slots.py),
the ones serving engines have shipped or could ship, each of which the serving traces must catch (INTERPRETING.md,
section 4, "What the traces catch"). tests/test_mutants.py applies each to a copy of the engine and requires the runner
to report an unexpected FAIL or ERROR naming a case; `python -m conformance.make.mutants` prints the case that catches each
one first.
"""

import io
import sys
import time
import types
from pathlib import Path
from typing import NamedTuple

from .. import runner
from ..engines import ENGINES

SLOTS = Path(runner.__file__).parent / "engines" / "slots.py"
ENGINES_PACKAGE = runner.__package__ + ".engines"      # conformance.engines
REGISTRATION = '@register_engine("slots")'
TRACES = "^trace-"


class Mutant(NamedTuple):
    name: str
    does: str              # what the engine then gets wrong, in one line
    mirrors: str           # the published bug it mirrors, "" where there is none to cite
    original: str          # a line of slots.py without its indentation: it must occur exactly once
    replacement: str       # the line put in its place ("pass": the line deleted)
    escapes: str = ""      # why the current traces cannot catch it ("": they must)


CATALOGUE = (
    # which state a row starts from
    Mutant("zero-draft-reads-base", "a row without drafts reads the slot's base arrays, not its committed column: "
           "after a partial accept (per-position) they hold the state after every verified position",
           "vllm#52942", "columns = [memory.column[slot] for slot in slots]",
           "columns = [memory.column[slot] if spec else NONE for slot, spec in zip(slots, speculative)]"),
    Mutant("column-off-by-one", "the committed column is the number of kept positions, not that number - 1 (the "
           "state one position late; an IndexError when every draft is accepted)", "",
           "memory.column[slot] = n - 1              # lazy: the next forward of the slot reads this column",
           "memory.column[slot] = n"),
    Mutant("column-0-taken-for-none", "a pending column is tested as > 0, so column 0 (a commit that kept one "
           "position: no draft accepted) reads the base arrays, the state after every verified position", "",
           "elif column != NONE:", "elif column > 0:"),
    Mutant("column-minus-1-wraps", "the no-column sentinel -1 is tested against None, so a slot without a pending "
           "commit reads column -1: an old verify pass's last state, or zeros", "vllm#50021",
           "elif column != NONE:", "elif column is not None:"),
    Mutant("slot-from-batch-row", "a row's slot is its index in the batch (the persistent-batch row), not the slot "
           "its request holds", "", 'slots = [memory.slot_of[step["request"]] for _, step in rows]',
           "slots = list(range(len(rows)))"),
    Mutant("writeback-in-slot-order", "the forwards' results are written back to the slots in slot order, not in "
           "the order of the rows that computed them",
           "", "for slot, (_, step), start, (_, _, after, tapes), spec in zip(slots, rows, starts, passes, speculative):",
           "for slot, (_, step), start, (_, _, after, tapes), spec in zip(sorted(slots), rows, starts, passes, "
           "speculative):"),
    Mutant("prefill-classified-by-shape", "a row is a verify row when it holds K+1 tokens, whatever its op: a prompt "
           "chunk of exactly K+1 tokens then waits for a commit that never comes, its positions not counted",
           "vllm#49918", 'speculative = [step["op"] == "verify" and len(step["tokens"]) > 1 for _, step in rows]',
           'speculative = [len(step["tokens"]) == memory.width for _, step in rows]'),
    # slots: admission, release, prefix cache
    Mutant("slot-state-not-cleared", "a new request inherits the recurrent state (S) of the slot's last user",
           "ikawrakow/ik_llama.cpp#1696", "mem.S[slot] = 0", "pass"),
    Mutant("slot-conv-not-cleared", "a new request inherits the conv window of the slot's last user",
           "Luce-Org/lucebox#210", "mem.conv[slot] = 0", "pass"),
    Mutant("slot-length-not-reset", "a new request's positions go on from the slot's last user, whose KV it "
           "attends to", "", "self.length[slot], self.column[slot] = 0, NONE", "self.column[slot] = NONE"),
    Mutant("slot-column-not-reset", "a new request reads the committed column its slot's last user left "
           "(per-position)", "", "self.length[slot], self.column[slot] = 0, NONE", "self.length[slot] = 0"),
    Mutant("released-slot-leaks", "a released slot never returns to the free list: the engine runs out of slots",
           "", "self.free.append(self.slot_of.pop(request))", "self.slot_of.pop(request)"),
    Mutant("every-prefill-is-new", "every prompt chunk is taken for a new request: a chunked prefill starts "
           "again from an empty state in another slot, and the old slot leaks", "",
           'if step["request"] not in memory.slot_of:        # a new request\'s first prompt chunk',
           'if step["op"] == "prefill":'),
    Mutant("snapshot-before-commit", "a prefix-cache entry is copied from the slot's base arrays, ignoring the "
           "pending commit: after a partial accept (per-position) it holds every verified position", "vllm#43559",
           "self.cache[key] = copied(self.current(self.slot_of[request]))",
           "self.cache[key] = copied(self.read(self.slot_of[request], NONE))"),
    Mutant("snapshot-is-a-view", "a prefix-cache entry holds views of the slot, not copies: whatever the slot "
           "does next changes the entry", "", "self.cache[key] = copied(self.current(self.slot_of[request]))",
           "self.cache[key] = self.current(self.slot_of[request])"),
    Mutant("restore-without-kv", "a restore copies the recurrent state but not the attention KV: it writes only "
           "positions past the entry's length", "",
           "self.write(self.admit(request), self.cache[key], since=0)",
           "self.write(self.admit(request), self.cache[key], since=self.cache[key].length)"),
    # verify and commit
    Mutant("plain-row-keeps-column", "a plain row (a prompt chunk, no drafts) writes the base arrays but leaves "
           "the committed column set: the slot's next row reads that stale column (per-position)", "",
           "self.column[slot] = NONE", "pass"),
    Mutant("length-from-query-len", "a plain row sets the slot's length to the tokens it ran (the query length), "
           "not to the tokens consumed: the next row's positions restart", "",
           "self.length[slot] = state.length", "self.length[slot] = state.length - since"),
    Mutant("verify-kv-from-first-draft", "a verify row writes the KV of its drafts but not of its first token (the "
           "last committed one, taken as cached already)", "",
           "self.write(slot, after, since=start.length)", "self.write(slot, after, since=start.length + 1)"),
    Mutant("length-counts-rejected", "the commit advances the slot's length by every verified position, not the "
           "kept ones: rejected drafts stay in the KV that later rows attend to", "",
           "self.length[slot] += n", "self.length[slot] += verified"),
    Mutant("stop-not-cutting-commit", "a stop token inside an accepted block ends the committed tokens but not "
           "the commit: the state keeps every accepted position", "",
           "return accepted, committed, len(committed)", "return accepted, committed, accepted + 1"),
    Mutant("columns-from-post-verify", "the per-position states are computed from the state the verify pass left "
           "(an in-place kernel's), not the one it started from", "",
           "kept = [k for k in R.keep_per_position(start, tapes) if k is not None]",
           "kept = [k for k in R.keep_per_position(after, tapes) if k is not None]"),
    Mutant("conv-from-last-column", "per-position: the conv window is read from the last column (after every "
           "verified position) while S is read from the committed one", "vllm#50272",
           "layers.append(R.DeltaState(mem.conv_cols[slot, column], mem.S_cols[slot, column]))",
           "layers.append(R.DeltaState(mem.conv_cols[slot, -1], mem.S_cols[slot, column]))"),
    Mutant("replay-from-post-verify", "replay: the pre-verify state is saved after the pass updated the slot in "
           "place, so the replay starts from the post-verify state", "",
           "for (mem, before), tape in zip(memory.deltas(start), [t for t in tapes if t is not None]):",
           "for (mem, before), tape in zip(memory.deltas(after), [t for t in tapes if t is not None]):"),
    Mutant("replay-skipped-at-k", "replay: the 'everything accepted' test is off by one, so a commit of K of the "
           "K+1 positions keeps the post-verify state", "",
           "if n < verified:                         # when all are kept, the pass left the right state",
           "if n < verified - 1:"),
    Mutant("replay-one-step-short", "replay: n - 1 steps replayed (the state misses the last kept position)", "",
           "mem.S[slot] = R.replay(mem.S_before[slot], tape, n)", "mem.S[slot] = R.replay(mem.S_before[slot], tape, n - 1)"),
    Mutant("replay-one-step-long", "replay: n + 1 steps replayed (the first rejected draft is kept)", "",
           "mem.S[slot] = R.replay(mem.S_before[slot], tape, n)", "mem.S[slot] = R.replay(mem.S_before[slot], tape, n + 1)"),
    Mutant("recurrent-state-not-rolled-back", "replay: S is not rolled back (the conv window and the KV are): it "
           "keeps every verified position", "transformers#49036",
           "mem.S[slot] = R.replay(mem.S_before[slot], tape, n)", "pass"),
    Mutant("conv-not-rolled-back", "replay: the conv window is not rolled back (S and the KV are): it holds the "
           "rejected drafts' inputs", "vllm#50272",
           "mem.conv[slot] = R.conv_window(mem.conv_before[slot], tape.qkv, n)", "pass"),
    Mutant("conv-window-one-ahead", "replay: the conv window is rolled back to n + 1 positions, taking in the "
           "first rejected draft's input", "",
           "mem.conv[slot] = R.conv_window(mem.conv_before[slot], tape.qkv, n)",
           "mem.conv[slot] = R.conv_window(mem.conv_before[slot], tape.qkv, n + 1)"),
)


def engine_name(mutant):
    return f"slots-mutant-{mutant.name}"


def mutated_source(mutant, source):
    """slots.py's source with the mutant's line replaced (indentation kept) and its engine registered as
    engine_name(mutant)."""
    lines = source.splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line.strip() == mutant.original]
    if len(at) != 1 or source.count(REGISTRATION) != 1:
        raise ValueError(f"mutant {mutant.name}: its line occurs {len(at)} times in {SLOTS.name} and "
                         f"{REGISTRATION} {source.count(REGISTRATION)} times; each must occur once")
    line = lines[at[0]]
    lines[at[0]] = line[:len(line) - len(line.lstrip())] + mutant.replacement + "\n"
    return "".join(lines).replace(REGISTRATION, f'@register_engine("{engine_name(mutant)}")')


def register(mutant):
    """Runs the mutated slots.py as a new module (the real one is untouched) -> the engine name it registered."""
    module = types.ModuleType(f"{ENGINES_PACKAGE}.slots_mutant_{mutant.name.replace('-', '_')}")
    module.__package__ = ENGINES_PACKAGE      # slots.py imports relatively
    exec(compile(mutated_source(mutant, SLOTS.read_text()), f"<slots.py, mutant {mutant.name}>", "exec"),
         module.__dict__)
    return engine_name(mutant)


def first_catch(mutant):
    """The traces against the mutant, stopping at the first unexpected result -> that result (None: not caught)."""
    try:
        results, code = runner.run(register(mutant), TRACES, out=io.StringIO(), progress=io.StringIO(), fail_fast=True,
                                   diagnose=False)
    finally:
        ENGINES.pop(engine_name(mutant), None)
    return results[-1] if code else None


def table_row(mutant, caught):
    """The mutant's row in INTERPRETING.md's table, given its first_catch."""
    verdict = f"`{caught.name}` ({caught.status})" if caught else f"**not caught**: {mutant.escapes}"
    return f"| `{mutant.name}` | {mutant.does} | {mutant.mirrors or '–'} | {verdict} |"


def main():
    """Prints the catalogue as INTERPRETING.md's table, with the case that catches each mutant first; exits 1 when a
    mutant that must be caught is not, or one recorded as escaping is caught."""
    print("| mutant | what the engine then does | mirrors | caught first by |\n| --- | --- | --- | --- |")
    wrong, caught, start = [], 0, time.perf_counter()
    for mutant in CATALOGUE:
        result = first_catch(mutant)
        print(table_row(mutant, result), flush=True)
        caught += result is not None
        if (result is None) != bool(mutant.escapes):
            wrong.append(mutant.name)
    print(f"\n{caught} of {len(CATALOGUE)} mutants caught ({time.perf_counter() - start:.0f} s)"
          + (f"; not as recorded: {', '.join(wrong)}" if wrong else ""))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
