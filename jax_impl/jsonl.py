"""python -m jax_impl.jsonl: many prompts at once through jax_impl's batched engine (scheduler.Server).

    python -m jax_impl.jsonl --requests REQUESTS.jsonl --out RESULTS.jsonl [--model DIR] [--slots 16]
        [--context N] [--rollback replay] [--dtype float32] [--devices N] [--matvec auto] [--steps-per-sync 16]
        [--dflash DIR]

Each line of the requests file is a JSON object: "prompt" (text) or "prompt_ids" (a list of ids), and any of "id"
(echoed back; default the line number, from 1), "max_new_tokens", "temperature", "top_k", "top_p", "seed", "draft"
(none, ngram, mtp; dflash with --dflash DIR), "draft_len", "stop" (a list of ids; default the checkpoint's EOS ids),
"cache_prompt" (true: later prompts that begin with this one restore its state instead of prefilling it), "tree"
("NODES[:DEPTH[:BRANCH]]", --tree's form: each round verifies a draft tree of draft ngram or mtp). Defaults
and ranges are the command line's (python -m jax_impl --help). Each result is one line, written as its request
finishes: {"id", "prompt_ids", "tokens", "text", "stats"}, its tokens those of `python -m jax_impl --json` run alone
with the same settings.
--context (default: what the longest request needs) is the most tokens a request holds; every slot's buffers are
allocated for it at the start. A summary goes to stderr. Bad input: one line naming it, exit status 2.
(python -m jax_impl.serve, its former name, runs it too.)
"""

import json
import os
import sys
import time

from . import matvec, reference
from .scheduler import Request, Server, check_request
from .sharding import make_mesh
from .weights import DTYPES, load

UserError = reference.UserError

SETTINGS = [name for name in reference.REQUEST_SETTINGS if name != "rollback"]  # the rollback strategy: --rollback
FIELDS = ("id", "prompt", "prompt_ids", *SETTINGS, "stop", "cache_prompt", "tree")


def parse_args(argv):
    ap = reference.OneLineParser(prog="python -m jax_impl.jsonl", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", required=True, metavar="FILE.jsonl", help="one JSON request per line")
    ap.add_argument("--out", required=True, metavar="FILE.jsonl", help="one JSON result per line")
    ap.add_argument("--model", default=str(reference.DEFAULT_MODEL), help="checkpoint directory")
    ap.add_argument("--slots", type=int, default=16, help="requests decoded at once (B)")
    ap.add_argument("--context", type=int, help="tokens per request, prompt and generated (default: the longest's)")
    ap.add_argument("--rollback", choices=reference.ROLLBACK_STRATEGIES, default="replay")
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--devices", type=int, default=1, help="tensor-parallel devices (1: no mesh)")
    ap.add_argument("--matvec", choices=matvec.MODES, default=matvec.mode)
    ap.add_argument("--steps-per-sync", type=int, default=16, help="device steps between reads of the results")
    ap.add_argument("--dflash", metavar="DIR", help="a DFlash drafter's checkpoint for the target: requests with "
                    "draft \"dflash\" draft with it (argmax drafts, as --draft dflash:DIR)")
    args = ap.parse_args(argv)
    for flag, value, low, high in (("--slots", args.slots, 1, 4096), ("--steps-per-sync", args.steps_per_sync, 1, 2**20)):
        if not low <= value <= high:
            raise UserError(f"{flag} {value}: must be in [{low}, {high}]")
    return args


def request_of(fields, tokenizer):
    """One line's object -> Request, its settings typed (reference.json_setting); scheduler.check_request checks them
    as the command lines do, named by their fields."""
    if not isinstance(fields, dict):
        raise UserError("expected a JSON object")
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise UserError(f"unknown field {unknown[0]!r} (known: {', '.join(sorted(FIELDS))})")
    settings = {name: reference.json_setting(name, fields[name]) if name in fields else
                reference.REQUEST_SETTINGS[name].default for name in SETTINGS}
    if ("prompt" in fields) == ("prompt_ids" in fields):
        raise UserError("give exactly one of prompt and prompt_ids")
    if "prompt" in fields:
        text = fields["prompt"]
        if not isinstance(text, str):
            raise UserError("prompt: expected a string")
        reference.check_prompt_text(text, "prompt")
        if tokenizer is None:
            raise UserError("prompt: the checkpoint has no tokenizer.json, use prompt_ids")
        prompt = tokenizer.encode(text).ids
    else:
        prompt = token_ids(fields["prompt_ids"], "prompt_ids")
    stop = fields.get("stop")
    if stop is not None:
        stop = token_ids(stop, "stop")
    if not isinstance(fields.get("cache_prompt", False), bool):
        raise UserError("cache_prompt: expected true or false")
    settings["sampling"] = reference.Sampling(*(settings.pop(name) for name in reference.Sampling._fields))
    tree = None if fields.get("tree") is None else reference.parse_tree_budget(fields["tree"], "tree")
    return Request(tuple(prompt), **settings, stop=None if stop is None else tuple(stop),
                   cache_prompt=fields.get("cache_prompt", False), tree=tree)


def token_ids(value, name):
    if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise UserError(f"{name}: expected a list of token ids")
    return value


def read_requests(path, cfg, params, tokenizer, loaded=()):
    """[(id, Request, token limit)], each checked; an error names the line."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > reference.MAX_JSON_BYTES:
                raise UserError(f"{path}: {size} bytes, more than the {reference.MAX_JSON_BYTES} it may have")
            lines = f.read().split(b"\n")
    except OSError as e:
        raise UserError(f"--requests {path}: {e.strerror}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            try:
                fields = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise UserError(f"not JSON ({e})") from None
            r = request_of(fields, tokenizer)
            requests.append((fields.get("id", number), r, check_request(cfg, params, r, loaded=loaded)))
        except UserError as e:
            raise UserError(f"{path} line {number}: {e}") from None
    if not requests:
        raise UserError(f"{path}: no requests")
    return requests


def run(args):
    matvec.set_mode(args.matvec)
    mesh = make_mesh(args.devices) if args.devices != 1 else None
    cfg, params = load(args.model, args.dtype, mesh)
    tokenizer = reference.load_tokenizer(args.model)
    requests = read_requests(args.requests, cfg, params, tokenizer, () if args.dflash is None else ("dflash",))
    needed = max(len(r.prompt) + limit for _, r, limit in requests)
    context = needed if args.context is None else args.context
    if not needed <= context <= cfg.max_position_embeddings:
        raise UserError(f"--context {context}: must be in [{needed}, {cfg.max_position_embeddings}] (the longest "
                        "request's prompt and new tokens, the checkpoint's max_position_embeddings)")
    try:
        out = open(args.out, "w", encoding="utf-8")
    except OSError as e:
        raise UserError(f"--out {args.out}: {e.strerror}") from None
    start = time.perf_counter()
    server = Server(params, cfg, args.slots, context, args.rollback, args.steps_per_sync, mesh=mesh,
                    dflash=args.dflash)
    ids = {server.submit(**r._asdict()): (request_id, r) for request_id, r, _ in requests}
    generated = 0
    with out:
        for event in server.run():
            if not event.done:
                continue
            request_id, r = ids[event.request]
            tokens, stats = server.result(event.request)
            generated += len(tokens)
            text = tokenizer.decode(tokens) if tokenizer else ""
            out.write(json.dumps({"id": request_id, "prompt_ids": list(r.prompt), "tokens": tokens, "text": text,
                                  "stats": stats}) + "\n")
            out.flush()
    seconds = time.perf_counter() - start
    print(f"{len(requests)} requests, {generated} tokens in {seconds:.2f} s ({generated / seconds:.1f} tok/s, "
          f"compilation included); {args.slots} slots, {server.steps} steps, {server.syncs} host syncs, "
          f"{server.compilations} step programs compiled", file=sys.stderr)


def main(argv=None):
    return reference.exit_code(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
