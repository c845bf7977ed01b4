"""Deliberate scheduler and serving bugs for jax_impl's HTTP server (python -m jax_impl.http_server --inject-bug NAME):
each is a one-line change to batch.py, scheduler.py or spec_decode.py of the kind a real engine shipped, applied to the
module's source when the server starts (before anything imports it). tests/test_check_server.py serves with each and
requires `check-server` to fail naming a scenario; conformance/INTERPRETING.md lists them. Without the flag nothing here runs.

    python -m jax_impl.injected_bugs          the catalogue, one bug a line
"""

import importlib.util
import sys
from pathlib import Path
from typing import NamedTuple

from . import reference

HERE = Path(__file__).parent


class Bug(NamedTuple):
    name: str
    does: str              # what the server then gets wrong
    mirrors: str           # the published bug it stands for ("" where there is none to cite)
    module: str            # spec_decode (a request's step, sampling, acceptance), batch or scheduler
    original: str          # a line of the module, without its indentation: it must occur exactly once
    replacement: str
    caught_by: str         # a scenario that catches it (the test runs this one)
    escapes: str = ""      # why no black-box check can see it here ("": check-server must catch it)


CATALOGUE = (
    Bug("slot-reused-with-state", "a new request takes a freed slot with the previous request's DeltaNet and KV "
        "state (only the position reset)", "ik_llama.cpp#1696", "batch",
        "source = row._replace(state=zero(row.state), drafts=zero(row.drafts)) if restored is None else restored",
        "source = row._replace(state=row.state._replace(length=jnp.zeros_like(row.state.length))) "
        "if restored is None else restored", "concurrency-64"),
    Bug("cache-restore-drops-conv-window", "a prefix-cache entry restores the DeltaNet recurrent state but not its "
        "convolution window (zeros)", "vllm#53912", "batch",
        "source = row._replace(state=zero(row.state), drafts=zero(row.drafts)) if restored is None else restored",
        "source = row._replace(state=zero(row.state), drafts=zero(row.drafts)) if restored is None else restored._replace("
        "state=restored.state._replace(layers=tuple(x._replace(conv=0 * x.conv) if hasattr(x, 'conv') else x "
        "for x in restored.state.layers)))", "shared-prefix-cache"),
    Bug("cache-restore-position-off-by-one", "a restored request continues its prefill one position past the "
        "entry's, skipping a prompt token", "vllm#43559", "batch",
        "row = row._replace(state=source.state, drafts=source.drafts, buf=prompt, ntok=settings.prompt_len,",
        "row = row._replace(state=source.state._replace(length=source.state.length + (restored is not None)), "
        "drafts=source.drafts, buf=prompt, ntok=settings.prompt_len,", "shared-prefix-cache"),
    Bug("cache-key-unchecked", "the prefix cache matches any cached prompt no longer than the new one (the tokens "
        "not compared: a hash or key collision)", "vllm#43559", "scheduler",
        "if (len(key) <= len(r.prompt) and r.prompt[:len(key)] == key and entry.holds(r.draft)",
        "if (len(key) <= len(r.prompt) and entry.holds(r.draft)", "shared-prefix-cache"),
    Bug("chunk-offset-off-by-one", "every prompt chunk after the first starts one token late",
        "sglang#39342", "spec_decode",
        "tokens = select(prefilling, lax.dynamic_slice_in_dim(row.buf, c, T), verify_tokens)",
        "tokens = select(prefilling, lax.dynamic_slice_in_dim(row.buf, c + (c > 0), T), verify_tokens)",
        "long-prompts"),
    Bug("rejected-round-keeps-drafts", "a round whose drafts are all rejected keeps the state after every verified "
        "position (an accept count of 0 treated as 'keep all')", "vllm#50021", "spec_decode",
        "whole = n == after.length - before.length",
        "whole = (n == after.length - before.length) | (n == 1)", "speculative-acceptance-mix"),
    Bug("partial-pass-rolled-back", "only a full-width pass keeps its own state: a prefill chunk in a step with "
        "drafts is rolled back to its first K+1 positions (mixed prefill/decode batches)", "sglang#39342",
        "spec_decode",
        "whole = n == after.length - before.length", "whole = n == K + 1", "prompts-without-cache"),
    Bug("commit-rejected-draft", "the first rejected draft is committed in place of the target's own token",
        "llama.cpp#28019", "spec_decode",
        "new = jnp.where(positions < accepted, jnp.append(drafts, 0), token)",
        "new = jnp.where(positions <= jnp.minimum(accepted, len(drafts) - 1), jnp.append(drafts, 0), token)",
        "speculative-acceptance-mix"),
    Bug("stop-ignored-in-draft-block", "a stop id among accepted drafts does not end the request (only the "
        "target's own token is tested)", "", "spec_decode",
        "stops = jnp.isin(new, stop) & (positions <= accepted)",
        "stops = jnp.isin(new, stop) & (positions == accepted)", "stop-in-accepted-drafts"),
    Bug("drafts-past-max-tokens", "drafts are not cut at the tokens left, so an accepted block runs past "
        "max_tokens", "", "spec_decode",
        "return drafts, q, jnp.minimum(m, settings.limit - (row.ntok - settings.prompt_len) - 1)",
        "return drafts, q, m", "speculative-acceptance-mix"),
    Bug("max-tokens-off-by-one", "a request generates one token more than max_tokens", "", "scheduler",
        "np.int32(DRAFTER_NAMES.index(r.draft)), np.int32(K), np.int32(limit), np.int32(len(r.prompt)),",
        "np.int32(DRAFTER_NAMES.index(r.draft)), np.int32(K), np.int32(limit + 1), np.int32(len(r.prompt)),",
        "single-greedy"),
    Bug("event-skips-a-token", "the host reports one token fewer than were committed at each read-back (a "
        "streamed token lost between syncs)", "", "scheduler",
        "self.live[index] = live = live._replace(emitted=generated)",
        "self.live[index] = live = live._replace(emitted=generated + (not done))", "long-generations"),
    Bug("stop-not-cleared-on-reuse", "a slot's stop ids are the union of its own and the previous request's",
        "", "batch",
        "prefill_to=prefill_to, phase=jnp.int32(PREFILL), key=jax.random.key(seed), settings=settings,",
        "prefill_to=prefill_to, phase=jnp.int32(PREFILL), key=jax.random.key(seed), settings=settings._replace("
        "stop=jnp.where(settings.stop < 0, row.settings.stop, settings.stop)),", "slot-reuse-after-stop"),
    Bug("first-token-from-padding", "a prompt's first generated token is read from the last chunk's padded end, "
        "not its last valid position", "vllm#55357", "spec_decode",
        "pick = select(prefilling, jnp.maximum(valid - 1, 0), jnp.arange(K + 1))",
        "pick = select(prefilling, jnp.maximum(jnp.minimum(valid, T - 1), 0), jnp.arange(K + 1))",
        "max-tokens-1"),
    Bug("tokens-to-neighbour", "while a request runs, its new tokens are reported under the request in the slot "
        "before it (one request's tokens delivered to another)", "", "scheduler",
        "events.append(Event(live.id, new, bool(done)))",
        "events.append(Event(self.live[index - 1].id if index and self.live[index - 1] and not done else live.id, "
        "new, bool(done)))", "concurrency-64"),
    Bug("sampled-temperature-dropped", "a sampled request's temperature reaches the sampler as 1 (the API's default "
        "put in place of the request's own)", "z-lab/dflash#74", "scheduler",
        "np.float32(r.sampling.temperature), np.int32(min(r.sampling.top_k, self.cfg.vocab_size)),",
        "np.float32(r.sampling.temperature and 1.0), np.int32(min(r.sampling.top_k, self.cfg.vocab_size)),",
        "sampled-first-token"),
    Bug("residual-from-p", "the token after a rejected draft is drawn from p instead of normalise(max(0, p - q)) "
        "(rules.py residual-from-p)", "", "spec_decode",
        "use_residual = (n < m) & (residual.sum() > 0)",
        "use_residual = (n < m) & (residual.sum() < 0)", "sampled-speculative"),
    Bug("ratio-inverted", "a draft is kept with chance min(1, q/p) instead of min(1, p/q) (rules.py ratio-inverted: "
        "an n-gram's one-hot draft is then always kept)", "", "spec_decode",
        "ok = (u[:K] < jnp.minimum(1, p_x / q_x)) & (jnp.arange(K) < m)",
        "ok = (u[:K] < jnp.minimum(1, q_x / p_x)) & (jnp.arange(K) < m)", "sampled-speculative"),
    Bug("logprobs-one-token-late", "each returned log-probability is the previous token's (the log-probabilities "
        "read one position behind the tokens)", "", "scheduler",
        "events[-1] = events[-1]._replace(logprobs=logprob[index, P + live.emitted:P + generated].tolist())",
        "events[-1] = events[-1]._replace(logprobs=logprob[index, P + live.emitted - 1:P + generated - 1].tolist())",
        "single-greedy"),
)
BUGS = {bug.name: bug for bug in CATALOGUE}


def enclosing_function(bug):
    """The name of the function of bug.module whose body holds bug.original."""
    name = None
    for line in (HERE / f"{bug.module}.py").read_text().splitlines():
        if line.startswith("def ") or line.startswith("    def "):
            name = line.split()[1].split("(")[0]
        if line.strip() == bug.original:
            return name
    raise AssertionError(f"{bug.name}: its line is not in {bug.module}.py")


def touches_step(bug):
    """Whether the bug changes the compiled step program (spec_decode.py, batch.py outside the slot bookkeeping), so
    that a server with it compiles its own."""
    return bug.module == "spec_decode" or (bug.module == "batch" and enclosing_function(bug) not in (
        "admit", "free", "read_slot", "resume"))


def mutated_source(bug):
    source = (HERE / f"{bug.module}.py").read_text()
    lines = [line for line in source.splitlines() if line.strip() == bug.original]
    if len(lines) != 1:
        raise AssertionError(f"{bug.name}: its line occurs {len(lines)} times in {bug.module}.py")
    indent = lines[0][:len(lines[0]) - len(lines[0].lstrip())]
    return source.replace(lines[0], indent + bug.replacement)


def install(name):
    """Put the named bug's module, mutated, in sys.modules before anything imports the original."""
    if name not in BUGS:
        raise reference.UserError(f"--inject-bug {name}: expected one of {', '.join(BUGS)}")
    bug = BUGS[name]
    qualified = f"{__package__}.{bug.module}"
    if qualified in sys.modules:
        raise AssertionError(f"{qualified} was imported before the bug could be injected")
    spec = importlib.util.spec_from_loader(qualified, loader=None, origin=str(HERE / f"{bug.module}.py"))
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(HERE / f"{bug.module}.py")
    sys.modules[qualified] = module
    exec(compile(mutated_source(bug), module.__file__, "exec"), module.__dict__)


def server_class(name):
    """The Server class to serve with, the named bug installed first (None: no bug)."""
    if name is not None:
        install(name)
    from .scheduler import Server
    return Server


def check_catalogue(model, flags):
    """Serve with each bug in turn and run check-server (the kit's command line: jax_impl imports nothing of the kit,
    which sits above it) on the scenario that should catch it -> lines to print."""
    import json
    import os
    import subprocess
    import tempfile
    kit = __package__.rpartition(".")[0]        # "" in a clone, "qwen35" installed
    conformance = f"{kit}.conformance" if kit else "conformance"
    cache = tempfile.mkdtemp(prefix="jax-cache-")  # the bugs outside the step program share its compilation
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    for bug in CATALOGUE:
        process = subprocess.Popen([sys.executable, "-m", f"{__package__}.http_server", "--model", model, "--port",
                                    "0", "--inject-bug", bug.name, *flags], stdout=subprocess.PIPE, text=True, env=env)
        try:
            url = process.stdout.readline().split()[-1]
            report = Path(cache) / f"{bug.name}.json"
            check = subprocess.run([sys.executable, "-m", conformance, "check-server", "--url", url, "--model", model,
                                    "--scenarios", f"^{bug.caught_by}$", "--timeout", "300", "--report", str(report)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if check.returncode not in (0, 1):
                raise AssertionError(f"check-server failed to run: {check.stderr.strip()}")
            code, failures = check.returncode, json.loads(report.read_text())["scenarios"][0]["failures"]
            first = failures[0] if failures else {}
            yield (f"{bug.name:<36} {'CAUGHT' if code else 'MISSED'} by {bug.caught_by}: {len(failures)} failing "
                   f"requests, first {first.get('rule')} at position {first.get('position')}")
        finally:
            process.terminate()
            process.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:  # --check [MODEL [SERVER FLAGS...]]
        model = sys.argv[2] if len(sys.argv) > 2 else str(HERE.parent / "weights" / "tiny-mtp")
        for line in check_catalogue(model, sys.argv[3:] or ["--slots", "16", "--max-draft-len", "8", "--step-width",
                                                            "16", "--all-features", "--cache-bytes", "3000000"]):
            print(line, flush=True)
    else:
        for bug in CATALOGUE:
            print(f"{bug.name:<36} {bug.module + '.py':<11} {'step' if touches_step(bug) else 'host':<5} caught by "
                  f"{bug.caught_by:<28} {bug.mirrors or '-':<18} {bug.does}")
