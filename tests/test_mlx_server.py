"""check-server against mlx-lm's mlx_lm.server (tests/mlx_server.py: a real process on a free localhost port, stopped
even on failure) serving tiny-mtp on the mlx CPU backend with its continuous batching and prompt cache: each run in
conformance/expectations/server-mlx-lm.json fails exactly as recorded there, so that a fixed bug or a new one
shows."""

import json
import urllib.request
import warnings
from contextlib import ExitStack

import numpy as np
import pytest

import reference as R
from conftest import ROOT
from conformance import check_server as cs
from conformance.server_dialects import DIALECTS, ServerRequest
from mlx_server import mlx_server
from server_process import assert_fails_as_recorded

MODEL = ROOT / "weights" / "tiny-mtp"
EXPECTATIONS = json.loads((ROOT / "conformance" / "expectations" / "server-mlx-lm.json").read_text())
RUNS = EXPECTATIONS["runs"]
CRASH = EXPECTATIONS["crashes"][0]["signature"]     # the recorded crash of its generation thread


class Restartable:
    """mlx_lm.server in a folder of its own per start (.url, .log); restart() stops it and starts a fresh one."""

    def __init__(self, folder):
        self.folder, self.starts, self.stack = folder, 0, ExitStack()
        self.start()

    def start(self):
        self.starts += 1
        folder = self.folder / f"start{self.starts}"
        self.url, self.log = self.stack.enter_context(mlx_server(MODEL, folder)), folder / "server.log"

    def restart(self):
        self.stack.close()
        self.start()

    def crash(self):  # the recorded crash's line in this start's log, or None
        return next((line for line in self.log.read_text().splitlines() if CRASH in line), None)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Restartable(tmp_path_factory.mktemp("mlx-server"))
    try:
        yield served
    finally:
        served.stack.close()


def check(url, run, tmp_path, scenarios):
    return cs.check_server(url, MODEL, dialect=run["dialect"], scenarios_regex=scenarios, concurrency=run["concurrency"],
                           report=tmp_path / "report.json", log=lambda line: None, timeout=300)[0]


@pytest.mark.parametrize("run", RUNS, ids=[run["name"] for run in RUNS])
def test_check_server_fails_as_the_expectations_file_records(server, tmp_path, run):
    """Where the recorded crash recurs (a timing-dependent mlx-lm bug that takes every later request down), it is
    shown as a warning with its log line, and the scenarios it took down run again on a fresh server: every other
    result is still held to the record, and a second crash fails the test."""
    summary = check(server.url, run, tmp_path, run["scenarios"])
    crash = server.crash()
    if crash:
        died = [r["scenario"] for r in summary["scenarios"] if any(f["rule"] == "http" for f in r["failures"])]
        warnings.warn(f"{run['name']}: mlx_lm.server's recorded crash recurred ({crash.strip()}); restarted, "
                      f"{len(died)} scenarios run again")
        server.restart()
        again = {r["scenario"]: r for r in check(server.url, run, tmp_path, f"^({'|'.join(died)})$")["scenarios"]
                 } if died else {}
        assert server.crash() is None, f"the recorded crash recurred on the fresh server: {server.crash()}"
        summary["scenarios"] = [again.get(r["scenario"], r) for r in summary["scenarios"]]
    assert_fails_as_recorded(summary, run)


def test_one_text_prompt_is_read_as_its_ids_and_continued_greedily_with_the_specs_logprobs(server):
    """The dialect on a real answer: the text prompt tokenised by mlx-lm into the very ids check-server holds it to
    (usage.prompt_tokens), the generated ids and log-probabilities from logprobs.content, the limit as "length"."""
    cfg, params = R.load_model(MODEL)
    text_prompts = cs.TextPrompts(R.load_tokenizer(MODEL), cfg.vocab_size, set(cfg.eos_token_id))
    prompt = cs.lcg_tokens(7, 12, cfg.vocab_size, set(), text_prompts.alphabet)
    dialect = DIALECTS["mlx-lm"]
    body = dialect.body(ServerRequest(prompt, 12, prompt_text=text_prompts.text("one", prompt)), "tiny-mtp")
    request = urllib.request.Request(server.url + dialect.path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        payload = json.loads(response.read())
    chunk = dialect.chunk(payload)
    assert payload["usage"]["prompt_tokens"] == len(prompt)
    logits = R.forward(params, cfg, prompt + chunk.ids, R.empty_state(cfg))[0][len(prompt) - 1:-1]
    assert chunk.ids == [int(np.argmax(z)) for z in logits] and chunk.finish == "length"
    np.testing.assert_allclose(chunk.logprobs, [float(cs.log_softmax(z)[t]) for z, t in zip(logits, chunk.ids)],
                               atol=cs.RULES["logprob_atol"]["float32"])


def test_a_prompt_that_is_not_text_is_refused_in_one_line():
    cfg, _ = R.load_model(MODEL)
    text_prompts = cs.TextPrompts(R.load_tokenizer(MODEL), cfg.vocab_size, set(cfg.eos_token_id))
    assert len(text_prompts.alphabet) == 95 and text_prompts.text("ok", text_prompts.alphabet) is not None
    with pytest.raises(R.UserError, match="scenario bytes: its prompt does not encode back to its ids as text"):
        text_prompts.text("bytes", [40, 150, 41])      # 150: a byte above 0x7f alone, not UTF-8
