"""mlx-lm's mlx_lm.server on the mlx CPU backend for the tests, a real process on a free localhost port serving one
of our checkpoints as conformance/engines/mlx.py loads it: a float32 copy whose config.json names the mlx-lm module
that handles the model (a flat qwen3_5_text config names none; mlx.MLX_MODULE)."""

import json
import sys
from contextlib import contextmanager
from pathlib import Path

from conformance.engines.mlx import MLX_MODULE, float32_copy
from server_process import free_port, served


def serving_folder(checkpoint_dir, folder):
    """`folder` made into the checkpoint as mlx_lm.server loads it -> folder."""
    checkpoint_dir, folder = Path(checkpoint_dir), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    float32_copy(checkpoint_dir, folder)
    config = json.loads((checkpoint_dir / "config.json").read_text())
    config["model_type"] = MLX_MODULE.get(config["model_type"], config["model_type"])
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def server_command(model_folder, port, extra=()):
    """mlx_lm.server with its defaults (continuous batching of up to 32 decoding requests, 8 prompts at once, a prompt
    cache of 10 entries), greedy unless a request says otherwise."""
    return [sys.executable, "-m", "mlx_lm.server", "--model", str(model_folder), "--host", "127.0.0.1",
            "--port", str(port), *extra]


@contextmanager
def mlx_server(checkpoint_dir, folder, extra=()):
    """mlx_lm.server serving `checkpoint_dir` (converted into `folder`, its log beside it) -> its base URL; stopped on
    leaving, even on failure."""
    model = serving_folder(checkpoint_dir, Path(folder) / "model")
    port = free_port()
    with served("mlx_lm.server", server_command(model, port, extra), port, Path(folder) / "server.log") as url:
        yield url
