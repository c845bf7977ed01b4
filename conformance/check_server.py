"""check-server: a running server, from outside, held to the spec (INTERPRETING.md, "Checking a running server").

    qwen35-conformance check-server --url http://HOST:PORT --model DIR [--scenarios REGEX] [--concurrency N]
        [--report out.json] [--dialect jax_impl] [--precision float32] [--draft DRAFTER] [--tree N[:D[:B]]]

Each scenario (server_scenarios.json) is a set of requests sent concurrently, some at given times, some after
others finish, some cancelled mid-stream. The server answers with token ids (server_dialects.py). Then every request
is teacher-forced through the spec (reference.py's forward over prompt + returned tokens, one pass per distinct
sequence, in parallel threads) and each greedy token is held to the spec's argmax within the declared near-tie
margin (tolerances.json "server"), each returned log-probability to the spec's within its tolerance, and the stop,
EOS and max_tokens rules are checked. A failure names the scenario, the request, the first bad position, the prefix
before it, the spec's top tokens with their logits and the server's token.
"""

import http.client
import json
import re
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from . import reference as R
from . import server_statistics as stats
from .format import TOLERANCES
from .server_dialects import DIALECTS, Chunk, ServerRequest

SCENARIOS = Path(__file__).with_name("server_scenarios.json")
RULES = TOLERANCES["server"]
TOP = 5                    # spec tokens a failure lists
TAIL = 8                   # prefix tokens a failure lists
MAX_RESPONSE_BYTES = 2**26


class ServerError(Exception):
    """The server could not be reached or talked to at all (exit 2)."""


# ----------------------------------------------------------------------------------------------------------------
# Scenarios: prompts from a rule any language can replay

def lcg_tokens(seed, length, vocab, avoid, alphabet=None):
    """`length` ids from the 64-bit LCG x <- 6364136223846793005 x + 1442695040888963407 (mod 2^64), x0 = seed:
    id = (x >> 33) mod vocab, an id in `avoid` (EOS and stop ids) moved up by one until it is not. With an
    `alphabet` (the ids a text-prompt dialect can send, none of them avoided): id = alphabet[(x >> 33) mod its size]."""
    x, out = seed & (2**64 - 1), []
    for _ in range(length):
        x = (6364136223846793005 * x + 1442695040888963407) & (2**64 - 1)
        if alphabet is not None:
            out.append(int(alphabet[(x >> 33) % len(alphabet)]))
            continue
        t = (x >> 33) % vocab
        while t in avoid:
            t = (t + 1) % vocab
        out.append(int(t))
    return out


def build_prompt(parts, vocab, avoid, alphabet=None):
    """A scenario prompt: its parts concatenated. A part is {"ids": [...]}, or {"seed", "length"} (lcg_tokens),
    with "period": the first `period` of those ids repeated to `length`."""
    prompt = []
    for part in parts:
        if "ids" in part:
            prompt += part["ids"]
        else:
            block = lcg_tokens(part["seed"], part.get("period", part["length"]), vocab, avoid, alphabet)
            prompt += (block * (part["length"] // len(block) + 1))[:part["length"]]
    return prompt


class TextPrompts:
    """Prompts for a dialect whose API takes text, not ids: drawn from an alphabet of ids that each decode to one
    printable ASCII character encoding back to that id alone, sent as their text, and refused unless the whole text
    encodes back to the prompt (a tokenizer that merges such characters cannot be checked this way)."""

    def __init__(self, tokenizer, vocab, avoid):
        self.tokenizer = tokenizer
        self.alphabet = [t for t in range(vocab) if t not in avoid and self.single(t)]
        if not self.alphabet:
            raise R.UserError("the checkpoint's tokenizer has no id whose text is one printable character")

    def single(self, t):
        text = self.tokenizer.decode([t])
        return len(text) == 1 and " " <= text <= "~" and self.tokenizer.encode(text, add_special_tokens=False).ids == [t]

    def text(self, name, prompt):
        text = self.tokenizer.decode(prompt)
        if self.tokenizer.encode(text, add_special_tokens=False).ids != list(prompt):
            raise R.UserError(f"scenario {name}: its prompt does not encode back to its ids as text")
        return text

    def stop_texts(self, stop_ids):
        return tuple(self.tokenizer.decode([s]) for s in stop_ids if self.single(s))


def load_scenarios(path=SCENARIOS):
    data = json.loads(Path(path).read_text())
    if data.get("format") != "qwen35-server-scenarios" or data.get("version") != 1:
        raise R.UserError(f"{path}: not a version 1 server scenarios file")
    return data["scenarios"]


def expand(scenario, spec_model, context, draft, text_prompts=None, tree=None):
    """A scenario's requests, each repeated `count` times (a part with "vary": its seed moved by the copy's index)
    -> [(request dict, ServerRequest)]. With `text_prompts` (TextPrompts) the prompts are drawn from its alphabet and
    carry their text and the stop ids' texts. tree: a draft tree budget for every request whose drafter drafts trees
    (reference.TREE_DRAFTERS)."""
    cfg, out = spec_model.cfg, []
    alphabet = text_prompts.alphabet if text_prompts else None
    for spec in scenario["requests"]:
        for copy in range(spec.get("count", 1)):
            parts = [dict(p, seed=p["seed"] + copy) if p.get("vary") else p for p in spec["prompt"]]
            prompt = build_prompt(parts, cfg.vocab_size, set(cfg.eos_token_id), alphabet)
            stop = tuple(dict.fromkeys([*spec.get("stop_token_ids", ()),
                                        *(prompt[i] for i in spec.get("stop_prompt_positions", ())),
                                        *spec_model.greedy_tokens(prompt, spec.get("stop_at_spec_tokens", ()))]))
            room = min(context, cfg.max_position_embeddings) - len(prompt)
            max_tokens = room if spec["max_tokens"] == "context" else min(spec["max_tokens"], room)
            drafter = spec.get("draft") if draft in (None, "as-scenario") else draft
            text = {} if text_prompts is None else {"prompt_text": text_prompts.text(scenario["name"], prompt),
                                                    "stop_texts": text_prompts.stop_texts(stop)}
            out.append((spec, ServerRequest(prompt, max_tokens, spec.get("temperature", 0.0), spec.get("top_k", 0),
                                            spec.get("top_p", 1.0), spec.get("seed", 0) + copy, stop,
                                            spec.get("ignore_eos", False), spec.get("stream", False), drafter,
                                            spec.get("draft_len"), tree if drafter in R.TREE_DRAFTERS else None,
                                            cache_prompt=spec.get("cache_prompt"), **text)))
    return out


# ----------------------------------------------------------------------------------------------------------------
# The client: one thread per request in flight

class Answer:
    """What came back for one request."""

    def __init__(self):
        self.ids, self.logprobs, self.text, self.finish = [], [], "", None
        self.error, self.cancelled, self.done = None, False, threading.Event()


def post(url, dialect, r, model, cancel_after, timeout, answer, tokenizer):
    """Send one request; fill `answer` (ids, finish, error) as the response comes."""
    parts = urllib.parse.urlsplit(url)
    stream = r.stream and dialect.streams_ids
    body = json.dumps(dialect.body(r._replace(stream=stream), model)).encode()
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("POST", (parts.path.rstrip("/") + dialect.path), body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            answer.error = f"HTTP {resp.status}: {resp.read(4096).decode(errors='replace')}"
            return
        if not stream:
            add(answer, dialect.chunk(json.loads(resp.read(MAX_RESPONSE_BYTES))))
        else:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                add(answer, dialect.chunk(json.loads(data)))
                if cancel_after is not None and len(answer.ids) >= cancel_after and answer.finish is None:
                    answer.cancelled = True      # hang up mid-stream: the server must cancel, the others go on
                    break
        if not dialect.ids:
            answer.ids = retokenised(answer.text, tokenizer)
    except (OSError, http.client.HTTPException, ValueError) as e:
        answer.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        answer.done.set()


def add(answer, chunk):
    answer.ids += chunk.ids or []
    answer.logprobs += chunk.logprobs or []
    answer.text += chunk.text or ""
    answer.finish = chunk.finish or answer.finish


def retokenised(text, tokenizer):
    if tokenizer is None:
        raise ValueError("the text dialect needs the checkpoint's tokenizer.json")
    ids = tokenizer.encode(text).ids
    if tokenizer.decode(ids) != text:
        raise ValueError(f"the completion text does not round-trip through the tokenizer: {text[:60]!r}")
    return ids


def send_scenario(url, dialect, model, requests, concurrency, timeout, tokenizer):
    """Send a scenario's requests: each at its "at" time (seconds from the start), after its "after" request
    finished, at most `concurrency` in flight -> [Answer] in order."""
    answers = [Answer() for _ in requests]
    start, in_flight = time.monotonic(), threading.BoundedSemaphore(concurrency)

    def one(index):
        spec, r = requests[index]
        if "after" in spec:
            answers[spec["after"]].done.wait(timeout)
        delay = start + spec.get("at", 0.0) - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        with in_flight:      # waiters released together still go out at most `concurrency` at a time
            post(url, dialect, r, model, spec.get("cancel_after"), timeout, answers[index], tokenizer)
    # a request waiting for an earlier one must not hold a worker the earlier one needs: waiters get extra workers
    waiting = sum("after" in spec for spec, _ in requests)
    with ThreadPoolExecutor(max_workers=min(concurrency, len(requests)) + waiting) as pool:
        list(pool.map(one, range(len(requests))))
    return answers


# ----------------------------------------------------------------------------------------------------------------
# The spec's side: teacher forcing and the rules

class Spec:
    """reference.py's forward over prompt + returned tokens, once per distinct sequence."""

    def __init__(self, model_dir):
        self.cfg, self.params = R.load_model(model_dir)
        self.memo, self.lock = {}, threading.Lock()

    def greedy_tokens(self, prompt, positions):
        """The spec's greedy continuation of `prompt` at these positions (0: the first generated token)."""
        if not positions:
            return []
        logits, _, state, _ = R.forward(self.params, self.cfg, list(prompt), R.empty_state(self.cfg))
        tokens = [int(np.argmax(logits[-1]))]
        while len(tokens) <= max(positions):
            logits, _, state, _ = R.forward(self.params, self.cfg, [tokens[-1]], state)
            tokens.append(int(np.argmax(logits[-1])))
        return [tokens[i] for i in positions]

    def logits(self, sequence):
        """(len(sequence), V) float32 logits: row i predicts sequence[i + 1]."""
        key = tuple(sequence)
        with self.lock:
            if key in self.memo:
                return self.memo[key]
        logits = R.forward(self.params, self.cfg, list(sequence), R.empty_state(self.cfg))[0]
        with self.lock:
            self.memo[key] = logits
        return logits


def log_softmax(z):
    z = z.astype(np.float64) - z.max()
    return z - np.log(np.exp(z).sum())


def failure(rule, scenario, index, r, position, sequence, z, token, detail):
    P = len(r.prompt)
    top = np.argsort(-z, kind="stable")[:TOP] if z is not None else []
    return {"scenario": scenario["name"], "request": index, "rule": rule, "position": position,
            "prefix_tail": sequence[max(0, P + position - TAIL):P + position],
            "spec_top": [[int(t), round(float(z[t]), 5)] for t in top],
            "server_token": token, "server_token_logit": None if z is None or token is None else
            round(float(z[token]), 5), "detail": detail}


def check_answer(spec, scenario, index, r, answer, dialect, margin, logprob_atol):
    """The rules for one request -> the first failure (a dict) or None."""
    if answer.error is not None:
        return failure("http", scenario, index, r, 0, list(r.prompt), None, None, answer.error)
    cfg, ids, P = spec.cfg, answer.ids, len(r.prompt)
    stop = set(r.stop_token_ids) | (set() if r.ignore_eos else set(cfg.eos_token_id))
    sequence = list(r.prompt) + ids
    if any(not 0 <= t < cfg.vocab_size for t in ids):
        return failure("vocabulary", scenario, index, r, 0, sequence, None, None, f"ids outside [0, {cfg.vocab_size})")
    if len(ids) > r.max_tokens:
        return failure("max_tokens", scenario, index, r, r.max_tokens, sequence, None, ids[r.max_tokens],
                       f"{len(ids)} tokens for max_tokens {r.max_tokens}")
    z_all = spec.logits(sequence)[P - 1:]
    for j, t in enumerate(ids):
        if t in stop and j < len(ids) - 1:
            return failure("stop", scenario, index, r, j + 1, sequence, z_all[j + 1], ids[j + 1],
                           f"tokens after stop id {t} at position {j}")
        z = z_all[j]
        if r.temperature == 0:
            gap = float(z.max() - z[t])
            if gap > margin:
                return failure("greedy", scenario, index, r, j, sequence, z, t,
                               f"the server's token is {gap:.4g} below the spec's argmax (near-tie margin {margin})")
        else:
            sampling = R.Sampling(r.temperature, r.top_k, r.top_p)
            if stats.spec_probabilities(z, sampling)[t] == 0 and not stats.near_support(z, t, sampling, margin):
                return failure("support", scenario, index, r, j, sequence, z, t,
                               f"the spec gives the server's token no chance at {sampling} (its logit "
                               f"{float(z[t]):.4g}, within no near-tie margin {margin} of the kept tokens)")
        if j < len(answer.logprobs) and answer.logprobs[j] is not None:
            want = float(log_softmax(z)[t])
            if abs(answer.logprobs[j] - want) > logprob_atol:
                return failure("logprob", scenario, index, r, j, sequence, z, t,
                               f"logprob {answer.logprobs[j]:.5g}, the spec's {want:.5g} (tolerance {logprob_atol})")
    if answer.cancelled:
        return None
    ended_by_stop = bool(ids) and ids[-1] in stop
    if answer.finish == "stop" and not ended_by_stop:
        z = z_all[len(ids)]
        if dialect.includes_stop or r.temperature != 0 or max(float(z.max() - z[s]) for s in stop) > margin:
            return failure("stop", scenario, index, r, len(ids), sequence, z, None,
                           "finish_reason stop, but no stop id ended the tokens")
    if not ended_by_stop and answer.finish != "stop" and len(ids) != r.max_tokens:
        return failure("max_tokens", scenario, index, r, len(ids), sequence, z_all[len(ids)], None,
                       f"{len(ids)} tokens, neither max_tokens {r.max_tokens} nor a stop (finish_reason "
                       f"{answer.finish})")
    return None


# ----------------------------------------------------------------------------------------------------------------
# The command

def check_server(url, model_dir, scenarios_regex=None, concurrency=64, report=None, dialect="jax_impl",
                 precision="float32", draft=None, model_name=None, timeout=600.0, scenarios_path=SCENARIOS,
                 workers=2, context=None, log=print, tree=None):
    """Run the scenarios against the server at `url` -> (results, exit code: 0 all pass, 1 failures). tree: the jax_impl
    dialect's draft tree budget for every request that drafts with ngram or mtp."""
    if dialect not in DIALECTS:
        raise R.UserError(f"--dialect {dialect}: expected one of {', '.join(DIALECTS)}")
    if tree is not None:
        R.parse_tree_budget(tree, "--tree")
        if dialect != "jax_impl":
            raise R.UserError(f"--tree: the {dialect} dialect takes no draft tree per request (jax_impl's does)")
    if precision not in RULES["greedy_margin"]:
        raise R.UserError(f"--precision {precision}: expected one of {', '.join(RULES['greedy_margin'])}")
    if not 1 <= concurrency <= 1024:
        raise R.UserError(f"--concurrency {concurrency}: must be in [1, 1024]")
    d = DIALECTS[dialect]
    spec = Spec(model_dir)
    tokenizer = R.load_tokenizer(model_dir) if not (d.ids and d.prompt_ids) else None
    if tokenizer is None and not d.prompt_ids:
        raise R.UserError(f"--dialect {dialect} takes text prompts: {model_dir} has no tokenizer.json")
    text_prompts = None if d.prompt_ids else TextPrompts(tokenizer, spec.cfg.vocab_size, set(spec.cfg.eos_token_id))
    margin, logprob_atol = RULES["greedy_margin"][precision], RULES["logprob_atol"][precision]
    chosen = [s for s in load_scenarios(scenarios_path) if not scenarios_regex or re.search(scenarios_regex, s["name"])]
    if not chosen:
        raise R.UserError(f"--scenarios {scenarios_regex}: no scenario matches")
    context = context or spec.cfg.max_position_embeddings
    model_name = model_name or Path(model_dir).name
    results = []
    with ThreadPoolExecutor(max_workers=workers) as checkers:
        for scenario in chosen:
            requests = expand(scenario, spec, context, draft, text_prompts, tree)
            start = time.monotonic()
            answers = send_scenario(url, d, model_name, requests, concurrency, timeout, tokenizer)
            if all(a.error and a.error.startswith(("ConnectionRefusedError", "TimeoutError")) for a in answers):
                raise ServerError(f"{url}: {answers[0].error}")
            served = time.monotonic() - start
            failures = [f for f in checkers.map(lambda i: check_answer(spec, scenario, i, requests[i][1], answers[i],
                                                                       d, margin, logprob_atol),
                                                range(len(requests))) if f]
            results.append({"scenario": scenario["name"], "requests": len(requests),
                            "tokens": sum(len(a.ids) for a in answers), "seconds": round(served, 2)})
            if scenario.get("distribution"):
                results[-1]["statistics"], failed = stats.check(spec, scenario, requests, answers, margin)
                failures += failed
            results[-1].update(status="FAIL" if failures else "PASS", failures=failures)
            log(line_of(results[-1]))
    summary = {"url": url, "model": str(model_dir), "dialect": dialect, "precision": precision, "draft": draft,
               "tree": tree, "margin": margin, "passed": all(r["status"] == "PASS" for r in results), "scenarios": results}
    if report:
        Path(report).write_text(json.dumps(summary, indent=1) + "\n")
    log(f"{sum(r['status'] == 'PASS' for r in results)}/{len(results)} scenarios pass")
    return summary, 0 if summary["passed"] else 1


def line_of(result):
    head = f"{result['status']} {result['scenario']}: {result['requests']} requests, {result['tokens']} tokens"
    tests = [f"{t['test']} chi-square {t['statistic']:.4g} (critical {t['critical']:.4g}, {t['draws']} draws)"
             for t in result.get("statistics", ())]
    if tests:
        head += f" [{'; '.join(tests)}]"
    if not result["failures"]:
        return head
    f = result["failures"][0]
    if f["rule"] == "distribution":
        return f"{head}; {len(result['failures'])} failing, first: {f['detail']}" + (
            f"; prefix ...{f['prefix_tail']}" if f["prefix_tail"] else "")
    top = ", ".join(f"{t} ({z})" for t, z in f["spec_top"])
    return (f"{head}; {len(result['failures'])} failing, first: request {f['request']} {f['rule']} at position "
            f"{f['position']}: {f['detail']}; prefix ...{f['prefix_tail']}, server token {f['server_token']}, spec "
            f"top {top}")
