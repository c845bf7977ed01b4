"""Shaped goldens: model-level cases on a production-shaped checkpoint (Qwen3.5-0.8B's geometry, 4 layers),
generated here from the recipe, checked against conformance/shaped_pack.json, passed by the reference and jax_impl;
a drifted oracle or a changed checkpoint stops the command with one line."""

import io
import json

import pytest

from conformance import runner, shaped
from conformance.__main__ import main


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("shaped") / "cases"
    assert main(["shaped", "--like", "Qwen3.5-0.8B", "--out", str(out)]) == 0
    return out


def test_the_shaped_cases_are_the_pinned_ones(cases):
    names = sorted(p.name for p in cases.iterdir())
    assert names == sorted(json.loads(shaped.PACK_FILE.read_text())["recipes"]["Qwen3.5-0.8B"]["fingerprints"])
    meta = json.loads((cases / "model-shaped-Qwen3.5-0.8B-L4-V512-decode" / "case.json").read_text())
    assert "gva_ratio_1" in meta["features"] and meta["checkpoint"]["name"] == "shaped-Qwen3.5-0.8B-L4-V512"


@pytest.mark.parametrize("engine", ["reference", "jax"])
def test_engines_pass_them(cases, engine, tmp_path):
    results, code = runner.run(engine, cases_dir=cases, out=io.StringIO(), progress=io.StringIO(), out_dir=tmp_path,
                               diagnose=False)
    assert code == 0 and {r.status for r in results} == {"PASS"}, results


def test_a_drifted_oracle_stops_the_command(tmp_path):
    pack = json.loads(shaped.PACK_FILE.read_text())
    prints = pack["recipes"]["Qwen3.5-0.8B"]["fingerprints"]["model-shaped-Qwen3.5-0.8B-L4-V512-prefill-T70"]
    prints["logits"]["sum"] += 1e-3
    with pytest.raises(shaped.R.UserError, match="prefill-T70: the reference's float64 result does not match"):
        shaped.materialise("Qwen3.5-0.8B", tmp_path / "out", pack)


def test_a_changed_checkpoint_stops_the_command(tmp_path, capsys):
    pack = json.loads(shaped.PACK_FILE.read_text())
    pack["recipes"]["Qwen3.5-0.8B"]["checkpoint_sha256"] = "0" * 64
    with pytest.raises(shaped.R.UserError, match="the recipe pins 0000"):
        shaped.materialise("Qwen3.5-0.8B", tmp_path / "out", pack)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    assert main(["shaped", "--out", str(tmp_path / "used")]) == 2
    err = capsys.readouterr().err
    assert "not an empty folder" in err and err.count("\n") == 1


def test_the_4b_recipe_pins_an_asymmetric_geometry():
    """The 4B recipe (run by hand: 6.7 GB in float64, too heavy for CI's two workers) pins thirteen cases on 32 value
    heads over 16 key heads at K = V = 128, the mapping 0.8B's symmetric heads cannot show, and a checkpoint digest."""
    recipes = json.loads(shaped.PACK_FILE.read_text())["recipes"]
    recipe = recipes["Qwen3.5-4B"]
    cfg = shaped.R.config_from_dict(shaped.published.published_config("Qwen3.5-4B", recipe["layers"], recipe["vocab"]))
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 32, 128)
    assert len(recipe["checkpoint_sha256"]) == 64 and len(recipe["fingerprints"]) == 13
    assert ({name.replace("4B", "0.8B") for name in recipe["fingerprints"]}
            == set(recipes["Qwen3.5-0.8B"]["fingerprints"]))
