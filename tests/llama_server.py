"""llama.cpp's llama-server for the tests: built once from the llama.cpp source that the installed llama-cpp-python
vendors, and started as a real process on a free localhost port.

The build reuses what llama-cpp-python's own install compiled: its libllama and libggml (copied into the build's
lib/, the binary's run path) stand in for llama.cpp's src/ and ggml/ targets, so only common, mtmd and the server are
compiled (CMake, the one target llama-server, two jobs), and at -O0: the model runs in those prebuilt libraries, the
compiled part is HTTP, JSON and sampling glue. Where the top-level CMakeLists.txt no longer has the lines this
replaces, the whole of llama.cpp is built instead (Release, GGML_NATIVE=OFF). Either goes into the user's cache, not
the repository: $XDG_CACHE_HOME (default ~/.cache)/qwen35-conformance/llama-server-VERSION/, its log beside it in
build.log. Delete that folder to rebuild. A file lock there makes concurrent test workers build it once.
LLAMA_SERVER may name a llama-server binary to use instead.
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
GLUE_OPTIONS = ["-DCMAKE_C_FLAGS_RELEASE=-O0 -DNDEBUG", "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG"]
PREBUILT = Path(llama_cpp.__file__).parent / "lib"
PREBUILT_TARGETS = ("ggml-base", "ggml", "llama")     # each lib<name>.so, linked in this order of dependence
IMPORTED = """
# prebuilt (llama-cpp-python's): no ggml or llama target is compiled
foreach(name {names})
    add_library(${{name}} SHARED IMPORTED GLOBAL)
    set_target_properties(${{name}} PROPERTIES IMPORTED_LOCATION "{lib}/lib${{name}}.so")
endforeach()
set_target_properties(ggml-base PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${{CMAKE_CURRENT_SOURCE_DIR}}/ggml/include")
set_target_properties(ggml PROPERTIES INTERFACE_LINK_LIBRARIES ggml-base)
set_target_properties(llama PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${{CMAKE_CURRENT_SOURCE_DIR}}/include"
                                       INTERFACE_LINK_LIBRARIES ggml)
"""
GGML_SUBDIRECTORY = "if (NOT TARGET ggml AND NOT LLAMA_USE_SYSTEM_GGML)"
LLAMA_SUBDIRECTORY = "add_subdirectory(src)\n"
INSTALL_SECTION = "#\n# install\n#"


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
    original = source / "CMakeLists.txt.original"          # kept: a build interrupted and rerun patches it again
    if not original.is_file():
        original.write_text((source / "CMakeLists.txt").read_text())
    patched = with_prebuilt_libraries(original.read_text(), folder / "lib")
    if patched:
        (folder / "lib").mkdir(exist_ok=True)
        for library in PREBUILT.glob("lib*.so*"):
            copy = folder / "lib" / library.name
            if library.is_symlink():
                copy.unlink(missing_ok=True)
                copy.symlink_to(os.readlink(library))
            else:
                copy.write_bytes(library.read_bytes())
    (source / "CMakeLists.txt").write_text(patched or original.read_text())
    options = CMAKE_OPTIONS + (GLUE_OPTIONS if patched else [])
    with open(folder / "build.log", "w") as log:
        for command in (["cmake", "-S", str(source), "-B", str(folder / "build"), *options],
                        ["cmake", "--build", str(folder / "build"), "--target", "llama-server", "-j", str(JOBS)]):
            if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode:
                raise RuntimeError(f"building llama-server failed: {' '.join(command)}; see {folder / 'build.log'}")


def with_prebuilt_libraries(cmakelists, lib):
    """llama.cpp's top-level CMakeLists.txt with imported targets for the prebuilt libraries in `lib` in place of its
    ggml and src subdirectories, and without its install rules (they name the llama target) -> the text, or None
    where it does not have the lines this replaces (another llama.cpp version: build it whole)."""
    if not (PREBUILT / "libllama.so").is_file() or any(
            cmakelists.count(anchor) != 1 for anchor in (GGML_SUBDIRECTORY, LLAMA_SUBDIRECTORY, INSTALL_SECTION)):
        return None
    imported = IMPORTED.format(names=" ".join(PREBUILT_TARGETS), lib=lib)
    return (cmakelists[:cmakelists.index(INSTALL_SECTION)].replace(GGML_SUBDIRECTORY, imported + GGML_SUBDIRECTORY)
            .replace(LLAMA_SUBDIRECTORY, ""))


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
