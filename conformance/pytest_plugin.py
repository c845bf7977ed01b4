"""The suite as an engine's own tests: a pytest plugin, registered by the kit (pyproject.toml, entry point pytest11).

    pytest --qwen35-engine mypkg.adapter:MyEngine --qwen35-expectations mine.json [--qwen35-cases REGEX]

adds one test per run of `qwen35-conformance run` (named qwen35-conformance::<case>[@<rollback strategy>]) to
whatever else pytest collects; --qwen35-sample [--qwen35-seed S] adds the statistical pack's cases (`sample`). A run passes, fails with the runner's report of it (its row and first mismatching
elements), is skipped for a feature the expectations say the engine lacks, or xfails where the expectations list it
as a known failure; whatever `run` marks unexpected (`!`) fails, a known failure that passes included. Without
--qwen35-engine the plugin adds nothing.
"""

import io
from pathlib import Path

import pytest

SUITE = "qwen35-conformance"


def pytest_addoption(parser):
    group = parser.getgroup("qwen35", "the Qwen3.5 conformance suite as tests (qwen35-conformance run)")
    group.addoption("--qwen35-engine", metavar="ENGINE", help="the engine to check, as `qwen35-conformance run "
                    "--engine` takes it: a shipped or registered name, package.module:Class, or exec:\"COMMAND\"")
    group.addoption("--qwen35-expectations", metavar="FILE.json", help="the engine's unsupported features and known "
                    "failures (default: the engine's own file)")
    group.addoption("--qwen35-cases", metavar="REGEX", help="only case names matching this regular expression")
    group.addoption("--qwen35-out-dir", metavar="DIR", help="where outputs of failing cases go (default: "
                    "./qwen35-conformance-out)")
    group.addoption("--qwen35-timeout", type=float, metavar="SECONDS", help="an exec: engine's limit for answering "
                    "one request")
    group.addoption("--qwen35-sample", action="store_true", help="add the statistical pack (`qwen35-conformance "
                    "sample`): the engine draws with its own random numbers")
    group.addoption("--qwen35-seed", type=int, default=0, metavar="S", help="seeds the pack's draws (default 0)")


class Suite:
    """The engine, started once per pytest process, with its expectations and models."""

    def __init__(self, config):
        from . import runner
        from .engines import EngineError
        option = config.getoption
        try:
            self.engine = runner.get_engine(option("qwen35_engine"), option("qwen35_timeout"))
        except EngineError as e:
            raise pytest.UsageError(f"--qwen35-engine: {e}") from None
        try:
            expectations = option("qwen35_expectations")
            _, self.unsupported, self.known_failures = runner.engine_expectations(
                self.engine, Path(expectations) if expectations else None)
            self.runs = runner.select_cases(runner.CASES_DIR, option("qwen35_cases"))
            if option("qwen35_sample"):
                self.runs += [(folder, runner.seeded(meta, option("qwen35_seed")))
                              for folder, meta in runner.select_cases(runner.CASES_DIR, option("qwen35_cases"), True)]
        except Exception as e:
            self.engine.close()
            raise pytest.UsageError(f"{SUITE}: {e}") from None
        self.load_model = runner.model_loader(self.engine)
        self.diagnoser = runner.reference_diagnoser()      # names the usual mistake a failure matches
        self.out_dir = Path(option("qwen35_out_dir") or runner.OUT_DIR)

    def close(self):
        self.engine.close()


class CaseFailed(Exception):
    """A run whose result is unexpected: its report is the test's failure message."""


class SuiteCollector(pytest.Collector):
    def collect(self):
        return [CaseItem.from_parent(self, name=meta["name"], folder=folder, meta=meta)
                for folder, meta in self.config.stash[SUITE_KEY].runs]


class CaseItem(pytest.Item):
    def __init__(self, *, folder, meta, **kwargs):
        super().__init__(**kwargs)
        self.folder, self.meta = folder, meta

    def runtest(self):
        from .runner import actual_dir, print_table, run_case
        suite = self.config.stash[SUITE_KEY]
        result = run_case(suite.engine, self.folder, self.meta, suite.unsupported, suite.known_failures,
                          suite.load_model, suite.out_dir, suite.diagnoser)
        if result.unexpected:
            report = io.StringIO()
            print_table([result], report)
            if result.status == "FAIL":
                print(f"outputs: {actual_dir(suite.out_dir, suite.engine.name).resolve()}", file=report)
            raise CaseFailed(report.getvalue().rstrip())
        if result.status == "SKIP":
            pytest.skip(result.note)
        if result.status in ("FAIL", "ERROR"):
            pytest.xfail(result.note)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CaseFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.folder, None, f"{SUITE}::{self.name}"


SUITE_KEY = pytest.StashKey[Suite]()


@pytest.hookimpl(tryfirst=True)     # before -k and -m deselect: they apply to the suite's tests too
def pytest_collection_modifyitems(session, config, items):
    if not config.getoption("qwen35_engine"):
        return
    config.stash[SUITE_KEY] = Suite(config)
    collector = SuiteCollector.from_parent(session, name=SUITE, nodeid=SUITE)
    items.extend(collector.collect())


def pytest_unconfigure(config):
    suite = config.stash.get(SUITE_KEY, None)
    if suite is not None:
        suite.close()
