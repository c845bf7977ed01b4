"""How check-server talks to a server: one Dialect per API (INTERPRETING.md, "Checking a running server").

A dialect turns a scenario's request (ServerRequest) into an HTTP POST body and reads the server's answer, whole or
one server-sent event at a time, into a Chunk. Token ids, never text, where the API can return them: a dialect whose
`ids` is False gets text back, which check-server re-tokenises and accepts only where it round-trips (decode(encode
(text)) == text); its failures may then be tokenisation's, and the report says which dialect was used.

To add a server: subclass Dialect, set name, path, ids; write body() and chunk(); add it to DIALECTS.
"""

from typing import NamedTuple


class ServerRequest(NamedTuple):
    """One request as check-server sends it (a scenario's request with its prompt built)."""
    prompt: list                  # token ids
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple = ()    # besides EOS (unless ignore_eos)
    ignore_eos: bool = False
    stream: bool = False
    draft: str = None             # jax_impl's per-request drafter (none, ngram, mtp); others set it server-side
    draft_len: int = None
    tree: str = None              # jax_impl's per-request draft tree budget, "NODES[:DEPTH[:BRANCH]]" (ngram, mtp)
    prompt_text: str = None       # the prompt as text, for a dialect whose API takes no ids (prompt_ids False)
    stop_texts: tuple = ()        # the stop ids a text-only API can take: each id's text, which encodes to it alone
    cache_prompt: bool = None     # whether the prompt leaves a prefix-cache entry (None: the server's default)


class Chunk(NamedTuple):
    """What one response (or one streamed event) adds."""
    ids: list = None              # generated token ids, in order (None: the dialect returns text)
    text: str = None
    finish: str = None            # "stop" (a stop id or EOS ended it), "length" (max_tokens or the context), None
    logprobs: list = None         # the log-probability of each id in `ids`, where the server returns them


def sampling_fields(r):
    return {"temperature": r.temperature, "top_p": r.top_p, "seed": r.seed,
            **({"top_k": r.top_k} if r.top_k else {})}


def openai_chunk(payload, ids_of):
    choice = (payload.get("choices") or [{}])[0]
    logprobs = choice.get("logprobs") or {}
    finish = choice.get("finish_reason")
    return Chunk(ids_of(choice, logprobs), choice.get("text"), finish if finish in ("stop", "length") else None,
                 logprobs.get("token_logprobs"))


class Dialect:
    name = "?"
    path = "/v1/completions"
    ids = True                    # the API returns token ids
    prompt_ids = True             # the API takes the prompt as token ids (else as text: ServerRequest.prompt_text)
    streams_ids = True            # its streamed events carry what chunk() reads (else streams are read as whole answers)
    includes_stop = True          # a stop id that ends a completion is among the returned ids (else left out)

    def body(self, r, model):
        raise NotImplementedError

    def chunk(self, payload):
        raise NotImplementedError


class JaxImpl(Dialect):
    """jax_impl.http_server: OpenAI /v1/completions, ids in choices[].token_ids, each token's log-probability
    (logprobs 0: choices[].logprobs.token_logprobs, held to the spec's), the drafter per request."""
    name = "jax_impl"

    def body(self, r, model):
        body = {"model": model, "prompt": list(r.prompt), "max_tokens": r.max_tokens, "stream": r.stream,
                "stop_token_ids": list(r.stop_token_ids), "ignore_eos": r.ignore_eos, "logprobs": 0,
                **sampling_fields(r)}
        if r.draft is not None:
            body["draft"] = r.draft
        if r.draft_len is not None:
            body["draft_len"] = r.draft_len
        if r.tree is not None:
            body["tree"] = r.tree
        if r.cache_prompt is not None:
            body["cache_prompt"] = r.cache_prompt
        return body

    def chunk(self, payload):
        return openai_chunk(payload, lambda choice, logprobs: choice.get("token_ids"))


class VLLM(Dialect):
    """vLLM >= 0.10.2: OpenAI /v1/completions with return_token_ids (choices[].token_ids); drafting is the server's
    --speculative-config."""
    name = "vllm"

    def body(self, r, model):
        return {"model": model, "prompt": list(r.prompt), "max_tokens": r.max_tokens, "stream": r.stream,
                "stop_token_ids": list(r.stop_token_ids), "ignore_eos": r.ignore_eos, "return_token_ids": True,
                "skip_special_tokens": False, **sampling_fields(r)}

    def chunk(self, payload):
        return openai_chunk(payload, lambda choice, logprobs: choice.get("token_ids"))


class VLLMLogprobs(VLLM):
    """Older vLLM: the ids through logprobs=1 and return_tokens_as_token_ids ("token_id:123" tokens), the
    log-probabilities with them."""
    name = "vllm-logprobs"

    def body(self, r, model):
        body = super().body(r, model)
        del body["return_token_ids"]
        return {**body, "logprobs": 1, "return_tokens_as_token_ids": True}

    def chunk(self, payload):
        return openai_chunk(payload, lambda choice, logprobs: None if "tokens" not in logprobs else [
            int(t.rpartition(":")[2]) for t in logprobs["tokens"]])


class SGLang(Dialect):
    """SGLang's native /generate: input_ids in, the ids from meta_info.output_token_logprobs ([logprob, id, text]
    per token, with return_logprob); drafting is the server's --speculative-algorithm."""
    name = "sglang"
    path = "/generate"
    streams_ids = False           # its streamed meta_info is cumulative

    def body(self, r, model):
        sampling = {"max_new_tokens": r.max_tokens, "temperature": r.temperature, "top_p": r.top_p,
                    "top_k": r.top_k or -1, "stop_token_ids": list(r.stop_token_ids), "ignore_eos": r.ignore_eos}
        return {"input_ids": list(r.prompt), "sampling_params": sampling, "return_logprob": True,
                "stream": r.stream, **({"sampling_seed": r.seed} if r.temperature else {})}

    def chunk(self, payload):
        meta = payload.get("meta_info") or {}
        entries = meta.get("output_token_logprobs") or []
        finish = (meta.get("finish_reason") or {}).get("type")
        return Chunk([int(e[1]) for e in entries], payload.get("text"),
                     {"stop": "stop", "length": "length"}.get(finish), [float(e[0]) for e in entries])


class Text(Dialect):
    """Any OpenAI-compatible /v1/completions, text only: the prompt still goes in as ids (the OpenAI API takes
    them), the completion comes back as text and is re-tokenised (checked to round-trip)."""
    name = "text"
    ids = False

    def body(self, r, model):
        return {"model": model, "prompt": list(r.prompt), "max_tokens": r.max_tokens, "stream": r.stream,
                **sampling_fields(r)}

    def chunk(self, payload):
        return openai_chunk(payload, lambda choice, logprobs: None)


class LlamaServer(Dialect):
    """llama.cpp's llama-server, its native POST /completion: the prompt as an array of ids (no BOS added to one),
    the generated ids in `tokens` (return_tokens), stop_type eos / word -> "stop", limit -> "length". Its sampler
    chain is named in the spec's order, temperature, top-k, top-p (llama.cpp's default puts the temperature last:
    with it sampled-first-token fails the distribution rule, one token drawn 100 times of 100 where the spec expects
    62); min_p 0: the server's default 0.05 would cut the distribution; top_k 0 is off in llama.cpp as here. Its API
    has no stop token ids (only stop strings): a request's stop ids are not sent, so only EOS ends a completion
    early. Drafting is the server's --spec-type; prompt caching is cache_prompt (on unless the request says)."""
    name = "llama-server"
    path = "/completion"
    n_probs = 0

    def body(self, r, model):
        return {"prompt": list(r.prompt), "n_predict": r.max_tokens, "stream": r.stream, "return_tokens": True,
                "cache_prompt": r.cache_prompt is not False, "n_probs": self.n_probs, "ignore_eos": r.ignore_eos,
                "temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p, "min_p": 0.0, "seed": r.seed,
                "samplers": ["temperature", "top_k", "top_p"]}

    def chunk(self, payload):
        finish = {"eos": "stop", "word": "stop", "limit": "length"}.get(payload.get("stop_type")) \
            if payload.get("stop") else None
        probabilities = payload.get("completion_probabilities") or []
        return Chunk([int(t) for t in payload.get("tokens") or []], payload.get("content"), finish,
                     [float(p["logprob"]) for p in probabilities] or None)


class MlxLm(Dialect):
    """mlx-lm's mlx_lm.server: OpenAI /v1/completions, the prompt as text (its API tokenises a string and takes no
    ids), the generated ids and their log-probabilities from logprobs: true (choices[].logprobs.content[].id,
    .logprob, the stop id included). Its streamed events carry text only, so streams are read as whole answers. Stop
    ids go as stop strings where an id's text encodes to that id alone (mlx-lm matches a stop string's tokens); it
    has no ignore_eos. A seed is sent with sampled requests only: a seeded request is served alone, outside the
    batch. No drafting unless the server was started with --draft-model."""
    name = "mlx-lm"
    prompt_ids = False
    streams_ids = False

    def body(self, r, model):
        # no "model": mlx-lm would load a model of that name; its default is the one it was started with
        return {"prompt": r.prompt_text, "max_tokens": r.max_tokens, "stream": r.stream, "logprobs": True, "stop": list(r.stop_texts), "temperature": r.temperature, "top_p": r.top_p,
                "top_k": r.top_k, "min_p": 0.0, **({"seed": r.seed} if r.temperature else {})}

    def chunk(self, payload):
        choice = (payload.get("choices") or [{}])[0]
        content = (choice.get("logprobs") or {}).get("content") or []
        finish = choice.get("finish_reason")
        return Chunk([int(c["id"]) for c in content], choice.get("text"),
                     finish if finish in ("stop", "length") else None, [float(c["logprob"]) for c in content] or None)


class LlamaServerLogprobs(LlamaServer):
    """llama-server with each generated id's log-probability too (n_probs 1: completion_probabilities[].logprob, the
    softmax of the raw logits), held to the spec's."""
    name = "llama-server-logprobs"
    n_probs = 1


DIALECTS = {d.name: d for d in (JaxImpl(), VLLM(), VLLMLogprobs(), SGLang(), LlamaServer(), LlamaServerLogprobs(),
                                MlxLm(), Text())}
