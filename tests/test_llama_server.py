"""check-server against llama.cpp's llama-server (tests/llama_server.py: built once into the user's cache from the
llama.cpp source llama-cpp-python vendors, started as a real process on a free localhost port, stopped even on
failure) serving tiny-mtp's GGUF (the llama_cpp engine's conversion) with parallel slots, continuous batching and
prompt caching: each run in conformance/expectations/server-llama-server.json fails exactly as recorded there (rule
and request per failing scenario), so that a fixed bug or a new one shows."""

import json
import urllib.error
import urllib.request

import llama_cpp
import numpy as np
import pytest
from llama_cpp import _internals as internals
from tokenizers import Tokenizer

import reference as R
from conftest import ROOT
from conformance import check_server as cs
from conformance.server_dialects import DIALECTS, ServerRequest
from conformance.engines.llama_cpp import gguf_file, with_one_merge
from llama_server import llama_server
from server_process import assert_fails_as_recorded

MODEL = ROOT / "weights" / "tiny-mtp"
EXPECTATIONS = ROOT / "conformance" / "expectations" / "server-llama-server.json"
RUNS = json.loads(EXPECTATIONS.read_text())["runs"]


@pytest.fixture(scope="module")
def gguf():
    return gguf_file(MODEL)


@pytest.mark.parametrize("run", RUNS, ids=[run["name"] for run in RUNS])
def test_check_server_fails_as_the_expectations_file_records(gguf, tmp_path, run):
    with llama_server(gguf, tmp_path / "server.log", slots=run["slots"], extra=run["options"]) as url:
        summary, _ = cs.check_server(url, MODEL, dialect=run["dialect"], scenarios_regex=run["scenarios"],
                                     report=tmp_path / "report.json", log=lambda line: None, timeout=300)
    assert_fails_as_recorded(summary, run)


def test_the_amended_tokenizer_keeps_every_added_tokens_id():
    """The merge llama.cpp needs must not take an added token's id (tokenizers gave <|endoftext|> 257, the merge's)."""
    original = json.loads((MODEL / "tokenizer.json").read_text())
    amended = Tokenizer.from_str(json.dumps(with_one_merge(json.loads((MODEL / "tokenizer.json").read_text()))))
    assert original["added_tokens"]
    for token in original["added_tokens"]:
        assert amended.token_to_id(token["content"]) == token["id"]
    assert amended.encode('!"').ids == [257] and len(set(amended.get_vocab().values())) == amended.get_vocab_size()


def test_the_gguf_ends_a_generation_at_the_checkpoints_eos_ids_alone(gguf):
    """libllama's end-of-generation set over every id of the GGUF: the checkpoint's EOS ids, nothing else."""
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = internals.LlamaModel(path_model=str(gguf), params=params, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(model.model)
    eog = {t for t in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, t)}
    assert eog == set(R.load_config(MODEL).eos_token_id)


def completion(url, body):
    request = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_one_request_is_the_specs_greedy_continuation_with_its_logprobs(gguf, tmp_path):
    """The dialect's reading of a real answer: ids in `tokens`, one log-probability each, the limit as "length"."""
    prompt = [50, 197, 163, 112, 121, 220, 9, 221, 49, 193, 27, 21]
    dialect = DIALECTS["llama-server-logprobs"]
    with llama_server(gguf, tmp_path / "server.log", slots=1) as url:
        chunk = dialect.chunk(completion(url, dialect.body(ServerRequest(prompt, 12), "tiny-mtp")))
    cfg, params = R.load_model(MODEL)
    logits = R.forward(params, cfg, prompt + chunk.ids, R.empty_state(cfg))[0][len(prompt) - 1:-1]
    assert chunk.ids == [int(np.argmax(z)) for z in logits] and chunk.finish == "length"
    spec_logprobs = [float(z[t] - z.max() - np.log(np.exp(z - z.max()).sum())) for z, t in zip(logits, chunk.ids)]
    np.testing.assert_allclose(chunk.logprobs, spec_logprobs, atol=cs.RULES["logprob_atol"]["float32"])


def test_the_server_is_stopped_even_when_the_test_fails(gguf, tmp_path):
    with pytest.raises(ZeroDivisionError):
        with llama_server(gguf, tmp_path / "server.log", slots=1) as url:
            assert completion(url, {"prompt": [1, 2, 3], "n_predict": 2, "return_tokens": True})["tokens"]
            1 / 0
    with pytest.raises(urllib.error.URLError):
        completion(url, {"prompt": [1, 2, 3], "n_predict": 2})
