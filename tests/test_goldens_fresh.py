"""The committed goldens are exactly what `python -m conformance generate` writes now: a stale golden fails here."""

import filecmp
import io

from conformance.format import CASES_DIR, REGENERATE
from conformance.generate import generate

SIZE_LIMIT = 10 * 2**20


def files_under(folder):
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_regenerating_gives_byte_identical_goldens(tmp_path):
    generate(tmp_path, progress=io.StringIO())
    fresh, committed = files_under(tmp_path), files_under(CASES_DIR)
    assert fresh == committed, (f"cases added {sorted(fresh - committed)[:5]}, removed {sorted(committed - fresh)[:5]}; "
                                f"run `{REGENERATE}`")
    stale = [name for name in sorted(fresh) if not filecmp.cmp(tmp_path / name, CASES_DIR / name, shallow=False)]
    assert not stale, f"stale goldens {stale[:5]} ({len(stale)} files); run `{REGENERATE}` and commit cases/"


def test_goldens_fit_the_size_budget():
    size = sum(p.stat().st_size for p in CASES_DIR.rglob("*") if p.is_file())
    assert size <= SIZE_LIMIT, f"conformance/cases is {size / 2**20:.1f} MiB, the budget is 10 MiB"
