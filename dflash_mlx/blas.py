"""Route MLX's CPU matmuls to OpenBLAS on Linux.

The Linux `mlx[cpu]` wheel links a bundled netlib *reference* BLAS. Its
`cblas_sgemm` is a triple loop: 10-80x slower than an optimised BLAS. MLX
resolves `cblas_*` through the dynamic linker's global scope, so a library
exporting the standard cblas symbols that is loaded with RTLD_GLOBAL *before*
`mlx.core` is imported wins the lookup, and every CPU matmul goes to it.

The route that works from a plain `pip install` on a fresh machine:

* `cmeel-openblas` (PyPI) ships `libopenblas.so.0` with standard symbols, but it
  needs `libgfortran.so.5`, which a fresh machine usually lacks.
* the `mlx[cpu]` wheel itself bundles a libgfortran 5 (auditwheel renamed it and
  its soname to `libgfortran-<hash>.so.5.0.0`, so it does not satisfy the
  dependency as is). We copy it once into the user cache with its soname
  shortened back to `libgfortran.so.5` (an in-place edit of one string in the
  ELF dynamic string table, no compiler needed), load it, then load OpenBLAS.

A system libgfortran/OpenBLAS is used when present. `DFLASH_MLX_BLAS=reference`
opts out; `DFLASH_MLX_BLAS=/path/to/lib.so` loads a given cblas library.
"""

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dflash_mlx.user_cache import user_cache

ENV_VAR = "DFLASH_MLX_BLAS"


@dataclass
class BlasState:
    name: str  # "openblas" | "custom" | "reference" | "accelerate" | "gpu"
    detail: str
    path: Optional[str] = None

    def __str__(self):
        return f"{self.name} ({self.detail})"


_state: Optional[BlasState] = None


def active_blas() -> BlasState:
    """The BLAS MLX's CPU matmuls use in this process (runs `enable()` if needed)."""
    return _state if _state is not None else enable()


def enable(quiet: bool = False) -> BlasState:
    """Preload a fast cblas before `mlx.core` is imported. Idempotent."""
    global _state
    if _state is not None:
        return _state
    _state = _choose(quiet)
    return _state


def _notice(msg, quiet):
    if not quiet:
        print(f"dflash-mlx: {msg}", file=sys.stderr)


def _choose(quiet) -> BlasState:
    if sys.platform == "darwin":
        return BlasState("accelerate", "macOS: MLX uses Accelerate / Metal")
    choice = os.environ.get(ENV_VAR, "auto").strip()
    if choice.lower() in ("reference", "netlib", "off", "0", "none"):
        return BlasState("reference", f"{ENV_VAR}={choice}: MLX's bundled netlib BLAS")
    if sys.platform != "linux":
        return BlasState("reference", f"no BLAS routing on {sys.platform}")
    gpu_build = _mlx_gpu_build()
    if gpu_build is not None:  # the model's matmuls run on the GPU: nothing to route, no threads to set
        return BlasState("gpu", f"MLX's CUDA build ({gpu_build}): matmuls on the GPU, no CPU BLAS routing")

    already = _global_openblas()
    if already is not None:
        return BlasState("openblas", already)
    if "mlx.core" in sys.modules:
        _notice(
            "mlx.core was imported before dflash_mlx, so MLX keeps its slow reference "
            "BLAS; import dflash_mlx first",
            quiet,
        )
        return BlasState("reference", "mlx.core imported before dflash_mlx")

    if choice.lower() != "auto":
        candidates = [("custom", choice)]
    else:
        candidates = [("openblas", p) for p in _openblas_candidates()]
    errors = []
    for name, path in candidates:
        try:
            lib = _load_cblas(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        detail = _openblas_config(lib) or "cblas"
        threads = _set_threads(lib)
        if threads:
            detail += f", {threads} thread{'s' if threads > 1 else ''}"
        return BlasState(name, f"{detail}, {path}", path)

    why = "; ".join(errors) if errors else "no OpenBLAS found (pip install cmeel-openblas)"
    _notice(
        f"fast BLAS unavailable ({why}); MLX falls back to its reference BLAS and CPU "
        f"matmuls run 10-30x slower. Set {ENV_VAR}=reference to silence this.",
        quiet,
    )
    return BlasState("reference", f"fallback: {why}")


def _mlx_gpu_build() -> Optional[str]:
    """The installed MLX CUDA build and its version (`mlx-cuda-13 0.32.4`), or None."""
    from dflash_mlx.requirements import cuda_build, installed

    name = cuda_build()
    return None if name is None else f"{name} {installed(name)}"


def default_threads() -> int:
    """OpenBLAS threads unless OPENBLAS_NUM_THREADS / OMP_NUM_THREADS say otherwise.

    Half the cores, at most 4: MLX's own thread needs a core, decode-sized
    matmuls gain nothing from more, and OpenBLAS workers spin while they wait,
    so on a busy 2-core machine 2 threads made a 20-token SmolLM2 forward 5x
    slower than 1 (4 s vs 0.77 s).
    """
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def _set_threads(lib):
    if os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS"):
        get = getattr(lib, "openblas_get_num_threads", None)
        return get() if get else None
    setter = getattr(lib, "openblas_set_num_threads", None)
    if setter is None:
        return None
    n = default_threads()
    setter(ctypes.c_int(n))
    return n


def _global_openblas():
    try:
        fn = ctypes.CDLL(None).openblas_get_config
    except (AttributeError, OSError):
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode(errors="replace") + ", preloaded"


def _openblas_config(lib):
    try:
        fn = lib.openblas_get_config
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode(errors="replace")


def _site_dirs():
    seen = []
    for p in sys.path:
        if p and p not in seen and os.path.isdir(p):
            seen.append(p)
    return seen


def _openblas_candidates():
    out = []
    for d in _site_dirs():
        p = os.path.join(d, "cmeel.prefix", "lib", "libopenblas.so.0")
        if os.path.exists(p) and p not in out:
            out.append(p)
    # A distribution OpenBLAS (e.g. Debian's libopenblas0-pthread).
    system = ctypes.util.find_library("openblas")
    if system:
        out.append(system)
    return out


# OpenBLAS cores whose kernels use AVX-512: a build for one of them alone (no
# DYNAMIC_ARCH; cmeel-openblas is a SKYLAKEX build) dies with SIGILL on the first
# matmul on a CPU without AVX-512 (measured: AMD EPYC with AVX2 only).
_AVX512_CORES = ("SKYLAKEX", "COOPERLAKE", "SAPPHIRERAPIDS")


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _unsupported_core(config):
    """Why this CPU cannot run a library with `openblas_get_config()` == config, or None."""
    if not config or "DYNAMIC_ARCH" in config:
        return None
    core = next((c for c in _AVX512_CORES if c in config.split()), None)
    flags = _cpu_flags()
    if core and flags is not None and "avx512f" not in flags:
        return f"built for {core} (AVX-512), which this CPU lacks"
    return None


def _load_cblas(path):
    # Loaded locally first: a library rejected here must not have put its
    # symbols in the global namespace, where mlx.core would bind to them.
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    except OSError as e:
        if "libgfortran" not in str(e):
            raise
        _provide_gfortran()
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    if not hasattr(lib, "cblas_sgemm"):
        raise OSError("does not export cblas_sgemm")
    why = _unsupported_core(_openblas_config(lib))
    if why:
        raise OSError(why)
    return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # promotes the loaded library


def _provide_gfortran():
    """Make `libgfortran.so.5` resolvable: the system's, else mlx's bundled copy."""
    try:
        ctypes.CDLL("libgfortran.so.5", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    libs = _mlx_bundled_libs()
    if libs is None:
        raise OSError("libgfortran.so.5 missing and no mlx_cpu.libs to borrow it from")
    gfortran = sorted(glob.glob(os.path.join(libs, "libgfortran-*.so*")))
    if not gfortran:
        raise OSError(f"libgfortran.so.5 missing (none in {libs})")
    # The bundled libgfortran needs the bundled libquadmath under its mangled
    # soname; loading it globally first satisfies that dependency wherever
    # the patched copy lives.
    for dep in sorted(glob.glob(os.path.join(libs, "libquadmath-*.so*"))):
        ctypes.CDLL(dep, mode=ctypes.RTLD_GLOBAL)
    patched = _patched_copy(gfortran[0], "libgfortran.so.5")
    ctypes.CDLL(str(patched), mode=ctypes.RTLD_GLOBAL)


def _mlx_bundled_libs():
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        d = os.path.join(os.path.dirname(loc), "mlx_cpu.libs")
        if os.path.isdir(d):
            return d
    return None


def _cache_dir():
    return user_cache("blas")


def _patched_copy(src, soname):
    """Copy `src` into the cache with DT_SONAME set to `soname` (shorter or equal)."""
    st = os.stat(src)
    key = f"{Path(src).name}-{st.st_size}-{int(st.st_mtime)}"
    data = None
    # The user cache, else the temp folder (read-only or absent home).
    for base in (_cache_dir(), Path(tempfile.gettempdir()) / f"dflash_mlx-blas-{os.getuid()}"):
        dst = base / key / soname
        if dst.exists():
            return dst
        if data is None:
            data = bytearray(Path(src).read_bytes())
            set_soname(data, soname)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(f".{soname}.{os.getpid()}")
            tmp.write_bytes(data)
            os.chmod(tmp, 0o755)
            os.replace(tmp, dst)  # atomic: concurrent processes never see half a file
            return dst
        except OSError as e:
            error = e
    raise error


DT_NULL, DT_STRTAB, DT_SONAME = 0, 5, 14
PT_LOAD, PT_DYNAMIC = 1, 2


def read_soname(data) -> str:
    off = _soname_offset(data)
    end = data.index(b"\0", off)
    return bytes(data[off:end]).decode()


def set_soname(data: bytearray, soname: str):
    """Overwrite the DT_SONAME string of a little-endian ELF64 image in place."""
    off = _soname_offset(data)
    old_len = data.index(b"\0", off) - off
    new = soname.encode()
    if len(new) > old_len:
        raise ValueError(f"new soname {soname!r} longer than the old one")
    data[off : off + len(new) + 1] = new + b"\0"


def _soname_offset(data) -> int:
    if bytes(data[:4]) != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    e_phoff = struct.unpack_from("<Q", data, 0x20)[0]
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(e_phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, e_phoff + i * e_phentsize
        )
        if p_type == PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        raise ValueError("no dynamic segment")
    strtab = soname = None
    for pos in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, val = struct.unpack_from("<qQ", data, pos)
        if tag == DT_NULL:
            break
        if tag == DT_STRTAB:
            strtab = val
        elif tag == DT_SONAME:
            soname = val
    if strtab is None or soname is None:
        raise ValueError("no DT_SONAME")
    # DT_STRTAB is a virtual address; map it to a file offset.
    for vaddr, offset, size in loads:
        if vaddr <= strtab < vaddr + size:
            return strtab - vaddr + offset + soname
    raise ValueError("DT_STRTAB outside loadable segments")
