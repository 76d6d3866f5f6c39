"""Worker of ``attnpool kernels``: compiles specializations read from stdin, one per line.

Run as ``python -m attnpool.tools.kernel_compile CC`` by :func:`attnpool.tools.kernels.
compile_specs`, in a process started without ``TRITON_INTERPRET`` (so ``@triton.jit`` gives
compilable functions) and with an empty Triton cache (so every compile runs ``ptxas``). Each
input line is a :class:`~attnpool.tools.kernels.Spec` as JSON; each answer is one line ``@@ {json}``
(other output, such as a library's warnings, is never taken for an answer).

What is measured, and from where: ``triton.compile`` of the spec for ``GPUTarget("cuda", CC, 32)``
(seconds: that call); registers, shared memory and stack from ``cuobjdump --dump-resource-usage``
of the cubin (Triton 3.9's compiled-kernel metadata has no register count without a GPU: its
``n_regs`` / ``n_spills`` are filled when a driver loads the binary); spill bytes from the
``ptxas -v`` log of that same compile (Triton runs ``ptxas -v`` and prints the log when
``knobs.nvidia.dump_ptxas_log`` is set).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_USAGE = re.compile(r"\b(REG|STACK|SHARED|LOCAL):(\d+)")


def _resources(cubin: bytes, name: str) -> dict[str, int]:
    """``cuobjdump --dump-resource-usage`` of the one function ``name`` in ``cubin``."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    block = out.split(f"Function {name}:", 1)
    if len(block) != 2:
        raise RuntimeError(f"cuobjdump lists no function {name!r}: {out[-500:]}")
    return {k: int(v) for k, v in _USAGE.findall(block[1].split("Function ", 1)[0])}


def _error(e: BaseException) -> str:
    """The root cause first (Triton wraps it in source-location errors), then the chain."""
    chain: list[BaseException] = []
    c: BaseException | None = e
    while c is not None and len(chain) < 8:
        chain.append(c)
        c = c.__cause__ or c.__context__
    return " <- ".join(f"{type(x).__name__}: {x}" for x in reversed(chain))


def compile_one(spec: dict[str, Any], cc: int) -> dict[str, Any]:
    """Compile one spec (its JSON form); the measurements, or ``{"error": ...}``."""
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    module, _, qualname = spec["kernel"].partition(":")
    fn = getattr(importlib.import_module(module), qualname)
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for i, (name, kind, v) in enumerate(spec["params"]):
        if kind in ("constexpr", "one", "dtype"):
            signature[name] = "constexpr"
            constexprs[(i,)] = tl.dtype(v) if kind == "dtype" else v
        else:
            signature[name] = kind
            if v:
                attrs[(i,)] = backend.parse_attr(v)
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True  # Triton prints the ptxas -v log of each compile
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            options = {"num_warps": spec["num_warps"]}
            if spec.get("maxnreg") is not None:
                options["maxnreg"] = spec["maxnreg"]
            k = triton.compile(src, target=target, options=options)
    except Exception as e:  # a compile failure is a result to report, not a crash
        return {"error": _error(e)}
    seconds = time.perf_counter() - t0
    spills = _SPILL.findall(log.getvalue())
    if len(spills) != 1:
        return {"error": f"expected one ptxas spill line, found {len(spills)}: "
                         f"{log.getvalue()[-500:]}"}
    cubin = k.asm["cubin"]
    use = _resources(cubin, k.metadata.name)
    return {"regs": use.get("REG", 0), "stack": use.get("STACK", 0),
            "shared": use.get("SHARED", 0), "spill_stores": int(spills[0][0]),
            "spill_loads": int(spills[0][1]), "cubin": len(cubin), "seconds": round(seconds, 3)}


def main() -> None:
    cc = int(sys.argv[1])
    out = sys.stdout
    for line in sys.stdin:
        if line.strip():
            try:
                r = compile_one(json.loads(line), cc)
            except Exception as e:  # (an import or cuobjdump failure: reported, not fatal)
                r = {"error": _error(e)}
            out.write("@@ " + json.dumps(r) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
