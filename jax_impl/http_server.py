"""python -m jax_impl.http_server: an OpenAI-compatible HTTP front end over jax_impl.Server (its own scheduler:
continuous batching, the prefix cache, a drafter per request).

    python -m jax_impl.http_server --model DIR --port P [--host 127.0.0.1] [--slots 16] [--context N]
        [--dtype float32] [--rollback replay] [--steps-per-sync 16] [--cache-bytes N] [--matvec auto]
        [--dflash DIR]

It prints one line when it accepts requests: `jax_impl.http_server: serving MODEL on http://HOST:PORT` (--port 0
picks a free port; the line names it). Endpoints:

    GET  /health            {"status": "ok"}
    GET  /v1/models         the one model, named by its directory
    POST /v1/completions    one completion, streamed (server-sent events) or not

/v1/completions takes the OpenAI fields prompt (text, or a list of token ids), max_tokens (default 16), temperature
(default 1.0; 0 is greedy), top_p, seed, stream, and these extensions: top_k, stop_token_ids (ids that end the
completion besides the checkpoint's EOS ids; ignore_eos: true drops the EOS ids), draft (none, ngram, mtp; dflash
with --dflash DIR), draft_len, cache_prompt (default true: the prompt leaves a prefix-cache entry that later prompts
beginning with it restore), tree ("NODES[:DEPTH[:BRANCH]]", --tree's form: each round verifies a draft tree of draft
ngram or mtp within that budget, at most 32 nodes; draft_len is then unused).
logprobs: 0 returns each generated token's log-probability under the model's raw logits (before temperature, top-k
and top-p, as vLLM's default) in the choice's OpenAI `logprobs` ({"tokens", "token_logprobs", "top_logprobs": null,
"text_offset"}); no alternatives, so logprobs > 0 is refused. Unsupported OpenAI fields (n > 1, best_of, echo,
logprobs > 0, stop strings, suffix) are refused, not ignored.
Each choice carries `token_ids`, the generated ids (the stop id that ended it included), as vLLM's
return_token_ids does, beside `text`; the response's `prompt_token_ids` are the prompt's. A bad request gets a 4xx
with {"error": {"message", "type"}}. A client that disconnects has its request cancelled in the Server (its slot
freed); the other requests go on.

Threads: the aiohttp event loop takes requests; one engine thread owns the Server (submit, cancel, step) and hands
each request's tokens back to the loop as the steps commit them.
"""

import asyncio
import json
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from . import matvec, reference
from .weights import DTYPES, load

UserError = reference.UserError
MAX_BODY_BYTES = 2**24          # a request body; a prompt of ids at ~8 bytes each: 2M tokens
REFUSED = {"n": lambda v: v not in (None, 1), "best_of": lambda v: v not in (None, 1), "echo": bool,
           "logprobs": lambda v: v is not None and (isinstance(v, bool) or v != 0),
           "stop": lambda v: v not in (None, [], ""), "suffix": lambda v: v not in (None, "")}
FIELD_OF = {"max_new_tokens": "max_tokens", "stop": "stop_token_ids"}   # a setting -> its OpenAI field, where named apart
SETTINGS = {FIELD_OF.get(name, name): name for name in reference.REQUEST_SETTINGS if name != "rollback"}  # the server's
DEFAULTS = {"max_new_tokens": 16, "temperature": 1.0}                    # OpenAI's, where they differ from ours
KNOWN = {"model", "prompt", *SETTINGS, "stream", "stop_token_ids", "ignore_eos", "cache_prompt", "tree", "user",
         "return_token_ids", "stream_options", "presence_penalty", "frequency_penalty", *REFUSED}


def field_of(name):
    return FIELD_OF.get(name, name)


def parse_args(argv):
    ap = reference.OneLineParser(prog="python -m jax_impl.http_server", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(reference.DEFAULT_MODEL), help="checkpoint directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True, help="0: a free port (the ready line names it)")
    ap.add_argument("--slots", type=int, default=16, help="requests decoded at once (B)")
    ap.add_argument("--context", type=int, help="tokens per request, prompt and generated (default: the "
                    "checkpoint's max_position_embeddings, at most 4096)")
    ap.add_argument("--rollback", choices=reference.ROLLBACK_STRATEGIES, default="replay")
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--matvec", choices=matvec.MODES, default=matvec.mode)
    ap.add_argument("--steps-per-sync", type=int, default=16, help="device steps between reads of the results")
    ap.add_argument("--cache-bytes", type=int, default=2**30, help="the prefix cache's size")
    ap.add_argument("--max-draft-len", type=int, help="pin every step's K (requests with longer drafts are refused): "
                    "with --step-width and --all-features, one step program compiled for the server's life")
    ap.add_argument("--step-width", type=int, help="pin every step's T (prompts prefilled in chunks of it); needs "
                    "--max-draft-len")
    ap.add_argument("--all-features", action="store_true", help="compile sampling (top-k, top-p), log-probabilities, "
                    "the MTP head and the DFlash drafter into every step")
    ap.add_argument("--dflash", metavar="DIR", help="a DFlash drafter's checkpoint for the target: requests with "
                    "draft \"dflash\" draft with it (argmax drafts, as --draft dflash:DIR)")
    ap.add_argument("--inject-bug", metavar="NAME", default=os.environ.get("JAX_IMPL_HTTP_BUG"),
                    help="serve with a deliberate scheduler bug (jax_impl/injected_bugs.py; the kit's tests show "
                         "check-server catches each); default $JAX_IMPL_HTTP_BUG")
    args = ap.parse_args(argv)
    for flag, value, low, high in (("--port", args.port, 0, 65535), ("--steps-per-sync", args.steps_per_sync, 1,
                                   2**20), ("--cache-bytes", args.cache_bytes, 0, 2**48)):
        if not low <= value <= high:
            raise UserError(f"{flag} {value}: must be in [{low}, {high}]")
    return args


class BadRequest(Exception):
    """A request the server refuses: HTTP 400 with this message."""


def token_ids(value, name, vocab):
    if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise BadRequest(f"{name}: expected a list of token ids")
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return [int(t) for t in value]


def completion_request(body, cfg, tokenizer, context):
    """A /v1/completions body -> (Server.submit's keyword arguments, stream). Raises BadRequest: also a prompt and
    max_tokens beyond the server's context (as vLLM refuses them, rather than cutting max_tokens)."""
    if not isinstance(body, dict):
        raise BadRequest("expected a JSON object")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}")
    for name, refused in REFUSED.items():
        if refused(body.get(name)):
            raise BadRequest(f"{name}: not supported by this server")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest("prompt: the checkpoint has no tokenizer.json, send token ids")
        prompt = tokenizer.encode(prompt).ids
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        raise BadRequest("prompt: one prompt per request")
    elif prompt is None:
        raise BadRequest("prompt: required")
    prompt = token_ids(prompt, "prompt", cfg.vocab_size)
    if not prompt:
        raise BadRequest("prompt: empty")
    stop = token_ids(body.get("stop_token_ids") or [], "stop_token_ids", cfg.vocab_size)
    if not isinstance(body.get("ignore_eos", False), bool):
        raise BadRequest("ignore_eos: expected true or false")
    eos = [] if body.get("ignore_eos") else list(cfg.eos_token_id)
    for name in ("stream", "cache_prompt"):
        if not isinstance(body.get(name, False), bool):
            raise BadRequest(f"{name}: expected true or false")
    try:
        settings = {name: DEFAULTS.get(name, reference.REQUEST_SETTINGS[name].default) if body.get(field) is None
                    else reference.json_setting(name, body[field], field) for field, name in SETTINGS.items()}
        from .spec_decode import ENGINE_DRAFTERS  # not at the top: --inject-bug replaces spec_decode before its import
        reference.check_settings(settings, field_of, ENGINE_DRAFTERS)
        tree = None if body.get("tree") is None else reference.parse_tree_budget(body["tree"], "tree")
    except UserError as e:
        raise BadRequest(str(e)) from None
    sampling = reference.Sampling(*(settings.pop(name) for name in reference.Sampling._fields))
    kwargs = dict(prompt=prompt, **settings, sampling=sampling, stop=tuple(dict.fromkeys(eos + stop)),
                  cache_prompt=body.get("cache_prompt", True), logprobs=body.get("logprobs") is not None, tree=tree)
    if len(prompt) + kwargs["max_new_tokens"] > context:
        raise BadRequest(f"the prompt ({len(prompt)} tokens) and max_tokens {kwargs['max_new_tokens']} exceed the "
                         f"server's context of {context} tokens")
    return kwargs, bool(body.get("stream", False))


class Engine:
    """The thread that owns the Server. submit/cancel are called from the event loop; tokens come back through each
    request's `deliver(tokens, done, logprobs)`, called in the engine thread."""

    def __init__(self, server):
        self.server, self.inbox, self.sinks = server, queue.Queue(), {}
        self.failure = None
        threading.Thread(target=self.loop, name="jax_impl-engine", daemon=True).start()

    def submit(self, kwargs, deliver):
        """-> a Future of the request's id (or of the UserError that refused it)."""
        future = Future()
        self.inbox.put(("submit", kwargs, deliver, future))
        return future

    def cancel(self, request_id):
        self.inbox.put(("cancel", request_id, None, None))

    def busy(self):
        s = self.server
        return bool(s.waiting or any(s.live) or s.finished)

    def take(self, message):
        verb, arg, deliver, future = message
        if verb == "cancel":
            self.server.cancel(arg)
            self.sinks.pop(arg, None)
            self.server.results.pop(arg, None)
            return
        try:
            request_id = self.server.submit(**arg)
        except UserError as e:
            future.set_exception(e)
            return
        self.sinks[request_id] = deliver
        future.set_result(request_id)

    def loop(self):
        while True:
            try:
                self.take(self.inbox.get(block=not self.busy()))
                while True:
                    self.take(self.inbox.get_nowait())
            except queue.Empty:
                pass
            try:
                events = self.server.step()
            except Exception as e:  # a fault of the engine itself: every open request hears of it
                self.failure = f"{type(e).__name__}: {e}"
                for deliver in self.sinks.values():
                    deliver(None, True, None)
                self.sinks.clear()
                raise
            for event in events:
                deliver = self.sinks.get(event.request)
                if event.done:
                    self.sinks.pop(event.request, None)
                    self.server.results.pop(event.request, None)  # the tokens went out with the events
                if deliver is not None:
                    deliver(event.tokens, event.done, event.logprobs)


def error_response(web, status, message, kind="invalid_request_error"):
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


def make_app(engine, cfg, tokenizer, model_name):
    from aiohttp import web

    def text_of(tokens):
        return tokenizer.decode(tokens) if tokenizer else ""

    def finish_reason(tokens, stop):
        return "stop" if tokens and tokens[-1] in stop else "length"

    def logprobs_of(tokens, logprobs, offset):
        """OpenAI's completion logprobs for these tokens (text offsets from `offset`), or None if not asked for."""
        if logprobs is None:
            return None
        pieces = [text_of([t]) if tokenizer else f"token_id:{t}" for t in tokens]
        offsets = [offset + sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
        return {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}

    async def health(request):
        return web.json_response({"status": "ok" if engine.failure is None else engine.failure})

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": model_name, "object": "model",
                                                              "owned_by": "jax_impl"}]})

    async def completions(request):
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as e:
            return error_response(web, 400, f"the body is not JSON ({e})")
        try:
            kwargs, stream = completion_request(body, cfg, tokenizer, engine.server.context)
        except BadRequest as e:
            return error_response(web, 400, str(e))
        if engine.failure is not None:
            return error_response(web, 503, f"the engine failed: {engine.failure}", "server_error")
        loop, chunks = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(tokens, done, logprobs):  # engine thread -> event loop
            loop.call_soon_threadsafe(chunks.put_nowait, (tokens, done, logprobs))
        try:
            request_id = await asyncio.wrap_future(engine.submit(kwargs, deliver))
        except UserError as e:
            return error_response(web, 400, str(e))
        name, created, stop = f"cmpl-{request_id}", int(time.time()), set(kwargs["stop"])
        head = {"id": name, "object": "text_completion", "created": created, "model": model_name}
        finished, tokens, logprobs = False, [], [] if kwargs["logprobs"] else None
        try:
            if not stream:
                while not finished:
                    new, finished, new_logprobs = await chunks.get()
                    if new is None:
                        return error_response(web, 500, f"the engine failed: {engine.failure}", "server_error")
                    tokens += new
                    if logprobs is not None:
                        logprobs += new_logprobs or []
                choice = {"index": 0, "text": text_of(tokens), "token_ids": tokens,
                          "logprobs": logprobs_of(tokens, logprobs, 0), "finish_reason": finish_reason(tokens, stop)}
                usage = {"prompt_tokens": len(kwargs["prompt"]), "completion_tokens": len(tokens),
                         "total_tokens": len(kwargs["prompt"]) + len(tokens)}
                return web.json_response({**head, "choices": [choice], "prompt_token_ids": kwargs["prompt"],
                                          "usage": usage})
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            sent_text = ""
            while not finished:
                new, finished, new_logprobs = await chunks.get()
                if new is None:
                    break
                tokens += new
                text = text_of(tokens)  # whole-sequence decoding, so that multi-token characters come out whole
                delta, sent_text = text[len(sent_text):] if text.startswith(sent_text) else text, text
                choice = {"index": 0, "text": delta, "token_ids": new,
                          "logprobs": logprobs_of(new, None if logprobs is None else new_logprobs or [],
                                                  len(sent_text) - len(delta)),
                          "finish_reason": finish_reason(tokens, stop) if finished else None}
                await response.write(f"data: {json.dumps({**head, 'choices': [choice]})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            if not finished:  # the client went away (or the write failed): free its slot
                engine.cancel(request_id)

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


def serve(args):
    try:
        from aiohttp import web
    except ModuleNotFoundError as e:
        raise reference.missing_extra(e, "jax", "python -m jax_impl.http_server") from None
    from .injected_bugs import server_class  # before spec_decode, batch and scheduler are imported: it may mutate them
    server_class = server_class(args.inject_bug)
    from . import batch
    matvec.set_mode(args.matvec)
    cfg, params = load(args.model, args.dtype)
    tokenizer = reference.load_tokenizer(args.model)
    features = batch.Features(True, True, True, params.get("mtp") is not None, True,
                              args.dflash is not None) if args.all_features else None
    server = server_class(params, cfg, args.slots, args.context, args.rollback,
                          args.steps_per_sync, cache_bytes=args.cache_bytes, max_draft_len=args.max_draft_len,
                          features=features, step_width=args.step_width, dflash=args.dflash)
    engine = Engine(server)
    app = make_app(engine, cfg, tokenizer, Path(args.model).name)

    async def start():
        runner = web.AppRunner(app, handler_cancellation=True)  # a client gone mid-request cancels its handler
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        try:
            await site.start()
        except OSError as e:
            raise UserError(f"--host {args.host} --port {args.port}: {e.strerror}") from None
        port = site._server.sockets[0].getsockname()[1]
        print(f"jax_impl.http_server: serving {Path(args.model).name} on http://{args.host}:{port}", flush=True)
        await asyncio.Event().wait()
    try:
        asyncio.run(start())
    except KeyboardInterrupt:
        pass


def main(argv=None):
    return reference.exit_code(lambda: serve(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
