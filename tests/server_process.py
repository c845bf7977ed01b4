"""A server under test as a real process on a free localhost port: started, polled until GET /health answers 200,
and stopped on leaving, even when the test fails (llama_server.py, mlx_server.py)."""

import json
import socket
import subprocess
import time
import warnings
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

HEALTH_TIMEOUT = 120.0     # seconds for the model to load and /health to answer 200
STOP_TIMEOUT = 10.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(name, url, process, log_path, timeout=HEALTH_TIMEOUT):
    """Poll GET /health until it answers 200 (503 while the model loads); fail if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not become healthy in {timeout} s:\n{log_path.read_text()[-3000:]}")


@contextmanager
def served(name, command, port, log_path, env=None):
    """`command` (listening on 127.0.0.1:`port`) as a process logging to `log_path` -> its base URL."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(name, url, process, Path(log_path))
        yield url
    finally:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def failing_rules(summary):
    """check-server's summary -> {failing scenario: its failing rules, sorted}."""
    return {r["scenario"]: sorted({f["rule"] for f in r["failures"]}) for r in summary["scenarios"] if r["failures"]}


def recorded_rules(run, found):
    """An expectations file's run -> {scenario: rules} that `found` must equal: every recorded finding, except an
    intermittent one (it depends on the server's timing) that did not fail this time; when it fails, it fails as
    recorded."""
    return {name: finding["rules"] for name, finding in run["findings"].items()
            if name in found or not finding.get("intermittent")}


def assert_fails_as_recorded(summary, run):
    """check-server's summary fails exactly as the expectations file's run records; an intermittent finding that
    failed this time is shown as a warning with its evidence (the failures), so that its next occurrence is seen."""
    found = failing_rules(summary)
    failing = {r["scenario"]: r["failures"] for r in summary["scenarios"] if r["failures"]}
    recorded = recorded_rules(run, found)
    differing = {n: failing.get(n) for n in set(found) | set(recorded) if found.get(n) != recorded.get(n)}
    # found and recorded first, so that a message cut short still names the scenarios that differ
    assert found == recorded, f"found {found}, recorded {recorded}\n" + json.dumps(differing, indent=1)[:6000]
    for name in sorted(set(found) & {n for n, f in run["findings"].items() if f.get("intermittent")}):
        warnings.warn(f"{run['name']}: intermittent {name} failed: {json.dumps(failing[name][:3])}"[:3000])
    assert all(r["tokens"] > 0 for r in summary["scenarios"])
