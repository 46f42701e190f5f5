"""CPU_ATTN's compiled decode and prefill kernels: build, load and report.

The kernels are C++ against torch's own headers (``paged_attention.cpp``: the operator, its
argument checks and the decode kernel; ``prefill.cpp``: the prefill kernel on ATen's
batch-reduce GEMMs; ``kernel.h``: what they share), registered as the operators
``torch.ops.attn_di.paged_attention`` and ``write_kv_cache`` (``TORCH_LIBRARY``, no
pybind11), built with ``torch.utils.cpp_extension`` just in time into a cache directory and
loaded from there on
later runs without the compiler. ``scripts/setup.sh`` builds it ahead
(``python -m attn_di.backends._cpu_kernel build``).

One build per instruction set, chosen by what torch itself dispatches to on this CPU
(``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2, or the portable default) and the
CPU's own flags on top of AVX-512 (``avx512_bf16``: its bfloat16 dot products; ``amx``: AMX
tiles as well, for bfloat16 decode), compiled with exactly that set's flags (never
``-march=native``), so a cache directory shared by AVX2-only, AVX-512 and AMX machines holds
each and each loads its own. The directory name
carries a hash of the source, the flags, torch's version, the machine (``platform.machine()``)
and the compiler asked for (``CXX``): a change rebuilds. Its
``built`` stamp records the library's size and SHA-256, checked before each load: a damaged
library is rebuilt (or, without a compiler, never loaded). Processes sharing the cache build
once between them: a file lock serialises builds (the others wait, then load that build),
and a build is made in a directory of its own and published by renaming it into place.
The compiler runs in a Python process of its own, so a build never loads a second copy of
the operators into a process that runs them (which would abort it); loading a verified build
writes nothing, so a read-only cache (a container image, a read-only mount) is used as it is.

Threads come from torch's intra-op pool (``at::parallel_for``; the library links the
``libgomp.so.1`` torch has already loaded, so there is one OpenMP runtime).

If the kernel cannot be built or loaded, CPU_ATTN keeps its pure-torch path and one
:class:`~attn_di.exceptions.KernelUnavailableWarning` says why. ``ATTN_DI_CPU_KERNEL=0``
chooses the pure-torch path on purpose (no warning).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from attn_di._env import Switch
from attn_di.exceptions import InvalidInputError, KernelUnavailableWarning, closest_name

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: builds are still published atomically
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "ENV_ISA",
    "ENV_SWITCH",
    "ISAS",
    "KERNEL_SWITCH",
    "KernelStatus",
    "build",
    "cache_root",
    "kernel_status",
    "paged_attention_op",
    "pure_torch",
    "write_and_attend_op",
    "write_kv_cache_op",
]

logger = logging.getLogger("attn_di.backends")

#: ``0`` / ``off`` / ``false`` / ``no``: CPU_ATTN uses its pure-torch path; ``1`` / ``on`` /
#: ``true`` / ``yes`` / unset: the kernel (any case); anything else is an error.
ENV_SWITCH = "ATTN_DI_CPU_KERNEL"
KERNEL_SWITCH = Switch(ENV_SWITCH, default=True, on="use the compiled kernel", off="pure torch")
#: Where builds go (default ``$XDG_CACHE_HOME/attn_di/kernels``, else ``~/.cache/...``).
ENV_CACHE = "ATTN_DI_KERNEL_CACHE"

_DIRECTORY = Path(__file__).parent
#: The kernel library's sources: the op, its checks and the decode kernel; the prefill kernel;
#: what they share; the AMX primitives. A change to any of them rebuilds.
_SOURCES = tuple(
    _DIRECTORY / name for name in ("paged_attention.cpp", "prefill.cpp", "kernel.h", "amx.h")
)
_COMMON_FLAGS = ("-O3", "-fopenmp")
# Flags per torch CPU capability, as torch compiles its own kernels for each (x86-64 only).
_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                 "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512")  # fmt: skip
_AVX512_BF16_FLAGS = (*_AVX512_FLAGS, "-mavx512bf16", "-DATTN_DI_AVX512_BF16")
_ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "amx": (*_AVX512_BF16_FLAGS, "-mamx-tile", "-mamx-bf16", "-DATTN_DI_AMX"),
    "avx512_bf16": _AVX512_BF16_FLAGS,
    "avx512": _AVX512_FLAGS,
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"),
    "default": ("-DCPU_CAPABILITY=DEFAULT",),
}  # fmt: skip
#: The instruction sets a build can target.
ISAS = tuple(_ISA_FLAGS)
#: The builds from best to most portable: a CPU that runs one runs every later one (AMX
#: machines have AVX512_BF16: Sapphire Rapids and later).
_ISA_ORDER = ("amx", "avx512_bf16", "avx512", "avx2", "default")
#: Forces a build this CPU runs (one of :data:`ISAS`); unset: the best (``_best_isa``).
ENV_ISA = "ATTN_DI_CPU_KERNEL_ISA"


@dataclass(frozen=True)
class KernelStatus:
    """Which path CPU_ATTN's decode takes in this process, and why.

    Attributes:
        active: whether the compiled decode and prefill kernels are loaded and used.
        isa: the instruction set the kernel was built for (``amx``: AVX-512 with AMX-BF16
            tiles for bfloat16 decode; ``avx512_bf16``: AVX-512 with its bfloat16 dot
            products; ``avx512``, ``avx2``, ``default``), or None when inactive. The best
            this CPU runs unless ``ATTN_DI_CPU_KERNEL_ISA`` names another.
        reason: one line: where the library came from, or why it is not used.
        library: the loaded shared library, or None.
        bfloat16: how bfloat16 attention is computed on this CPU (the decode kernel's tiles
            or dot products, and why not the tiles where the ``amx`` build cannot use them;
            the prefill kernel's GEMMs: AMX tiles where torch's oneDNN has them), or None
            when inactive.
    """

    active: bool
    isa: str | None
    reason: str
    library: str | None = None
    bfloat16: str | None = None

    def describe(self) -> str:
        """One line for people: ``compiled decode and prefill kernels (avx512)`` or ``pure
        torch: <reason>``."""
        if self.active:
            return f"compiled decode and prefill kernels ({self.isa})"
        return f"pure torch: {self.reason}"


_LOCK = threading.Lock()
_STATUS: KernelStatus | None = None
_OP: Any = None
_WRITE_OP: Any = None
_WRITE_AND_ATTEND_OP: Any = None
_PURE_TORCH = 0  # > 0 inside pure_torch() blocks


def kernel_status() -> KernelStatus:
    """The kernel's status, loading (or building) it on the first call of the process.

    A failure is reported once, as a :class:`KernelUnavailableWarning`; later calls return
    the same status without warning again.

    Raises:
        EnvSwitchError: ``ATTN_DI_CPU_KERNEL`` holds something other than on/off (an
            ``InvalidInputError``).
    """
    global _STATUS, _OP, _WRITE_OP, _WRITE_AND_ATTEND_OP
    if _STATUS is not None:
        return _STATUS
    with _LOCK:
        if _STATUS is not None:
            return _STATUS
        if not KERNEL_SWITCH.read():
            spelled = KERNEL_SWITCH.spelling()
            _STATUS = KernelStatus(False, None, f"switched off ({ENV_SWITCH}={spelled})")
            return _STATUS
        # A malformed ATTN_DI_CPU_KERNEL_ISA is the user's error (raised), not a fallback.
        wanted = _native_isa()
        try:
            library, isa = _load(wanted)
            import torch

            _OP = torch.ops.attn_di.paged_attention
            _WRITE_OP = torch.ops.attn_di.write_kv_cache
            _WRITE_AND_ATTEND_OP = torch.ops.attn_di.write_and_attend
            where = (
                f"loaded from {library}"
                if library is not None
                else "registered in this process before attn_di loaded it (library unknown)"
            )
            _STATUS = KernelStatus(
                True, isa, where, None if library is None else str(library), _bf16_paths()
            )
        except Exception as exc:  # any failure means: fall back, and say why
            reason = _one_line(exc)
            _STATUS = KernelStatus(False, None, reason)
            warnings.warn(
                KernelUnavailableWarning(reason, hint=_hint(exc)),
                stacklevel=2,
            )
        return _STATUS


def paged_attention_op() -> Any:
    """``torch.ops.attn_di.paged_attention``, or None when CPU_ATTN uses pure torch.

    ``op(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out, scale,
    sliding_window, soft_cap, alibi_slopes=None, sinks=None)`` writes into ``out``
    (``[>= N, H, D]``, last axis contiguous) the attention of each sequence's queries
    (``query[query_start_loc[b]:query_start_loc[b + 1]]``, ``[N, H, D]``, its last positions)
    over the first ``seq_lens[b]`` positions of its paged K/V. ``key_cache`` and
    ``value_cache`` are ``[num_blocks, block_size, H_kv, D]`` with any strides whose last one
    is 1 (``kv_cache[0]``, ``kv_cache[1]`` of any layout). ``sliding_window`` 0 and ``soft_cap``
    0 mean off; ``alibi_slopes`` and ``sinks`` are ``[H]``. Every argument is checked before
    memory is touched: a malformed one raises ``RuntimeError`` naming it. It records no
    autograd history.
    """
    if _PURE_TORCH:
        return None
    return _OP if kernel_status().active else None


def write_kv_cache_op() -> Any:
    """``torch.ops.attn_di.write_kv_cache``, or None when CPU_ATTN uses pure torch.

    ``op(key, value, key_cache, value_cache, slot_mapping)`` writes each token's ``[H_kv, D]``
    key and value rows (``[N, H_kv, D]``, last axis contiguous) at its slot
    (``block * block_size + offset``) of ``key_cache`` / ``value_cache`` (``[num_blocks,
    block_size, H_kv, D]``, any strides whose last one is 1), skipping negative slots, in one
    call (vLLM's ``reshape_and_cache``). Every slot is checked before the first write: a slot
    past the cache raises ``RuntimeError`` and nothing is written. It records no autograd
    history.
    """
    if _PURE_TORCH:
        return None
    return _WRITE_OP if kernel_status().active else None


def write_and_attend_op() -> Any:
    """``torch.ops.attn_di.write_and_attend``, or None when CPU_ATTN uses pure torch.

    ``op(query, key, value, kv_cache, slot_mapping, written, block_table, seq_lens,
    query_start_loc, output, scale, sliding_window, soft_cap, alibi_slopes, sinks, causal,
    heads, kv_heads, head_size)``: a decoder layer's step in one call, the
    :func:`write_kv_cache_op` of the first ``written`` rows of ``key`` and ``value``
    (``[N, kv_heads, head_size]``) into ``kv_cache`` (``[2, num_blocks, block_size, kv_heads,
    head_size]``; its errors call ``kv_cache[0]`` and ``kv_cache[1]`` ``key_cache`` and
    ``value_cache``) and then the :func:`paged_attention_op` of ``query`` (``[N, heads,
    head_size]``) into ``output`` (``[N, heads * head_size]``, last axis contiguous). Every
    check of both ops, and that the caches share no memory with what the attention reads nor
    ``output`` with what the write reads, comes before the first write: a malformed argument
    (a tensor with a math bit included: a negative or conjugate view, a zero tensor) raises
    ``RuntimeError`` naming it, and nothing is written. It records no autograd history.
    """
    if _PURE_TORCH:
        return None
    return _WRITE_AND_ATTEND_OP if kernel_status().active else None


@contextmanager
def pure_torch() -> Iterator[None]:
    """A block in which CPU_ATTN takes its pure-torch paths (for tests and benchmarks).

    Process-wide, not per thread: nest it, but do not run CPU_ATTN from other threads
    meanwhile and expect the kernel.
    """
    global _PURE_TORCH
    _PURE_TORCH += 1
    try:
        yield
    finally:
        _PURE_TORCH -= 1


def cache_root() -> Path:
    """The directory holding one build directory per combination of source, flags, torch
    version, machine and compiler asked for (``_build_dir``)."""
    configured = os.environ.get(ENV_CACHE)
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "attn_di" / "kernels"


def build(isa: str | None = None, verbose: bool = False, force: bool = False) -> Path:
    """Build the kernel for ``isa`` (default: this CPU's) unless built; return the library.

    A build is reused only if the library's size and SHA-256 match those its ``built``
    stamp recorded; a damaged one (truncated, overwritten) is rebuilt from scratch, so that
    a corrupt library is never loaded (``dlopen`` of a truncated file can kill the process).

    The compiler runs in a Python process of its own: nothing is loaded into the caller, which
    may be running the kernel already (:func:`kernel_status` loads a build, once per process;
    a build made after that is used by the next process).

    Safe across processes sharing the cache: builds of one directory are serialised by a
    file lock beside it (``<name>.lock``, ``fcntl.flock``), a process that waited for another's
    build uses it, and a build is made in a directory of its own and published with one
    ``rename``, so no process ever sees (or deletes) a half-made build.

    Args:
        isa: one of :data:`ISAS`; None: the best this CPU runs (``_native_isa``).
        verbose: show the compiler's command lines and output.
        force: rebuild even if a good build is there.

    Returns:
        The shared library's path (in :func:`cache_root`).

    Raises:
        RuntimeError: no C++ compiler, the cache directory is unusable, or the build
            failed (the compiler's output is in the message with ``verbose``).
    """
    isa = isa or _native_isa()
    name, directory = _build_dir(isa)
    library = directory / f"{name}.so"
    stamp = directory / "built"
    if not force and _verified(library, stamp):
        return library
    damaged = not force and stamp.exists()
    compiler = _compiler()
    if shutil.which(compiler) is None:
        if os.environ.get("CXX"):  # asked for by name: installing another would not help
            missing = f"CXX={compiler!r} is not on PATH"
            install = "set CXX to an installed compiler, or unset it"
        else:
            missing = f"{compiler!r} is not on PATH"
            install = "install a C++ compiler (e.g. apt-get install g++)"
        if damaged:
            raise _BuildError(
                f"CPU_ATTN's kernel in {directory} is damaged (its size or checksum is not "
                f"what the build recorded) and there is no C++ compiler ({missing}) to "
                "rebuild it",
                hint=f"delete {directory}, or {install} and run "
                "`python -m attn_di.backends._cpu_kernel build --force`; "
                "CPU_ATTN works meanwhile",
            )
        raise _BuildError(
            f"no C++ compiler ({missing}) to build CPU_ATTN's kernel",
            hint=f"{install}, then run "
            "`python -m attn_di.backends._cpu_kernel build`; CPU_ATTN works meanwhile",
        )
    with _locked(name, shared=False):
        if not force and _verified(library, stamp):  # another process built it meanwhile
            return library
        _remove_leftovers(name)
        try:
            staging = Path(tempfile.mkdtemp(prefix=f"{name}.building-", dir=cache_root()))
        except OSError as exc:
            raise _unusable_cache(exc) from exc
        try:
            logger.warning("building CPU_ATTN's kernel once (~20 s) into %s", directory)
            _compile(name, isa, staging, verbose)
            (staging / "built").write_text(f"{isa}\n{_fingerprint(staging / library.name)}\n")
            _publish(staging, directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return library


def _compile(name: str, isa: str, directory: Path, verbose: bool) -> None:
    """Compile the library ``<name>.so`` for ``isa`` into ``directory``, in a Python process of
    its own.

    ``torch.utils.cpp_extension.load`` also loads what it built into the process that calls
    it; in a process that has loaded the kernel already that is a second
    ``TORCH_LIBRARY(attn_di)``, which aborts the process (and a library loaded beside the one
    in use would not be the one :func:`kernel_status` names). The child builds, loads (so a
    library that cannot be loaded fails the build) and exits; the caller loads nothing.

    Raises:
        RuntimeError: the build failed (its last output lines in the message), or no Python
            process could be started.
    """
    if not sys.executable:
        raise _BuildError(
            "cannot start a Python process to build CPU_ATTN's kernel (sys.executable is empty)",
            hint="run `python -m attn_di.backends._cpu_kernel build` from a shell; CPU_ATTN "
            "works meanwhile",
        )
    arguments = {
        "name": name,
        "sources": [str(path) for path in _SOURCES if path.suffix == ".cpp"],
        "extra_cflags": list(_flags(isa)),
        "extra_ldflags": ["-fopenmp"],
        "build_directory": str(directory),
        "is_python_module": False,
        "verbose": verbose,
    }
    # cpp_extension runs `ninja` from PATH; the PyPI wheel's lies beside this interpreter,
    # which may not be on PATH (.venv/bin/python run without activating the venv).
    env = {**os.environ, "PATH": os.pathsep.join((_ninja_dir(), os.environ.get("PATH", "")))}
    env["CXX"] = _compiler()  # an empty CXX means the default here; torch would run ''.
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(arguments)],
        env=env,
        stdout=None if verbose else subprocess.PIPE,
        stderr=None if verbose else subprocess.STDOUT,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        output = (done.stdout or "").strip().splitlines()[-20:]
        how = (
            f"exited with status {done.returncode}"
            if done.returncode > 0
            else (f"was killed by signal {-done.returncode}")
        )
        raise RuntimeError(
            f"Error building extension '{name}': the build process {how}"
            + ("".join(f"\n{line}" for line in output) if output else "")
        )


# What the build process runs: cpp_extension.load with the arguments given as JSON.
_COMPILE_SCRIPT = (
    "import json, sys\n"
    "from torch.utils import cpp_extension\n"
    "cpp_extension.load(**json.loads(sys.argv[1]))\n"
)


def _publish(staging: Path, directory: Path) -> None:
    """Make the finished build in ``staging`` the build ``directory``, in one rename (a
    damaged or forced-out build there is first renamed aside, then deleted)."""
    retired = None
    if directory.exists():
        retired = directory.with_name(f"{directory.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.replace(directory, retired)
    os.replace(staging, directory)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def _remove_leftovers(name: str) -> None:
    """Delete what builds of ``name`` killed mid-way left behind (under the build lock, so
    no build of ``name`` is running)."""
    for pattern in (f"{name}.building-*", f"{name}.old-*"):
        for leftover in cache_root().glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


@contextmanager
def _locked(name: str, *, shared: bool) -> Iterator[None]:
    """Hold the build lock of ``name`` (a file in the cache root): exclusive to build,
    shared to check and load. Without ``fcntl`` (Windows) there is no lock; builds are still
    published whole, so concurrent processes may each build, never break one another.

    The shared lock writes nothing: it opens the lock file read-only, and where there is no
    lock file (a cache made elsewhere and copied or mounted here, read-only perhaps: a
    container image) it holds none. No build has run in such a cache, and a build that starts
    meanwhile makes its lock file and publishes its directory by one rename, so a reader
    still loads a whole build.

    Raises:
        _BuildError: the cache root cannot be created, or the lock file opened (exclusive).
    """
    root = cache_root()
    lock = root / f"{name}.lock"
    if shared:
        handle = _open_for_reading(lock)
        if handle is None:
            yield
            return
    else:
        try:
            root.mkdir(parents=True, exist_ok=True)
            handle = lock.open("a+b")
        except OSError as exc:
            raise _unusable_cache(exc) from exc
    with handle:
        if fcntl is not None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _open_for_reading(lock: Path) -> BinaryIO | None:
    """The lock file opened read-only (``flock`` takes a shared lock on any descriptor), or
    None where it does not exist or cannot be opened."""
    try:
        return lock.open("rb")
    except OSError:
        return None


class _BuildError(RuntimeError):
    """A build that cannot happen, with what to do about it (the fallback warning's hint)."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


def _fingerprint(library: Path) -> str:
    """``<size> <sha256>`` of the library, as its build's stamp records it."""
    data = library.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def _verified(library: Path, stamp: Path) -> bool:
    """Whether ``library`` is exactly what its build produced (size and SHA-256)."""
    try:
        recorded = stamp.read_text().splitlines()
        if len(recorded) < 2 or not library.is_file():
            return False
        size, _, digest = recorded[1].partition(" ")
        if library.stat().st_size != int(size):  # cheap check first: truncated files
            return False
        return _fingerprint(library) == f"{size} {digest}"
    except (OSError, ValueError):
        return False


def _unusable_cache(exc: OSError) -> _BuildError:
    """The error for a cache directory that cannot be created or written."""
    configured = os.environ.get(ENV_CACHE)
    where = f"{ENV_CACHE}={configured}" if configured else str(cache_root())
    return _BuildError(
        f"the kernel cache {where} is not a usable directory ({_one_line(exc)})",
        hint=f"set {ENV_CACHE} to a writable directory (it is {where}); CPU_ATTN works meanwhile",
    )


def _ninja_dir() -> str:
    """The directory of the ``ninja`` PyPI package's binary, or of this interpreter."""
    try:
        import ninja

        return str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        return sysconfig.get_path("scripts")


def _load(isa: str) -> tuple[Path | None, str]:
    """Load the build ``isa`` (building it first if missing); ``(library, isa)`` of the
    library whose operators are registered in this process (None if not known: something
    else registered them before), and the instruction set they were built for.

    The library is checked and loaded under the shared build lock, so a rebuild by another
    process cannot replace it between the check and the ``dlopen``. Loading a verified build
    writes nothing (a read-only cache is used as it is).
    """
    name, directory = _build_dir(isa)
    library = directory / f"{name}.so"
    loaded: Path | None = None
    if directory.exists():  # never create a cache directory just to find nothing in it
        with _locked(name, shared=True):
            if _verified(library, directory / "built"):
                loaded = _load_library(library)
    if loaded is None and not _registered():
        library = build(isa)
        with _locked(name, shared=True):
            loaded = _load_library(library)
    elif loaded is None:
        loaded = _registered_library()
    return loaded, _running_isa(isa)


def _registered() -> bool:
    """Whether attn_di's operators are registered in this process."""
    import torch

    return hasattr(torch.ops.attn_di, "paged_attention")


def _load_library(library: Path) -> Path | None:
    """``torch.ops.load_library``, unless the ops are already registered in this process (a
    second ``TORCH_LIBRARY(attn_di)`` would abort it); returns the library whose operators
    are registered (None if not known)."""
    import torch

    if not _registered():
        torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
        return library
    return _registered_library()


def _registered_library() -> Path | None:
    """The attn_di kernel library torch loaded in this process, if torch recorded one."""
    import torch

    loaded = [
        Path(path)
        for path in sorted(getattr(torch.ops, "loaded_libraries", ()))
        if Path(path).name.startswith("attn_di_cpu_")
    ]
    return loaded[-1] if len(loaded) == 1 else None


def _running_isa(fallback: str) -> str:
    """The instruction set of the registered operators (``torch.ops.attn_di.isa()``)."""
    import torch

    try:
        return str(torch.ops.attn_di.isa())
    except (AttributeError, RuntimeError):
        return fallback


def _bf16_paths() -> str | None:
    """``torch.ops.attn_di.bf16_paths()`` (None from a library built before it existed)."""
    import torch

    try:
        return str(torch.ops.attn_di.bf16_paths())
    except (AttributeError, RuntimeError):
        return None


def _native_isa() -> str:
    """The build this process loads: ``ATTN_DI_CPU_KERNEL_ISA`` where set, else the best this
    CPU runs (:func:`_best_isa`).

    Raises:
        InvalidInputError: ``ATTN_DI_CPU_KERNEL_ISA`` names no build, or one this CPU (or
            torch's dispatch, ``ATEN_CPU_CAPABILITY``) does not run.
    """
    best = _best_isa()
    raw = os.environ.get(ENV_ISA) or ""  # a choice among builds, not an on/off switch
    forced = raw.strip().lower()
    if not forced:
        return best
    runnable = _ISA_ORDER[_ISA_ORDER.index(best) :]
    if forced not in runnable:
        known = forced in _ISA_ORDER
        suggestion = None if known else closest_name(forced, sorted(runnable, key=len))
        raise InvalidInputError(
            ENV_ISA,
            f"is {forced!r}, "
            + ("which this CPU does not run" if known else "not a build")
            + f"; the builds this CPU runs: {', '.join(runnable)}",
            hint=(f"did you mean {suggestion!r}? " if suggestion else "")
            + f"unset {ENV_ISA} for the best one ({best})",
        )
    return forced


def _best_isa() -> str:
    """``amx`` where torch dispatches to AVX-512 and the CPU has AMX tiles with bfloat16
    (Linux's ``amx_tile`` and ``amx_bf16`` flags) and AVX512_BF16; ``avx512_bf16`` where it has
    AVX512_BF16; else ``avx512`` / ``avx2`` as torch's own dispatch on this CPU, else
    ``default``. (The ``amx`` build still asks Linux for the tile state when it loads; where
    that is refused it says so in :attr:`KernelStatus.bfloat16` and computes as
    ``avx512_bf16`` does.)"""
    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "default"
    capability = torch.backends.cpu.get_cpu_capability().lower()
    flags = _cpu_flags()
    if capability == "avx512" and {"avx512_bf16", "amx_tile", "amx_bf16"} <= flags:
        return "amx"
    if capability == "avx512" and "avx512_bf16" in flags:
        return "avx512_bf16"
    return capability if capability in ("avx512", "avx2") else "default"


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (``/proc/cpuinfo``); empty elsewhere,
    where the AMX and AVX512_BF16 builds are never chosen by themselves (set
    ``ATTN_DI_CPU_KERNEL_ISA``)."""
    global _FLAGS
    if _FLAGS is None:
        try:
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            text = ""
        line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        _FLAGS = frozenset(line.partition(":")[2].split())
    return _FLAGS


_FLAGS: frozenset[str] | None = None


def _flags(isa: str) -> tuple[str, ...]:
    return (*_COMMON_FLAGS, *_ISA_FLAGS[isa], f"-DATTN_DI_KERNEL_ISA={isa}")


def _compiler() -> str:
    """The C++ compiler asked for: ``CXX``, or ``c++`` where it is unset or empty (as
    ``scripts/setup.sh`` reads it)."""
    return os.environ.get("CXX") or "c++"


def _build_dir(isa: str) -> tuple[str, Path]:
    """``(library name, build directory)``: named by ISA and a hash of what the build uses.

    The compiler enters the hash as it is asked for (``CXX``; ``c++`` where it is unset or
    empty), not by running it: a build made with ``CXX=clang++`` is not loaded by a process
    that asks for GCC, and a machine without a compiler still finds the build its image was
    made with. The name is compared, not the compiler: two names of one compiler build twice,
    and one name that means different compilers on machines sharing a cache (``c++``), or a
    compiler upgraded in place, shares one build (``build --force`` rebuilds).
    """
    import torch

    digest = hashlib.sha256()
    for source in _SOURCES:
        digest.update(source.read_bytes() + b"\0")
    for part in (*_flags(isa), torch.__version__, platform.machine(), _compiler()):
        digest.update(b"\0" + part.encode())
    name = f"attn_di_cpu_{isa}_{digest.hexdigest()[:12]}"
    return name, cache_root() / name


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if isinstance(exc, _BuildError):
        return first
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _hint(exc: BaseException) -> str:
    if isinstance(exc, _BuildError):
        return exc.hint
    return (
        "rebuild with `python -m attn_di.backends._cpu_kernel build --force --verbose` to see "
        f"the compiler's output (or delete {cache_root()}); {ENV_SWITCH}=0 silences this by "
        "choosing the pure-torch path"
    )
