"""Hostile checkpoints and flags (issue 19): every row of the issue's table gives one error line and exit 2 on both
command lines, within bounded memory and time; random corruptions of a valid checkpoint load or raise UserError."""

import functools
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import reference as R
from conftest import ROOT
from jax_impl import __main__ as jax_cli
from jax_impl import spec_decode
from jax_impl.spec_decode import round_draft_len

WEIGHTS = ROOT / "weights"
ADDRESS_SPACE = 2 * 2**30   # the reference CLI's limit in these runs (it runs the embedded model within 0.5 GiB)
SPARSE_SIZE = 100 * 2**30


def copy_model(tmp_path, name="tiny-dense", **config_changes):
    model = tmp_path / name
    shutil.copytree(WEIGHTS / name, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **config_changes}))
    return model


def sparse_file(tmp_path, header_length=0):
    """The issue's 100 GiB model.safetensors: a sparse file of zeros, after the header length given."""
    model = copy_model(tmp_path)
    with open(model / "model.safetensors", "wb") as f:
        f.write(header_length.to_bytes(8, "little"))
        f.truncate(SPARSE_SIZE)
    return model


def sparse_valid(tmp_path, hidden_size=2**16):
    """A well-formed header naming every tensor a (vocab 2**20) x (hidden 2**16) config needs, in bf16, over a
    sparse file of the size it claims (128 GiB): it passes every header check, and needs 256 GiB as float32."""
    if hidden_size == 2**16 and R.os.sysconf("SC_PAGE_SIZE") * R.os.sysconf("SC_PHYS_PAGES") >= 256 * 2**30:
        pytest.skip("this machine has 256 GiB of memory")
    model = copy_model(tmp_path, vocab_size=2**20, hidden_size=hidden_size, num_hidden_layers=1,
                       tie_word_embeddings=True, eos_token_id=0, intermediate_size=1)
    (model / "generation_config.json").unlink()
    shapes = R.checkpoint_shapes(R.load_config(model), with_mtp=False)
    header, offset = {}, 0
    for name, shape in shapes.items():
        if name != "lm_head.weight":
            size = 2 * math.prod(shape)
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
    text = json.dumps(header).encode()
    with open(model / "model.safetensors", "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)
    return model


NOT_UTF8 = "ab\udcffc"   # what Python makes of the argv bytes b"ab\xffc"

# (id, arguments given the temporary directory, the error line's pattern); each runs on both command lines.
ROWS = [
    ("draft-len 1000", lambda p: ["--prompt-ids", "1,2,3", "--draft", "mtp", "--draft-len", "1000",
                                  "--max-new-tokens", "16"], r"--draft-len 1000: must be in \[0, 32\]"),
    ("sparse 100 GiB file", lambda p: ["--model", str(sparse_file(p)), "--prompt-ids", "1"],
     r"model.safetensors: cannot read safetensors \(the header is not JSON"),
    ("sparse, header length 100 GiB", lambda p: ["--model", str(sparse_file(p, SPARSE_SIZE - 8)), "--prompt-ids", "1"],
     r"cannot read safetensors \(header length 107374182392: more than .* limit of 100000000\)"),
    ("sparse, valid header", lambda p: ["--model", str(sparse_valid(p)), "--prompt-ids", "1"],
     r"the weights and the recurrent state take 256 GiB as float32, more than this machine's"),
    ("10**9 layers", lambda p: ["--model", str(copy_model(p, num_hidden_layers=10**9)), "--prompt-ids", "1"],
     r"config: num_hidden_layers=1000000000 must be in \[1, 1024\]"),
    ("context 10**12", lambda p: ["--model", str(copy_model(p, max_position_embeddings=10**12)), "--prompt-ids", "1",
                                  "--max-new-tokens", str(10**12)],
     r"config: max_position_embeddings=1000000000000 must be in \[1, 16777216\]"),
    ("prompt not UTF-8", lambda p: ["--prompt", NOT_UTF8], r"--prompt is not valid UTF-8 \(at character 2\)"),
    ("seed -1", lambda p: ["--prompt-ids", "1", "--seed", "-1"], r"--seed -1: must be in \[0, 4294967295\]"),
    ("seed 2**70", lambda p: ["--prompt-ids", "1", "--seed", str(2**70)],
     r"--seed 1180591620717411303424: must be in \[0, 4294967295\]"),
    ("temperature inf", lambda p: ["--prompt-ids", "1", "--temperature", "inf"],
     r"--temperature inf: must be 0 \(greedy\) or in \[0.001, 1000.0\]"),
]
ROW_PARAMS = pytest.mark.parametrize("make_args, message", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])

# The reference CLI in a process of its own, under an address-space limit (set in the child itself: a
# preexec_fn would fork this multithreaded JAX process).
LIMITED = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, ({0}, {0})); "
           "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')").format(ADDRESS_SPACE)


def run_reference(args):
    argv = [arg.encode("utf-8", "surrogateescape") for arg in args]   # the bytes a shell would pass
    return subprocess.run([sys.executable, "-c", LIMITED, str(ROOT / "reference.py"), *argv], capture_output=True,
                          timeout=60)


@ROW_PARAMS
def test_issue_rows_reference_process(make_args, message, tmp_path):
    """One line, exit 2, no traceback, under a 2 GiB address-space limit and within 60 s."""
    args = make_args(tmp_path)
    run = run_reference(args)
    err = run.stderr.decode("utf-8", "backslashreplace")
    assert run.returncode == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(message, err), err


@ROW_PARAMS
def test_issue_rows_jax_cli(make_args, message, tmp_path, capsys):
    """The same rows through python -m jax_impl's main, in this process (startup is seconds per process)."""
    args = make_args(tmp_path)
    assert jax_cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and re.search(message, err), err


@pytest.mark.parametrize("hidden_size", [2**9, 2**10])
def test_weights_beyond_the_address_space(hidden_size, tmp_path):
    """Weights that fit in this machine but not in the process's 2 GiB (2 and 4 GiB as float32, from 1 and 2 GiB
    sparse bf16 files): the allocation or the mapping fails, and that is one line too."""
    run = run_reference(["--model", str(sparse_valid(tmp_path, hidden_size)), "--prompt-ids", "1"])
    err = run.stderr.decode()
    assert run.returncode == 2 and err.count("\n") == 1, err
    assert re.search(r"error: .*: (not enough memory for [24] GiB of float32 weights|cannot map the weights)", err)


def test_prompt_not_utf8_jax_process():
    """The argv bytes themselves, through a jax_impl process (the rows above pass it the decoded string)."""
    run = subprocess.run([sys.executable, "-m", "jax_impl", "--prompt", b"ab\xffc"], cwd=ROOT, capture_output=True,
                         timeout=120)
    assert run.returncode == 2 and run.stderr == b"error: --prompt is not valid UTF-8 (at character 2)\n"


def test_round_draft_len():
    assert [round_draft_len("mtp", R.MAX_DRAFT_LEN, limit) for limit in (0, 1, 2, 4, 40)] == [0, 0, 1, 3, 32]
    assert round_draft_len("ngram", 4, 40) == 4 and round_draft_len("none", 4, 40) == 0


def test_longest_draft_and_max_new_tokens_past_the_context(tmp_path, capsys):
    """--max-new-tokens 10**12 stops at the context limit (max_position_embeddings is the prompt + 3 here), and
    --draft-len 32 (the maximum) with 3 tokens to go compiles jax_impl's round for K = 2, the tokens left after the
    prefill's: both command lines give the same tokens and statistics."""
    prompt = [5, 17, 42, 99, 3, 17, 42]
    model = copy_model(tmp_path, "tiny-mtp", max_position_embeddings=len(prompt) + 3, eos_token_id=[])
    (model / "generation_config.json").unlink()
    args = ["--model", str(model), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(10**12),
            "--draft", "mtp", "--draft-len", str(R.MAX_DRAFT_LEN), "--json"]
    run = run_reference(args)
    assert run.returncode == 0, run.stderr
    want = json.loads(run.stdout)
    assert jax_cli.main(args) == 0
    got = json.loads(capsys.readouterr().out)
    assert len(want["tokens"]) == 3 and got["tokens"] == want["tokens"]
    for key in ("target_calls", "proposed", "accepted", "accepted_by_position", "proposed_by_position"):
        assert got["stats"][key] == want["stats"][key], key
    assert len(got["stats"]["proposed_by_position"]) == R.MAX_DRAFT_LEN
    compiled_rounds = {dict(key[3]).get("K") for key in spec_decode._compiled if key[0] is spec_decode.decode_device}
    assert 2 in compiled_rounds and R.MAX_DRAFT_LEN not in compiled_rounds


# ----------------------------------------------------------------------------------------------------------------
# Random corruptions of a valid checkpoint directory

BASES = ("tiny-dense", "tiny-moe-per-expert-mtp", "tiny-multimodal")
MEMORY_BOUND = 16 * 2**20   # bytes traced (tracemalloc sees numpy's buffers) at the peak of one load or parse:
                            # a clean load of these peaks at 0.7-1.2 MiB, a config parse below 0.6 MiB


@functools.lru_cache(maxsize=None)
def checkpoint_files(name, shards):
    """{file name: bytes} of a committed checkpoint, its tensors split over `shards` files (with an index) if > 1."""
    folder = WEIGHTS / name
    files = {f.name: f.read_bytes() for f in folder.iterdir() if f.name != "tokenizer.json"}
    if shards == 1:
        return files
    header, data = parse(files.pop("model.safetensors"))
    names = sorted(n for n in header if n != "__metadata__")
    weight_map = {}
    for i in range(shards):
        part = {n: header[n] for n in names[i::shards]}
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        files[shard] = serialise({n: dict(entry) for n, entry in part.items()}, data, relayout=True)
        weight_map.update(dict.fromkeys(part, shard))
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    return files


def parse(blob):
    length = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + length]), blob[8 + length:]


def serialise(header, data, relayout=False):
    """header + data -> safetensors bytes; relayout: copy each tensor's bytes to a fresh contiguous layout."""
    if relayout:
        chunks, offset = [], 0
        for entry in sorted(header.values(), key=lambda entry: entry["data_offsets"]):
            begin, end = entry["data_offsets"]
            chunks.append(data[begin:end])
            entry["data_offsets"] = [offset, offset + end - begin]
            offset += end - begin
        data = b"".join(chunks)
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6) |
           st.sampled_from(["F32", "BF16", "I8", "full_attention", "qwen3_5", "qwen3_5_moe"]))
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=4)
# near the valid values too, so that corruptions reach the bounds and the checks after them
CONFIG_VALUES = (st.integers(-2, 300) | st.floats(-2, 2) | JSON_VALUES | st.sampled_from(
    [1025, 2**16, 2**20, 2**24, 2**24 + 1, 2**31, 2**63, 1e300, math.inf, -math.inf, math.nan]))
CONFIG_FIELDS = ["model_type", "vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                 "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps",
                 "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "max_position_embeddings",
                 "tie_word_embeddings", "intermediate_size", "num_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "shared_expert_intermediate_size", "eos_token_id", "text_config",
                 "mtp_num_hidden_layers", "full_attention_interval", "hidden_act", "attention_bias"]
CONFIG_PATHS = st.sampled_from([(field,) for field in CONFIG_FIELDS] + [("rope_scaling", "type")] + [
    ("rope_parameters", key) for key in ("rope_type", "rope_theta", "partial_rotary_factor")])
DROP = object()   # a corruption that deletes the field
TENSOR_NAMES = st.sampled_from(["lm_head.weight", "model.norm.weight", "visual.x", "mtp.fc.weight",
                                "model.layers.0.mlp.experts.1.up_proj.weight", "model.layers.9.input_layernorm.weight",
                                "model.language_model.norm.weight", "model.layers.00.input_layernorm.weight"])
SIZES = st.integers(-2**66, 2**66) | st.integers(-3, 300)

FILE = st.integers(0, 3)   # which .safetensors file (modulo their number)
# One corruption: (what, arguments); an example applies one to three in order.
CORRUPTIONS = st.one_of(
    st.tuples(st.just("header byte"), FILE, st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("header length"), FILE, st.integers(0, 2**64 - 1)),
    st.tuples(st.just("header length shift"), FILE, st.integers(-64, 64)),
    st.tuples(st.just("file size"), FILE, st.integers(-200, 200)),
    st.tuples(st.just("offsets"), FILE, st.integers(0, 10**6), st.lists(SIZES | SCALARS, min_size=2, max_size=2)
              | st.lists(SIZES, max_size=3) | JSON_VALUES),
    st.tuples(st.just("dtype"), FILE, st.integers(0, 10**6),
              st.sampled_from(["F32", "F16", "BF16", "F64", "I8", "U8", "BOOL", "F8_E4M3", "", "f32"]) | JSON_VALUES),
    st.tuples(st.just("shape"), FILE, st.integers(0, 10**6), st.lists(SIZES | SCALARS, max_size=4) | JSON_VALUES),
    st.tuples(st.just("name"), FILE, st.integers(0, 10**6), TENSOR_NAMES | st.text(max_size=12)),
    st.tuples(st.just("entry"), FILE, st.integers(0, 10**6), JSON_VALUES),
    st.tuples(st.just("drop"), FILE, st.integers(0, 10**6)),
    st.tuples(st.just("reshape"), FILE, st.integers(0, 10**6)),
    st.tuples(st.just("config"), CONFIG_PATHS, CONFIG_VALUES | st.just(DROP)),
    st.tuples(st.just("config file"), JSON_VALUES | st.binary(max_size=20)),
    st.tuples(st.just("generation config"), JSON_VALUES),
    st.tuples(st.just("index"), st.integers(0, 10**6), JSON_VALUES | TENSOR_NAMES),
)


def corrupt_weights(blob, what, *args):
    """One corruption of a .safetensors file's bytes; header edits keep the header length right."""
    length = int.from_bytes(blob[:8], "little")
    if what == "header byte":
        at = 8 + args[0] % max(min(length, len(blob) - 8), 1)
        return blob[:at] + bytes([args[1]]) + blob[at + 1:]
    if what == "header length":
        return args[0].to_bytes(8, "little") + blob[8:]
    if what == "header length shift":
        return max(length + args[0], 0).to_bytes(8, "little") + blob[8:]
    if what == "file size":
        return blob[:len(blob) + args[0]] if args[0] < 0 else blob + bytes(args[0])
    try:
        header, data = parse(blob)
    except ValueError:   # an earlier corruption broke it
        return blob
    names = sorted(n for n in header if n != "__metadata__") if isinstance(header, dict) else []
    if not names:
        return blob
    target = names[args[0] % len(names)]
    if what == "name":
        header[args[1]] = header.pop(target)
    elif what == "entry":
        header[target] = args[1]
    elif what == "drop":
        del header[target]
    elif what == "reshape":   # the same bytes as another shape: the header stays valid
        if isinstance(header[target], dict) and isinstance(header[target].get("shape"), list):
            shape = header[target]["shape"]
            header[target]["shape"] = shape[::-1] if len(set(shape)) > 1 else [math.prod(shape), 1]
    elif isinstance(header[target], dict):
        header[target][{"offsets": "data_offsets", "dtype": "dtype", "shape": "shape"}[what]] = args[1]
    return serialise(header, data)


def corrupt_config(config, path, value):
    """Set (or DROP) the field at `path` of a config's text section, in place where the path exists; -> config."""
    node = config["text_config"] if isinstance(config, dict) and isinstance(config.get("text_config"), dict) else config
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):
        if value is DROP:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value
    return config


def corrupt(files, what, *args):
    """One corruption of a checkpoint directory's {file name: bytes}, in place."""
    if what == "config file":
        files["config.json"] = args[0] if isinstance(args[0], bytes) else json.dumps(args[0]).encode()
    elif what == "generation config":
        files["generation_config.json"] = json.dumps(args[0]).encode()
    elif what == "config":
        try:
            config = json.loads(files["config.json"])
        except ValueError:   # an earlier corruption broke it
            return
        files["config.json"] = json.dumps(corrupt_config(config, *args)).encode()
    elif what == "index":
        if "model.safetensors.index.json" in files:
            index = json.loads(files["model.safetensors.index.json"])
            names = sorted(index["weight_map"])
            index["weight_map"][names[args[0] % len(names)]] = args[1]
            files["model.safetensors.index.json"] = json.dumps(index).encode()
    else:
        weights = sorted(n for n in files if n.endswith(".safetensors"))
        name = weights[args[0] % len(weights)]
        files[name] = corrupt_weights(files[name], what, *args[1:])


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(BASES), shards=st.sampled_from([1, 1, 2]),
       corruptions=st.lists(CORRUPTIONS, min_size=1, max_size=3))
def test_random_corruptions_load_cleanly_or_raise_user_error(base, shards, corruptions):
    """One to three corruptions of a committed checkpoint (one file or two shards): header bytes, header length,
    file size, offsets, dtypes, shapes, names, whole entries, config fields, the config and generation config files,
    the shard index. reference.load_model loads it or raises one UserError line, never another exception, and
    allocates at most MEMORY_BOUND on the way."""
    files = dict(checkpoint_files(base, shards))
    for corruption in corruptions:
        corrupt(files, *corruption)
    with tempfile.TemporaryDirectory() as folder:
        for name, blob in files.items():
            (Path(folder) / name).write_bytes(blob)
        tracemalloc.start()
        try:
            R.load_model(folder)
            event("loaded")
        except R.UserError as e:
            assert "\n" not in str(e)
            event(re.sub(r"[0-9]+|'.*'|\(.*", "#", str(e).replace(folder, ""))[:60])  # --hypothesis-show-statistics
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    assert peak < MEMORY_BOUND, (peak, corruptions)


CONFIGS = {name: (json.loads((WEIGHTS / name / "config.json").read_text()),
                  json.loads((WEIGHTS / name / "generation_config.json").read_text()))
           for name in ("default", "tiny-dense", "tiny-moe", "tiny-multimodal", "tiny-odd")}


@settings(max_examples=1000, deadline=None)
@given(base=st.sampled_from(sorted(CONFIGS)),
       changes=st.lists(st.tuples(CONFIG_PATHS, CONFIG_VALUES | st.just(DROP)), min_size=1, max_size=3),
       generation=st.one_of(st.none(), st.none(), st.none(), JSON_VALUES,
                            st.dictionaries(st.just("eos_token_id"), CONFIG_VALUES)))
def test_random_configs_parse_or_raise_user_error(base, changes, generation):
    """Config fields alone, many more of them: a Config whose checkpoint shapes can be listed, or a UserError."""
    config = json.loads(json.dumps(CONFIGS[base][0]))
    for path, value in changes:
        corrupt_config(config, path, value)
    tracemalloc.start()
    try:
        cfg = R.config_from_dict(config, CONFIGS[base][1] if generation is None else generation)
        R.checkpoint_shapes(cfg, with_mtp=True)
        event("parsed")
    except R.UserError as e:
        assert "\n" not in str(e)
        event(re.sub(r"=.*", "", str(e)))
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, (peak, changes)
