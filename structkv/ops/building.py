"""Native kernels built on first use: the shared library for one source file, compiled once per
source, flags, compiler and CPU into `$STRUCTKV_CACHE/kernels` and written atomically, so two
processes starting together never load a half-written file and a cache folder shared by machines of
different CPUs never hands one the other's `-march=native` build."""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path


@functools.cache
def cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def find_compiler(env: str, names: tuple[str, ...]) -> str | None:
    """`$env` (CC, CXX) or the first of `names` on PATH."""
    return os.environ.get(env) or next((p for p in map(shutil.which, names) if p), None)


def kernels_disabled() -> bool:
    """`STRUCTKV_CPU_KERNELS=0` turns every native kernel off (to compare against the references)."""
    return os.environ.get("STRUCTKV_CPU_KERNELS", "1") == "0"


def build_library(source: Path, compiler: str, flags: list[str], libs: list[str] = (), salt: str = "") -> Path:
    """The shared library of `source` built by `compiler` with `flags` (then `libs` after the output),
    once; `salt` keys anything else the build depends on (the torch version of its headers).
    Raises RuntimeError with the compiler's message when the build fails."""
    from ..util.fetch import cache_root
    from ..util.files import write_atomic

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([source.read_text(), " ".join([*flags, *libs]), version, cpu_id(), salt])
                         .encode()).hexdigest()
    lib = cache_root() / "kernels" / f"{source.stem}-{key[:16]}.so"
    if lib.exists():
        return lib
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(tmp) / lib.name
        done = subprocess.run([compiler, *flags, str(source), "-o", str(built), *libs], capture_output=True,
                              text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        with open(built, "rb") as f:
            write_atomic(f, lib)
    return lib


def native_library(source: Path, compiler_env: str, compilers: tuple[str, ...], flags: list[str],
                   libs: list[str] = (), salt: str = "", what: str = "the kernel") -> tuple[Path | None, str]:
    """(the built library, "") or (None, why not): turned off, no compiler, or a failed build. The
    callers fall back to their references on None."""
    if kernels_disabled():
        return None, "STRUCTKV_CPU_KERNELS=0"
    compiler = find_compiler(compiler_env, compilers)
    if compiler is None:
        return _fallback(f"no compiler ({', '.join(compilers)}; or ${compiler_env}) on PATH", what)
    if not source.exists():
        return _fallback(f"{what}'s source {source.name} is missing from the installed package (reinstall "
                         "structkv from a wheel or checkout that has structkv/ops/csrc)", what)
    try:
        return build_library(source, compiler, flags, libs, salt), ""
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return _fallback(f"{what} could not be built: {e}", what)


def _fallback(why: str, what: str) -> tuple[None, str]:
    """(None, why), said once where it happens: the reference path is correct but several times
    slower, and a user who expects the native kernel should not find out from a timing."""
    warnings.warn(f"structkv: {why}; {what} falls back to its slower PyTorch reference", RuntimeWarning, stacklevel=3)
    return None, why


def torch_extension_flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) of a C++ library against this torch's headers and libraries (the
    ops registered into the dispatcher with TORCH_LIBRARY_IMPL)."""
    import torch
    from torch.utils import cpp_extension

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", abi,
             *(f"-I{p}" for p in cpp_extension.include_paths())]
    return flags, [f"-L{torch_lib}", "-ltorch", "-ltorch_cpu", "-lc10"]
