"""Launch tuning of the fused update kernels: block sizes, warps and register caps.

Sizes only: nothing here checks an input or assembles a launch. The figures are what the compile
check (``attnpool kernels``, tests/update/triton/test_kernels_compile.py) holds the kernels to:
no spill and a block that fits the register file on sm_80 and sm_90 (see :mod:`.kernels`).
"""

from __future__ import annotations

from functools import cache

#: the largest value an int32 argument takes (an absent bound)
INT32_MAX = 2**31 - 1
MAX_BLOCK_P = 1024  # page columns per loop step of a row (a row loops over its own live pages)
#: rows per step of a program's prefix sums over the batch (the sums loop over the batch in
#: chunks of this many rows, so a program's registers do not grow with the batch)
MAX_BLOCK = 1024
BLOCK_T = 256  # query tokens per loop step of an extend row's position / slot writes


def pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, x - 1).bit_length())


#: ``maxnreg`` of every update launch: the architecture's limit, so it caps nothing. Without a
#: ``.maxnreg`` in the PTX, ptxas at the register-allocation level Triton 3.9 always asks for
#: (``--regAllocOptLevel=2``) keeps some specializations at a low register count (32 or 40)
#: and spills a few bytes to stay there; with one it compiles them spill-free (the module
#: docstring of :mod:`.kernels`).
MAXNREG = 255
#: 32-bit registers one thread block may use on sm_80 and sm_90 (the register file of an SM)
REGISTERS_PER_BLOCK = 65536


def maxnreg(num_warps: int) -> int:
    """The ``maxnreg`` of a launch of ``num_warps`` warps: :data:`MAXNREG`, lowered so that
    the whole block fits the register file. ptxas honours an explicit ``.maxnreg`` over the
    block size, so a 16-warp program given 255 may compile to more registers than a block of
    512 threads can hold and then fail to launch (at 128 it compiles to fit)."""
    return min(MAXNREG, REGISTERS_PER_BLOCK // (32 * num_warps))


def scan_block(rows: int) -> int:
    """``BLOCK``: the rows a program's prefix sums take per loop step, for a ``rows``-row part
    (the whole part up to :data:`MAX_BLOCK` rows, one step)."""
    return min(MAX_BLOCK, pow2(rows))


def warps(rows: int) -> int:
    """Warps per program: the ``scan_block(rows)`` lanes of one scan step, a few per thread.
    One count for every size: the scan's registers do not grow past :data:`MAX_BLOCK` rows."""
    return 4


def tile_rows(block_n: int) -> int:
    """Mask rows the verify tree expand kernel handles at a time: all of them up to 32 x 32,
    else as many as keep a tile at 2048 entries (its registers then stay flat as ``N`` grows)."""
    return block_n if block_n <= 32 else max(1, 2048 // block_n)


@cache
def tree_tile(block_n: int) -> dict[str, int]:
    """The verify tree expand kernel's size-dependent launch keywords for ``BLOCK_N``
    (``BLOCK_R``, ``BLOCK_J``, ``num_warps``, ``maxnreg``): constants of the tree size, built once
    per size rather than on every update (callers copy them into their own keyword dict)."""
    w = tile_warps(block_n)
    return {"BLOCK_R": max(1, 4096 // block_n), "BLOCK_J": tile_rows(block_n), "num_warps": w,
            "maxnreg": maxnreg(w)}


def tile_warps(block_n: int) -> int:
    """Warps of the verify tree expand kernel, whose program holds a ``tile_rows x block_n``
    tile of its request's mask (and its column positions) in registers: 4 up to 32 x 32, 8 for
    the 2048-entry tiles of larger trees (64 x 64 whole on sm_90 took 186 registers with 4
    warps, near the limit of 255)."""
    return 4 if block_n <= 32 else 8
