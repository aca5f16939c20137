"""CUDA graphs for the decode step: pad a pure-decode batch to a captured size and replay.

A decode step launches a few hundred small kernels; replaying them as one CUDA graph removes the
per-launch CPU cost, which dominates at small batches. A graph replays fixed device addresses and
fixed grid shapes, so `GraphedDecode` keeps, per capture size S_pad, static device buffers for
every DeviceBatch field (block tables padded to the width of max_model_len), and each step copies
its padded host arrays into them (one copy per array), replays, and reads logits rows 0..S-1.
The padded table width sizes the attention grid only up to a cap: each decode sequence splits its
own context into partitions fixed by its span alone (kernels.cuda.occupancy.split_partitions, runs
of at least 512 tokens, at most MAX_PARTITIONS = 32), so a graph for a 128k max_model_len
launches a 32-partition grid and scratch, not 256, and a row's result is the same in the graph as
outside it.

Padding rows: input id 0 at position 0, slot -1 (reshape_and_cache skips it: nothing is written
to the cache), one query token against a context of 1 token in block 0 (a real block, so the
decode kernel reads defined memory; the row's result is discarded). Every op of the step is
row-independent, so padding never changes a real row.

How the graph is made is injected (`GraphCapturer`): `CudaGraphCapturer` on the GPU, and in tests
a CPU stand-in whose "graph" re-runs the captured closure, which reads only the static buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import structlog

from kvcore.cache.kv_cache import KVCache
from kvcore.device import to_numpy
from kvcore.model.batch import BatchInput, InputFill
from kvcore.model.llama import DeviceBatch
from kvcore.model.staging import CupyStaging, HostStaging

log = structlog.get_logger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphCapturer(Protocol):
    """Makes graphs: `capture(step)` records `step` and returns (graph, step's output array);
    each replay recomputes that same output array in place. `upload(dst, src)` copies a host
    array into a device buffer on the stream the graphs replay on."""

    def capture(self, step: Callable[[], Any]) -> tuple[Graph, Any]: ...

    def upload(self, dst: Any, src: np.ndarray) -> None: ...

    def end_uploads(self) -> None: ...  # after a step's uploads (the pinned set alternates)


class DecodeModel(Protocol):
    """What GraphedDecode needs of the model (HalfLlamaModel)."""

    xp: Any

    def run(self, batch: DeviceBatch, kv_cache: KVCache) -> Any: ...

    def ensure_rope(self, max_position: int) -> None: ...


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The fixed sizes up to min(max_num_seqs, 256), and that cap itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    cap = min(max_num_seqs, CAPTURE_SIZES[-1])
    return tuple(s for s in CAPTURE_SIZES if s < cap) + (cap,)


def is_pure_decode(batch: BatchInput) -> bool:
    """Every sequence has exactly one query token and wants its logits."""
    num_seqs = batch.context_lens.shape[0]
    return bool(num_seqs > 0 and batch.input_ids.shape[0] == num_seqs
                and np.array_equal(batch.query_start_loc, np.arange(num_seqs + 1))
                and np.array_equal(batch.logits_indices, np.arange(num_seqs)))


@dataclass(slots=True)
class _Captured:
    """One capture size: its static inputs, its graph and the array the graph writes logits to."""

    inputs: DeviceBatch
    graph: Graph | None = None
    logits: Any = None  # (S_pad, vocab) on the device, rewritten by every replay


class GraphedDecode:
    """Runs pure-decode batches of up to max(capture_sizes) sequences through CUDA graphs."""

    def __init__(self, model: DecodeModel, capturer: GraphCapturer, max_num_seqs: int,
                 max_model_len: int, block_size: int) -> None:
        if max_model_len < 1 or block_size < 1:
            raise ValueError(f"max_model_len and block_size must be >= 1, got {max_model_len} "
                             f"and {block_size}")
        self.model = model
        self.capturer = capturer
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        # the rope tables must not move after a capture (graphs hold their addresses)
        model.ensure_rope(max_model_len)
        self._captured: dict[int, _Captured] = {}
        self._kv_cache: KVCache | None = None  # the cache the graphs were captured against
        self.num_replays = 0
        self.failed = False  # a capture failed: every step runs eagerly from then on

    def reset(self) -> None:
        """Drop every graph (the rope tables or the KV cache moved); recaptured on next use."""
        self._captured.clear()
        self._kv_cache = None

    def bucket(self, batch: BatchInput) -> int | None:
        """The capture size for `batch`, or None when it must run eagerly."""
        num_seqs = batch.context_lens.shape[0]
        if num_seqs > self.sizes[-1] or not is_pure_decode(batch):
            return None
        if batch.block_tables.shape[1] > self.max_blocks or \
                int(batch.positions.max()) >= self.max_model_len:
            return None
        return next(s for s in self.sizes if s >= num_seqs)

    def forward(self, batch: BatchInput, kv_cache: KVCache,
                fill: InputFill | None = None) -> np.ndarray | None:
        """(S, vocab) float32 host logits through a graph, or None when `batch` is not
        graphable (the caller runs it eagerly). `batch` is assumed checked (LlamaModel._check)."""
        logits = self.forward_device(batch, kv_cache, fill)
        return None if logits is None else np.ascontiguousarray(to_numpy(logits),
                                                                 dtype=np.float32)

    def forward_device(self, batch: BatchInput, kv_cache: KVCache,
                       fill: InputFill | None = None) -> Any:
        """forward() with the logits left on the device: a float32 copy of the graph's output
        rows (the graph overwrites its own output at the next replay; the sampler writes into
        its logits), or None when `batch` is not graphable. `fill`: rows of the static input
        ids overwritten on the device after the upload (LlamaModel.forward_device)."""
        size = None if self.failed else self.bucket(batch)
        if size is None:
            return None
        if kv_cache is not self._kv_cache:
            self.reset()
            self._kv_cache = kv_cache
        captured = self._captured.get(size)
        if captured is None:
            captured = self._capture(size, kv_cache)
            if captured is None:
                return None
        self._upload(captured.inputs, batch, size)
        if fill is not None:
            fill.apply(captured.inputs.input_ids)
        assert captured.graph is not None
        captured.graph.replay()
        self.num_replays += 1
        num_seqs = batch.context_lens.shape[0]
        xp = self.model.xp
        return xp.array(captured.logits[:num_seqs], dtype=xp.float32)  # (S, vocab) a copy

    def _capture(self, size: int, kv_cache: KVCache) -> _Captured | None:
        """Static buffers, a warm-up run and the capture for one size; None (and every later
        step eager) when the capture itself fails, so a driver or library that cannot capture
        costs speed, not the server."""
        xp = self.model.xp
        inputs = DeviceBatch(
            input_ids=xp.zeros((size,), np.int64),  # (S_pad,)
            positions=xp.zeros((size,), np.int64),  # (S_pad,)
            slot_mapping=xp.full((size,), -1, np.int64),  # (S_pad,) all padding until a step
            query_start_loc=xp.arange(size + 1, dtype=np.int32),  # (S_pad+1,) constant
            context_lens=xp.ones((size,), np.int32),  # (S_pad,)
            block_tables=xp.asarray(_padded_tables(size, self.max_blocks)),  # (S_pad, max_blocks)
            logits_indices=xp.arange(size, dtype=np.int64),  # (S_pad,) constant
        )
        captured = _Captured(inputs)
        model = self.model
        # warm-up on the all-padding inputs: compiles the kernels and creates the cuBLAS handle
        # outside the capture, and writes nothing to the cache (every slot is -1)
        model.run(inputs, kv_cache)
        try:
            captured.graph, captured.logits = self.capturer.capture(
                lambda: model.run(inputs, kv_cache))
        except Exception as e:
            log.warning("cuda graph capture failed; decode steps run eagerly", size=size,
                        error=f"{type(e).__name__}: {e}")
            self.failed = True
            return None
        self._captured[size] = captured
        return captured

    def _upload(self, inputs: DeviceBatch, batch: BatchInput, size: int) -> None:
        """Pad the step's host arrays to `size` rows and copy each into its static buffer."""
        num_seqs = batch.context_lens.shape[0]
        input_ids = np.zeros(size, np.int64)  # (S_pad,)
        input_ids[:num_seqs] = batch.input_ids
        positions = np.zeros(size, np.int64)  # (S_pad,)
        positions[:num_seqs] = batch.positions
        slot_mapping = np.full(size, -1, np.int64)  # (S_pad,)
        slot_mapping[:num_seqs] = batch.slot_mapping
        context_lens = np.ones(size, np.int32)  # (S_pad,)
        context_lens[:num_seqs] = batch.context_lens
        tables = _padded_tables(size, self.max_blocks)  # (S_pad, max_blocks)
        # a decode row's table has at least one column: it overwrites the padding's block 0
        tables[:num_seqs, :batch.block_tables.shape[1]] = batch.block_tables
        upload = self.capturer.upload
        upload(inputs.input_ids, input_ids)
        upload(inputs.positions, positions)
        upload(inputs.slot_mapping, slot_mapping)
        upload(inputs.context_lens, context_lens)
        upload(inputs.block_tables, tables)
        self.capturer.end_uploads()


def _padded_tables(num_rows: int, max_blocks: int) -> np.ndarray:
    """Block tables of padding rows: block 0 holds their one token, the rest -1."""
    tables = np.full((num_rows, max_blocks), -1, np.int32)  # (S_pad, max_blocks)
    tables[:, 0] = 0
    return tables


class CudaGraphCapturer:
    """Captures with CuPy stream capture; replays on the current stream.

    Every allocation made during a capture (activations, the logits the graph writes) comes from
    a MemoryPool of its own that nothing else ever allocates from. A graph replays fixed
    addresses: had the capture allocated from the default pool, the temporaries it freed at the
    end of the capture would go back to that pool and be handed to other arrays (the next step's
    logits copy, a new block of the KV cache ...), and every replay would then overwrite them.
    In the private pool, freed capture memory is only reused by later captures, whose graphs
    replay one at a time on the same stream, and each step reads its logits right after its
    replay, so graphs overwriting each other's temporaries is harmless. The logits array of each
    graph stays referenced (GraphedDecode keeps it), so no later capture is given it.
    """

    def __init__(self) -> None:
        import cupy  # type: ignore[import-not-found]

        self._cupy = cupy
        self.pool = cupy.cuda.MemoryPool()
        # capture needs a stream other than the legacy default stream
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.staging = HostStaging(CupyStaging())

    def capture(self, step: Callable[[], Any]) -> tuple[Graph, Any]:
        cupy = self._cupy
        # the warm-up and the static buffers were made on the current stream: finish them first
        cupy.cuda.get_current_stream().synchronize()
        with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
            self.stream.begin_capture()
            try:
                out = step()
            except BaseException:
                # end the (now invalid) capture so the stream stays usable; an invalidated
                # capture reports its own error here, the step's error is the one to raise
                with contextlib.suppress(Exception):
                    self.stream.end_capture()
                raise
            graph = self.stream.end_capture()
        return _CudaGraph(graph, cupy), out

    def upload(self, dst: Any, src: np.ndarray) -> None:
        # through the static buffer's own pinned staging buffer, asynchronously on the current
        # stream, where the graph then replays: ordered without a sync
        self.staging.upload(str(dst.data.ptr), src, dst)

    def end_uploads(self) -> None:
        self.staging.end_step()


class _CudaGraph:
    def __init__(self, graph: Any, cupy: Any) -> None:
        self._graph = graph
        self._cupy = cupy

    def replay(self) -> None:
        self._graph.launch(stream=self._cupy.cuda.get_current_stream())
