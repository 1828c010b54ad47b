"""batchline's decode attention kernel for CPU (``csrc/decode_attention.cpp``): each running row
attends over its own columns of the slot store where they lie, instead of one SDPA call over the
window padded to the longest row. The same library holds a lean step's elementwise ops
(:class:`StepOps`: RMSNorm, SiLU times up, the rotary), one call each where torch chains
several small ones.

Why a kernel of our own: a decode step's attention is many tiny products (a few query heads
against one row's keys, per row and KV head). PyTorch's CPU SDPA runs each through a small
BLAS call, and in bfloat16 that call converts and calls again; this kernel reads each row's keys
and values once, sums bfloat16 products with the CPU's AVX512-BF16 instructions where it has
them, and skips the padding. benchmarks/engine_levers.md has the measurements.

The same library holds the int linears (``csrc/quant_gemm.cpp`` for bf16 activations,
``csrc/quant_gemm_f32.cpp`` for float32 ones, used by
:mod:`~batchline.models.generation.quant_kernel`). It is compiled once per machine with the
system's C++ compiler (``$CXX``, else ``c++``) against the installed torch, into
``$BATCHLINE_KERNEL_DIR``, else ``<cache dir>/kernels/`` (``batchline._cache.kernel_dir``),
under a name that hashes the sources, the compiler, torch's version and the CPU's flags (it
is built with ``-march=native``), by one process at a time (others asking meanwhile wait for
its file: :func:`_build_lock`), and then loaded with ``torch.ops.load_library``. Where that
cannot be done (no compiler, a build error, a non-x86 machine), :func:`decode_kernel` returns
None and why, and the engine attends through SDPA as before.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

from batchline._cache import kernel_dir, write_whole
from batchline._dir_lock import DirBusyError, DirLock, holder, lock_dir

__all__ = ["DecodeKernel", "StepOps", "StepProduct", "decode_kernel"]

logger = logging.getLogger(__name__)

#: ``kernel(q, keys, values, first, hi, scale, softcap) -> out`` (softcap 0: none); see
#: ``csrc/decode_attention.cpp``.
DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float, float], torch.Tensor
]

_CSRC = Path(__file__).parent / "csrc"
#: The library's sources, built together into one shared library: the decode attention and the
#: step's elementwise ops (and a decode-only step's layers in one call over them), the int
#: linears of :mod:`~batchline.models.generation.quant_kernel` (bf16 activations, float32 ones,
#: and float32 ones quantized to int8 on the way in), int4's quantizing at load and an
#: embedding's lookups in the int8 layout, with the header the int linears share (in the key).
_SOURCES = (
    _CSRC / "decode_attention.cpp",
    _CSRC / "decode_layers.cpp",
    _CSRC / "quant_gemm.cpp",
    _CSRC / "quant_gemm_f32.cpp",
    _CSRC / "quant_gemm_a8.cpp",
    _CSRC / "quant_steps.cpp",
    _CSRC / "quant_rows.cpp",
    _CSRC / "dense_tiles.cpp",
)
_HEADERS = (_CSRC / "quant_layout.h", _CSRC / "amx_tiles.h", _CSRC / "row_steps.h")
#: Compiled with OpenMP so that ATen's ``parallel_for`` (a header template) splits its work over
#: torch's intra-op threads: without it the header runs the whole range on the calling thread.
#: Linked without ``-fopenmp`` (which would add the compiler's own libgomp): the OpenMP calls
#: bind to the runtime libtorch_cpu already loaded, so the library's threads are torch's and
#: follow ``torch.set_num_threads`` (``load_library`` binds every symbol at load: were they
#: missing, the load would fail and the engine attend through SDPA, saying why).
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-fPIC", "-w")
_BUILD_TIMEOUT_S = 300.0
#: How often a process waiting for another's build of the library looks again (seconds)
_BUILD_POLL_S = 0.25

_lock = threading.Lock()
_loaded: tuple[DecodeKernel | None, str] | None = None


def decode_kernel() -> tuple[DecodeKernel | None, str]:
    """``(kernel, where it was loaded from)``, built on first use (44 s on two Zen 4 cores with
    every source, once per machine), or ``(None, why not)``. One answer per process: torch
    registers the ``batchline`` op namespace once."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
            kernel, why = _loaded
            if kernel is None:
                logger.info("decode attention through SDPA (no batchline kernel: %s)", why)
        return _loaded


class StepOps:
    """The library's elementwise ops for a lean step (``csrc/decode_attention.cpp``), one call
    each where torch chains several: ``rms_norm(x, weight, eps)`` (Llama's order for a weight
    of x's dtype, Gemma's for a float32 one), ``silu_mul(gate_up)`` and
    ``gelu_tanh_mul(gate_up)`` (gate first) and ``rotary(x, cos, signed_sin)``. They round
    where torch's chain rounds; the sum of squares in the norm (another order) and the
    activations' exp differ in the last bits. And ``decode_step(qkv, cos, signed_sin, keys,
    values, first, hi, scale, heads)``: a layer's attention in a decode-only step (rotary,
    the store's writes and the decode attention), the bits of those calls made one by one.
    Made once :func:`decode_kernel` has loaded the library."""

    def __init__(self) -> None:
        ops = torch.ops.batchline
        self.rms_norm = ops.rms_norm
        self.silu_mul = ops.silu_mul
        self.gelu_tanh_mul = ops.gelu_tanh_mul
        self.rotary = ops.rotary
        self.decode_step = ops.decode_step


@dataclasses.dataclass(frozen=True)
class StepProduct:
    """A linear's product of a step's rows as one call of the library, as
    ``csrc/decode_layers.cpp`` makes it: ``layout`` names the op (the constants below),
    ``packed`` its weight, ``n`` its outputs, ``bias`` float32 or None, ``extra`` the op's last
    argument (on int8 rows, bf16 ones below ``quant_kernel.A8_BF16_ROWS`` too: the tiles one
    row reads at once; float32 rows: the vector width; bf16 rows: the rows from which AMX
    tiles take them), and fewer than ``rows_below`` rows take it (more are computed another
    way)."""

    layout: int
    packed: torch.Tensor
    n: int
    bias: torch.Tensor | None
    extra: int
    rows_below: int

    INT4_A8: ClassVar[int] = 0  # int4_linear_a8: float32 rows summed as int8
    INT8G_A8: ClassVar[int] = 1  # int8g_linear_a8: the int8 layout, float32 rows as int8
    BF16_TILES: ClassVar[int] = 2  # bf16_tiles_linear: dense bf16 weights in tiles
    INT4_F32: ClassVar[int] = 3  # int4_linear_f32: float32 rows
    INT4_BF16: ClassVar[int] = 4  # int4_linear: bf16 rows
    # int4 on bf16 rows, fewer than quant_kernel.A8_BF16_ROWS through int4_linear_a8 as int8
    INT4_BF16_A8: ClassVar[int] = 5

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows it takes."""
        if self.layout in (self.BF16_TILES, self.INT4_BF16, self.INT4_BF16_A8):
            return torch.bfloat16
        return torch.float32


def _load() -> tuple[DecodeKernel | None, str]:
    if os.environ.get("BATCHLINE_DECODE_KERNEL", "1") == "0":
        return None, "BATCHLINE_DECODE_KERNEL=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"built for x86-64 only, this machine is {platform.machine()}"
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        return None, f"no C++ compiler ({os.environ.get('CXX', 'c++')} not found)"
    try:
        path = _built(compiler)
        torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    op = torch.ops.batchline.decode_attention
    return op, str(path)


def _built(compiler: str) -> Path:
    """The shared library for this source, compiler, torch and CPU, built if not cached."""
    sources = [path.read_bytes() for path in (*_SOURCES, *_HEADERS)]
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    key = hashlib.sha256()
    for part in (*sources, version.encode(), torch.__version__.encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    key.update(" ".join(_FLAGS).encode())
    path = kernel_dir() / f"decode_attention-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK):
            raise PermissionError(f"{path.parent} is not writable")
    except OSError as exc:
        raise OSError(
            f"cannot build the kernel in {path.parent} ({exc}); "
            "set BATCHLINE_KERNEL_DIR to a writable folder"
        ) from exc
    with _build_lock(path) or contextlib.nullcontext():
        if path.exists():  # built by the process this one waited for
            return path
        _build(compiler, path)
    return path


def _build_lock(path: Path) -> DirLock | None:
    """The right to build ``path``, once this process holds it: one process builds a library
    at a time, the others wait for it and then load its file. Two at once each ran two
    compilers per core on a two-core machine, every one of them slower; a test worker building
    beside another ran past its 120 s limit. None where the library was built while this
    process waited, where the holder is stuck past the build's own time limit (its compilers'
    and the link's), or where the cache's file system takes no lock: the caller then builds
    too (each build writes the file whole or not at all)."""
    told = False
    deadline = time.monotonic() + 2 * _BUILD_TIMEOUT_S
    while True:
        try:
            return lock_dir(path.parent, f"{path.name}.lock")
        except DirBusyError as busy:
            if path.exists() or time.monotonic() > deadline:
                return None
            if not told:
                told = True
                logger.info(
                    "waiting for %s to build batchline's decode attention kernel",
                    holder(busy.pid),
                )
        except OSError as exc:
            logger.debug("building %s without a lock: %s", path.name, exc)
            return None
        time.sleep(_BUILD_POLL_S)


def _build(compiler: str, path: Path) -> None:
    """Compile the sources and link them into ``path``, written whole."""
    from torch.utils import cpp_extension

    libs = cpp_extension.library_paths()
    logger.info("building batchline's decode attention kernel (once per machine)")
    with tempfile.TemporaryDirectory(prefix=".build-", dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        objects = [str(Path(scratch) / f"{i}.o") for i in range(len(_SOURCES))]
        includes = [f"-I{p}" for p in cpp_extension.include_paths()]
        abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
        commands = [
            [compiler, *_FLAGS, *includes, abi, "-c", str(source), "-o", obj]
            for source, obj in zip(_SOURCES, objects, strict=True)
        ]
        # one compiler per source at once, up to the cores: the sources are independent and
        # the build is the first start's longest wait (~46 s one after another on two cores)
        workers = max(1, min(len(commands), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers, "kernel-build") as pool:
            list(pool.map(_compile, commands))  # the first failure raises here
        _compile(
            [
                compiler,
                "-shared",
                *objects,
                "-o",
                str(built),
                *(f"-L{p}" for p in libs),
                *(f"-Wl,-rpath,{p}" for p in libs),
                "-ltorch_cpu",
                "-lc10",
            ]
        )
        write_whole(
            path, built.read_bytes(), "cache.kernel"
        )  # whole or not at all, for every process


def _compile(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{Path(command[0]).name} exited {done.returncode}: {tail}")


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), or what the platform says of the processor."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
