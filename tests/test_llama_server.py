"""check-server against llama.cpp's llama-server (tests/llama_server.py: built once into the user's cache from the
llama.cpp source llama-cpp-python vendors, started as a real process on a free localhost port, stopped even on
failure) serving tiny-mtp's GGUF (the llama_cpp engine's conversion) with several parallel slots, continuous batching
and prompt caching, plain and with its speculative decoding: every scenario's result is what
conformance/expectations/server-llama-server.json says, and each recorded finding fails as recorded (its rule, its
request), so that a fixed bug or a new one shows."""

import json
import urllib.error
import urllib.request

import pytest

from conftest import ROOT
from conformance import check_server as cs
from conformance.engines.llama_cpp import gguf_file
from llama_server import llama_server

MODEL = ROOT / "weights" / "tiny-mtp"
EXPECTATIONS = ROOT / "conformance" / "expectations" / "server-llama-server.json"
SLOTS = 8


@pytest.fixture(scope="module")
def gguf():
    return gguf_file(MODEL)


@pytest.fixture(scope="module")
def expectations():
    return json.loads(EXPECTATIONS.read_text())


def configurations():
    return json.loads(EXPECTATIONS.read_text())["servers"]


@pytest.fixture(scope="module", params=[c["name"] for c in configurations()])
def server(request, gguf, expectations, tmp_path_factory):
    configuration = next(c for c in expectations["servers"] if c["name"] == request.param)
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    with llama_server(gguf, log, slots=SLOTS, extra=configuration["options"]) as url:
        yield configuration, url


def failing(summary):
    return {r["scenario"]: r["failures"] for r in summary["scenarios"] if r["status"] == "FAIL"}


def test_every_scenario_is_as_the_expectations_file_says(server, tmp_path):
    configuration, url = server
    summary, _ = cs.check_server(url, MODEL, dialect="llama-server", report=tmp_path / "report.json",
                                 log=lambda line: None, timeout=300)
    found = failing(summary)
    expected = configuration["findings"]
    assert {name: [(f["rule"], f["request"]) for f in found[name]] for name in found} == {
        name: [tuple(f) for f in finding["failures"]] for name, finding in expected.items()}, \
        json.dumps(found, indent=1)[:6000]
    assert len(summary["scenarios"]) == len(cs.load_scenarios())
    assert all(r["tokens"] > 0 for r in summary["scenarios"])


def completion(url, body):
    request = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_the_server_is_stopped_even_when_the_test_fails(gguf, tmp_path):
    with pytest.raises(ZeroDivisionError):
        with llama_server(gguf, tmp_path / "server.log", slots=1) as url:
            assert completion(url, {"prompt": [1, 2, 3], "n_predict": 2, "return_tokens": True})["tokens"]
            1 / 0
    with pytest.raises(urllib.error.URLError):
        completion(url, {"prompt": [1, 2, 3], "n_predict": 2})
