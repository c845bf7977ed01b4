"""An unusable golden is an error that names the file and the command that rebuilds it, never a silent pass."""

import json
import shutil

import pytest

from conformance.__main__ import main
from conformance.format import CASES_DIR, EXPECTED, INPUTS, MANIFEST, REGENERATE, GoldenError, read_manifest

CASE = "model-tiny-odd-decode"


@pytest.fixture
def case(tmp_path):
    folder = tmp_path / CASE
    shutil.copytree(CASES_DIR / CASE, folder)
    return folder


def edit_manifest(folder, change):
    meta = json.loads((folder / MANIFEST).read_text())
    change(meta)
    (folder / MANIFEST).write_text(json.dumps(meta))


def assert_golden_error(folder, names):
    with pytest.raises(GoldenError) as error:
        read_manifest(folder)
    assert str(names) in str(error.value) and REGENERATE in str(error.value)


def test_a_committed_case_reads(case):
    assert read_manifest(case)["name"] == CASE


def test_corrupted_data_file(case):
    data = bytearray((case / EXPECTED).read_bytes())
    data[-1] ^= 1
    (case / EXPECTED).write_bytes(bytes(data))
    assert_golden_error(case, case / EXPECTED)


@pytest.mark.parametrize("file", [INPUTS, EXPECTED, MANIFEST])
def test_missing_file(case, file):
    (case / file).unlink()
    assert_golden_error(case, case / file)


def test_wrong_suite_version(case):
    edit_manifest(case, lambda meta: meta.update(suite_version=0))
    assert_golden_error(case, case / MANIFEST)


def test_changed_checkpoint(case):
    edit_manifest(case, lambda meta: meta["checkpoint"].update(sha256="0" * 64))
    assert_golden_error(case, "weights/tiny-odd")


def test_the_command_line_stops_on_a_bad_golden_and_says_how_to_fix_it(case, capsys):
    (case / INPUTS).write_bytes(b"")
    assert main(["run", "--engine", "reference", "--dir", str(case.parent)]) == 2
    assert REGENERATE in capsys.readouterr().err
