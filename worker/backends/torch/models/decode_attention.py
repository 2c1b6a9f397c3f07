"""ttserve's own paged decode attention for bfloat16 on a CPU (decode_attention.c), built on the
host that runs it.

Why: at 8 rows and more, a decode step's attention reads every row's whole context from a cache
that the layer's weights have just evicted, and vLLM CPU's kernel reads that cold cache at ~5 GB/s
per thread (one block after another), a third of what the memory system serves. On the 2-core
EPYC, SmolLM2's heads, 30 layers: 32 rows x 200 tokens 476 -> 280 us a layer, 32 x 1000
1719 -> 1041, 8 x 200 86 -> 52 (benchmarks/decode_attention.py). Attention was 38% of a 32-row
SmolLM2 step.

Where: the model decides once, at allocate_kv_cache, whether its decode steps may use it
(`unavailable()`: this host, the dtype, the shapes, the cache layout); cpu_kernels.Attention.plan
decides per step whether a step fills the threads (its docstring). The keys and values are vLLM's
cache, written by vLLM's cpu_attn_reshape_and_cache.

Built once per source, compiler (and version) and CPU with the C compiler (CC, else cc) as
`-O3 -march=native -ffast-math -fopenmp` into kernels/ of ttserve's cache ($TTSERVE_CACHE_DIR,
default ~/.cache/ttserve; the library is world-readable, so one cache can serve several users), and
loaded with ctypes beside torch: its OpenMP calls bind to the libgomp torch has already loaded (one
thread team). Without a compiler, a writable cache, an AVX-512 CPU or torch on that one OpenMP
runtime, `unavailable()` says why and vLLM's kernel serves every step. TTSERVE_DECODE_ATTENTION=vllm
turns it off (an A/B switch for benchmarks).
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
# Compiled with -ffast-math, linked without: a -ffast-math link adds crtfastmath.o, whose
# constructor sets the loading thread's MXCSR to flush subnormals to zero, changing torch's own
# arithmetic in the worker from then on.
COMPILE_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")
OFF_SWITCH = "TTSERVE_DECODE_ATTENTION"
LAYOUTS = ("vec", "vec16")  # vLLM's kernel ISAs whose cache layout the C code reads (not AMX's packing)
_I, _P = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_P, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _I, _I, _I, _I, _I, ctypes.c_float]

_kernel: ctypes._CFuncPtr | None = None
_limits: tuple[int, int, int] = (0, 0, 0)  # most query heads per KV head, block size, head_dim
_why: str | None = None  # None: not tried; "": loaded; else why not


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


class CacheUnusable(OSError):
    """The kernel cache folder cannot be created or written."""


def _build() -> Path:
    """The shared library for this source, compiler (and its version) and CPU, built if it is
    not cached; raises OSError (CacheUnusable for the folder) or CalledProcessError when it
    cannot be."""
    compiler = _compiler()
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30, check=True)
    key = hashlib.sha256(SOURCE.read_bytes() + repr((compiler, version.stdout.splitlines()[:1], COMPILE_FLAGS,
                                                    LINK_FLAGS)).encode() + _cpu_identity().encode())
    folder = _cache_dir()
    library = folder / f"decode_attention-{key.hexdigest()[:16]}.so"
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
            objects, partial = work / "decode_attention.o", work / "decode_attention.so"
            for argv in ([*compiler, *COMPILE_FLAGS, "-o", str(objects), str(SOURCE)],
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


def _load() -> str:
    """Builds and loads the kernel once per process; "" when it serves, else why not."""
    global _kernel, _limits, _why
    if _why is not None:
        return _why
    if os.environ.get(OFF_SWITCH, "").lower() == "vllm":
        _why = f"{OFF_SWITCH}=vllm"
        return _why
    if not sys.platform.startswith("linux"):
        _why = f"built for Linux only, not {sys.platform}"
        return _why
    torch_gomp = _gomp_libraries()  # torch's own, loaded with torch
    if not torch_gomp:
        # The kernel's OpenMP calls would load GNU OpenMP as a second runtime beside torch's
        # (an Intel or LLVM OpenMP build): two thread teams spinning on the same cores.
        _why = "torch here does not run on GNU OpenMP (libgomp), which the kernel is built for"
        return _why
    try:
        library = ctypes.CDLL(str(_build()))
    except subprocess.CalledProcessError as e:
        _why = f"{shlex.join(e.cmd[:1])} could not build {SOURCE.name}: {(e.stderr or '').strip()[-400:]}"
        return _why
    except CacheUnusable as e:
        _why = str(e)
        return _why
    except (OSError, subprocess.SubprocessError) as e:
        _why = f"no C compiler could build {SOURCE.name} ({type(e).__name__}: {e})"
        return _why
    if library.ttserve_decode_attention_vector_bits() != 512:
        _why = "this CPU has no AVX-512 (the kernel's only vector path)"
        return _why
    runtimes = _gomp_libraries()
    if runtimes != torch_gomp:
        _why = f"it would load a second OpenMP runtime beside torch's ({', '.join(sorted(runtimes - torch_gomp))})"
        return _why
    limits = [ctypes.c_int64() for _ in range(3)]
    library.ttserve_decode_attention_limits(*[ctypes.byref(x) for x in limits])
    _limits = tuple(x.value for x in limits)
    kernel = library.ttserve_decode_attention
    kernel.argtypes = _ARGTYPES
    kernel.restype = None
    _kernel = kernel
    _why = ""
    return _why


def unavailable(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                kernel_isa: str) -> str:
    """Why the kernel cannot run this attention, on a cache vLLM's `kernel_isa` kernel lays out,
    here; "" when it can."""
    if dtype != torch.bfloat16:
        return f"it computes bfloat16 only, not {dtype}"
    if kernel_isa not in LAYOUTS:
        return f"it reads the cache layout of vLLM's {'/'.join(LAYOUTS)} kernels, not {kernel_isa}'s"
    why = _load()
    if why:
        return why
    max_group, max_block, max_head_dim = _limits
    if num_heads % num_kv_heads or num_heads // num_kv_heads > max_group:
        return f"{num_heads} query heads over {num_kv_heads} KV heads (at most {max_group} per KV head)"
    if head_dim % 16 or head_dim > max_head_dim:
        return f"head_dim {head_dim} (multiples of 16 up to {max_head_dim})"
    if block_size % 16 or block_size > max_block:
        return f"block size {block_size} (multiples of 16 up to {max_block})"
    return ""


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> None:
    """out[r] = softmax(q[r] K_r^T * scale) V_r over row r's seq_lens[r] keys, through its
    block_table row: q [rows, heads, head_dim] (last dim contiguous), out contiguous, the caches
    vLLM CPU's [blocks, kv_heads, block_size, head_dim] views; block_table and seq_lens
    contiguous int32. unavailable() must have said "" for these shapes."""
    if _kernel is None:
        raise RuntimeError("decode_attention.unavailable() must say \"\" first")
    rows, heads, head_dim = q.shape
    # What the C code trusts, about a microsecond a call. (The table's width against the rows'
    # lengths is cpu_kernels.Attention.plan's check, once a step.)
    if not (q.stride(2) == 1 and out.is_contiguous() and out.shape == q.shape and block_table.is_contiguous()
            and seq_lens.is_contiguous() and block_table.dtype == seq_lens.dtype == torch.int32
            and block_table.shape[0] >= rows and seq_lens.shape[0] >= rows
            and key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1):
        raise ValueError("decode_attention: inputs of another layout than the kernel reads")
    _kernel(q.data_ptr(), q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
            key_cache.stride(0), key_cache.stride(1), out.data_ptr(), block_table.data_ptr(),
            block_table.shape[1], seq_lens.data_ptr(), rows, heads, key_cache.shape[1], head_dim,
            key_cache.shape[2], scale)
