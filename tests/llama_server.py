"""llama.cpp's llama-server for the tests: built once from the llama.cpp source that the installed llama-cpp-python
vendors, and started as a real process on a free localhost port.

The build (CMake, Release, GGML_NATIVE=OFF so it runs on any x86-64 CPU like CI's llama-cpp-python build, the one
target llama-server, two jobs) goes into the user's cache, not the repository: $XDG_CACHE_HOME (default ~/.cache)
/qwen35-conformance/llama-server-VERSION/, its log beside it in build.log. Delete that folder to rebuild. A file lock
there makes concurrent test workers build it once. LLAMA_SERVER may name a llama-server binary to use instead.
"""

import fcntl
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import llama_cpp

from conformance.engines.llama_cpp import vendored_folder, vendored_llama_cpp
from server_process import free_port, served

BINARY_ENV = "LLAMA_SERVER"
JOBS = 2
CMAKE_OPTIONS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
                 # no network at build time: no web UI download, no HTTPS
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"]


def cache_folder():
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return home / "qwen35-conformance" / f"llama-server-{llama_cpp.__version__}"


def llama_server_binary():
    """The llama-server binary: LLAMA_SERVER, or the cached build, built first if missing (minutes; see build.log)."""
    if os.environ.get(BINARY_ENV):
        return Path(os.environ[BINARY_ENV])
    folder = cache_folder()
    binary = folder / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # another worker may be building it: wait, then use its build
        if not binary.is_file():
            build(folder)
    return binary


def build(folder):
    source = vendored_folder(folder / "src")
    if not (source / "CMakeLists.txt").is_file():
        source = vendored_llama_cpp(folder / "src")
    with open(folder / "build.log", "w") as log:
        for command in (["cmake", "-S", str(source), "-B", str(folder / "build"), *CMAKE_OPTIONS],
                        ["cmake", "--build", str(folder / "build"), "--target", "llama-server", "-j", str(JOBS)]):
            if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode:
                raise RuntimeError(f"building llama-server failed: {' '.join(command)}; see {folder / 'build.log'}")


def server_command(binary, gguf, port, slots, context_per_slot, threads, extra):
    """llama-server on float32 KV caches without flash attention (as the llama_cpp engine runs), `slots` parallel
    slots each holding `context_per_slot` positions, continuous batching and prompt caching (both on by default,
    named here so that a changed default shows)."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(slots * context_per_slot), "-t", str(threads), "-tb", str(threads),
            "-ctk", "f32", "-ctv", "f32", "-fa", "off", "--cont-batching", "--cache-prompt", "--no-webui", *extra]


@contextmanager
def llama_server(gguf, log_path, slots=4, context_per_slot=512, threads=2, extra=()):
    """A llama-server process serving `gguf` on a free port -> its base URL; stopped on leaving, even on failure."""
    port = free_port()
    with served("llama-server", server_command(llama_server_binary(), gguf, port, slots, context_per_slot, threads,
                                               extra), port, log_path) as url:
        yield url
