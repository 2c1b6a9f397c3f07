"""ttserve's C kernels (decode_attention.c, prefill_attention.c, bf16_gemm.c, decode_step.c), built
on the host that runs them and loaded beside torch.

Each source is compiled once per source text, compiler (and version), flags and CPU with the C
compiler (CC, else cc) as `-O3 -march=native -ffast-math -fopenmp` into kernels/ of ttserve's
cache ($TTSERVE_CACHE_DIR, default ~/.cache/ttserve; the library is world-readable, so one cache
can serve several users), and loaded with ctypes: its OpenMP calls bind to the libgomp torch has
already loaded (one thread team). Without a compiler, a writable cache or torch on that one
OpenMP runtime, `load()` says why and the caller keeps its other path.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Compiled with -ffast-math, linked without: a -ffast-math link adds crtfastmath.o, whose
# constructor sets the loading thread's MXCSR to flush subnormals to zero, changing torch's own
# arithmetic in the worker from then on.
COMPILE_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")

_loaded: dict[Path, "ctypes.CDLL | str"] = {}  # per source: the library, or why not
# Why a kernel was refused for bringing a second OpenMP runtime: that runtime stays mapped (a
# library cannot be unloaded), and a later kernel would bind to it unseen, so every later load is
# refused for the same reason.
_second_runtime = ""


class CacheUnusable(OSError):
    """The kernel cache folder cannot be created or written."""


def _cache_dir() -> Path:
    from ....planning.model_prepare import cache_root  # the one owner of ttserve's cache layout

    return cache_root() / "kernels"


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model name and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    fields = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(fields)


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def _source_text(source: Path, seen: frozenset[Path] = frozenset()) -> bytes:
    """The source and every file it includes by a quoted name, recursively, each once per chain
    (decode_step.c includes the two kernels): what the cached library was compiled from."""
    text = source.read_bytes()
    for name in _LOCAL_INCLUDE.findall(text):
        included = (source.parent / name.decode()).resolve()
        if included not in seen:
            text += _source_text(included, seen | {source.resolve()})
    return text


def _build(source: Path) -> Path:
    """The shared library for this source, compiler (and its version) and CPU, built if it is
    not cached; raises OSError (CacheUnusable for the folder) or CalledProcessError when it
    cannot be."""
    compiler = _compiler()
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30, check=True)
    key = hashlib.sha256(_source_text(source) + repr((compiler, version.stdout.splitlines()[:1], COMPILE_FLAGS,
                                                    LINK_FLAGS)).encode() + _cpu_identity().encode())
    folder = _cache_dir()
    library = folder / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / ".lock", "w")
    except OSError as e:
        raise CacheUnusable(f"the kernel cache {folder} is not writable ({e.strerror}); set TTSERVE_CACHE_DIR") from e
    # One build at a time per cache folder (workers of one host start together).
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():
            return library
        work = Path(tempfile.mkdtemp(dir=folder, prefix=".build-"))
        try:
            objects, partial = work / f"{source.stem}.o", work / f"{source.stem}.so"
            for argv in ([*compiler, *COMPILE_FLAGS, "-o", str(objects), str(source)],
                         [*compiler, *LINK_FLAGS, "-o", str(partial), str(objects), "-lm"]):
                subprocess.run(argv, check=True, capture_output=True, text=True, timeout=120)
            partial.chmod(0o755)  # readable by every user of a shared cache
            partial.replace(library)  # atomic: a reader sees no library or a whole one
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return library


def _gomp_libraries() -> set[str]:
    """The distinct OpenMP runtimes mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {Path(line.split()[-1]).resolve().as_posix() for line in maps.splitlines()
            if "libgomp" in line and line.split()[-1].startswith("/")}


def switched_off(switch: str, value: str) -> str:
    """Why a kernel stays off: "SWITCH=value" when the environment says so, else ""."""
    return f"{switch}={value}" if os.environ.get(switch, "").lower() == value else ""


def void_function(library: ctypes.CDLL, name: str, argtypes: list) -> ctypes._CFuncPtr:
    """The C function `name` of `library`, which returns nothing, with its argument types."""
    function = getattr(library, name)
    function.argtypes = argtypes
    function.restype = None
    return function


def load(source: Path) -> "ctypes.CDLL | str":
    """The built library of `source`, once per process; else why it cannot serve here."""
    if source in _loaded:
        return _loaded[source]
    _loaded[source] = _build_and_load(source)
    return _loaded[source]


def _build_and_load(source: Path) -> "ctypes.CDLL | str":
    global _second_runtime
    if not sys.platform.startswith("linux"):
        return f"built for Linux only, not {sys.platform}"
    if _second_runtime:
        return _second_runtime
    torch_gomp = _gomp_libraries()  # torch's own, loaded with torch (and any other library's)
    if not torch_gomp:
        # The kernel's OpenMP calls would load GNU OpenMP as a second runtime beside torch's
        # (an Intel or LLVM OpenMP build): two thread teams spinning on the same cores.
        return "torch here does not run on GNU OpenMP (libgomp), which the kernels are built for"
    try:
        library = ctypes.CDLL(str(_build(source)))
    except subprocess.CalledProcessError as e:
        return f"{shlex.join(e.cmd[:1])} could not build {source.name}: {(e.stderr or '').strip()[-400:]}"
    except CacheUnusable as e:
        return str(e)
    except (OSError, subprocess.SubprocessError) as e:
        return f"no C compiler could build {source.name} ({type(e).__name__}: {e})"
    runtimes = _gomp_libraries()
    if runtimes != torch_gomp:
        _second_runtime = (f"it would load a second OpenMP runtime beside torch's "
                           f"({', '.join(sorted(runtimes - torch_gomp))})")
        return _second_runtime
    return library
