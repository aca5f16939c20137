"""What the threads of one compiled region need to share work without a fork per op: atomic
counters on an int64 array, a pause hint and a yield, as numba intrinsics (LLVM's atomicrmw /
atomic load, `llvm.x86.sse2.pause`, libc's sched_yield named by symbol so numba's disk cache
stays valid).

`claim` / `finish` / `wait_done` hand out the chunks of a phase: a thread takes the next chunk
number until the phase has none left, and waits for every chunk to be finished before the next
phase. Any thread may run any chunk, so a region never waits on a thread that has not started:
one thread alone (the others late, or descheduled on a busy machine) runs every phase itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

SPINS_BEFORE_YIELD = 2000  # pause hints (~40 ns each) before a waiting thread yields its core


def _slot(context, builder, array_type, array, index):  # type: ignore[no-untyped-def]
    data = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, data, [index], wraparound=False)


@intrinsic
def _atomic_add(typingctx: object, array: types.Array, index: types.Integer,
               value: types.Integer) -> tuple:
    """array[index] += value atomically (sequentially consistent); the old value."""
    sig = types.int64(array, index, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _slot(context, builder, signature.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")
    return sig, codegen


@intrinsic
def _atomic_load(typingctx: object, array: types.Array, index: types.Integer) -> tuple:
    """array[index], read atomically (acquire)."""
    sig = types.int64(array, index)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _slot(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)
    return sig, codegen


@intrinsic
def _pause(typingctx: object) -> tuple:
    """The spin-wait hint (x86 `pause`)."""
    sig = types.void()

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                            "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _yield_core(typingctx: object) -> tuple:
    """sched_yield(): let another thread (a late sibling) run on this core."""
    sig = types.void()

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fn = cgutils.get_or_insert_function(builder.module,
                                            ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()
    return sig, codegen


atomic_add = cast(Callable[..., int], _atomic_add)
atomic_load = cast(Callable[..., int], _atomic_load)
pause = cast(Callable[[], None], _pause)
yield_core = cast(Callable[[], None], _yield_core)


@njit(inline="always")
def claim(counters: object, phase: int) -> int:
    """The next chunk number of `phase` (counters[phase, 0] counts the chunks taken)."""
    return atomic_add(counters, 2 * phase, 1)


@njit(inline="always")
def finish(counters: object, phase: int) -> None:
    """One chunk of `phase` done (counters[phase, 1] counts them)."""
    atomic_add(counters, 2 * phase + 1, 1)


@njit(inline="always")
def wait_done(counters: object, phase: int, total: int) -> None:
    """Until every one of the `total` chunks of `phase` is done: spin, then yield the core."""
    spins = 0
    while atomic_load(counters, 2 * phase + 1) < total:
        spins += 1
        if spins < SPINS_BEFORE_YIELD:
            pause()
        else:
            yield_core()
