"""The KV tiers in the engine step: what the pool evicts (or a policy picks) is written behind,
what a waiting sequence's prefix finds in a tier is loaded while other work runs.

Three seams, each one call: the scheduler asks `ready(seq)` before it admits a waiting sequence
(a prefix found in a tier starts loading and the sequence waits while others run; once the
pages landed they enter the prefix cache and the admission hits them) and tells `on_preempt`
(swap: the victim's blocks are written out); the runner takes `take_ops()` when it launches a
step and runs them in its device work, after the int4 window's operations and before the block
copies and the forward: gathers of blocks leaving the pool, then scatters of loaded pages, in
the order the schedule recorded them.

When a page is written: evicted from the pool (write-back, every policy); when the block is full
and cached (write_through), or hit by a second prefix lookup (write_through_selective), at the
launch after the step that computed it; a swapped-out sequence's computed blocks at once. A
load is started only when its estimated time (pages over each tier's measured bandwidth) beats
recomputing its tokens (the measured marginal cost of a token in a step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import Any

from kvcore.cache import Block, BlockHash, KVCacheManager, chain_hashes
from kvcore.cache.tiers import LoadJob, PageCopier, PageKey, TierStats, TierStore
from kvcore.engine.tier_ops import LOAD, SAVE, PrefillCost, StepOps
from kvcore.request import RequestOutput, Sequence, SequenceStatus

MAX_HIT_COUNTS = 1 << 16  # write_through_selective's hit counters kept at most
IDLE_WAIT_S = 0.05


@dataclass(slots=True)
class _Load:
    job: LoadJob
    blocks: list[Block]  # allocated for the pages, held until they land
    hashes: list[BlockHash]
    request_id: str
    # the prefix the pool already holds, held too: evicting it would orphan the pages
    pinned: list[Block]


class TierDriver:
    """Owns the engine's side of the tiers; every method runs in the engine step's thread."""

    def __init__(self, kv: KVCacheManager, store: TierStore, copier: PageCopier,
                 seqs: Mapping[str, Sequence], write_policy: str, swap: bool) -> None:
        self.kv = kv
        self.pool = kv.pool
        self.store = store
        self.copier = copier
        self.seqs = seqs  # the scheduler's unfinished sequences
        self.block_size = kv.block_size
        self.page_bytes = copier.layout.page_bytes
        self.write_policy = write_policy
        self.swap = swap
        self.pool.on_evict = self._evicted
        if write_policy == "write_through":
            self.pool.on_cache = self._cached
        self._ops = StepOps()
        self._fresh: list[tuple[Block, BlockHash]] = []  # cached while this step is scheduled
        self._computed: list[tuple[Block, BlockHash]] = []  # computed by the step launched last
        self._loads: dict[str, _Load] = {}
        self._decided: dict[str, int] = {}  # seq_id -> num_tokens its lookup was done at
        self._held: list[Block] = []  # landed pages' blocks, held until the next launch
        self._hits: OrderedDict[BlockHash, int] = OrderedDict()  # write_through_selective
        self._restored: dict[str, dict[str, int]] = {}  # request_id -> tier -> tokens
        self._step_tokens = 0
        self._launched = False
        self.step_cost = PrefillCost()  # what recomputing a token costs, measured
        self.num_loads_skipped = 0  # lookups that found pages but recomputing was cheaper
        self.closed = False

    # --- the scheduler's seam ---

    def ready(self, seq: Sequence) -> bool:
        """Whether a waiting sequence may be admitted now: False while its prefix loads."""
        if self.closed:
            return True
        load = self._loads.get(seq.seq_id)
        if load is not None:
            if not load.job.done.is_set():
                return False
            del self._loads[seq.seq_id]
            self._land(load, True)
            self._decided[seq.seq_id] = seq.num_tokens
            return True
        if self._decided.get(seq.seq_id) == seq.num_tokens:
            return True
        self._decided[seq.seq_id] = seq.num_tokens
        if seq.num_preemptions and not self.swap:
            return True  # preemption by recompute
        return not self._start_load(seq)

    def on_preempt(self, seq: Sequence) -> None:
        """Swap out: the victim's computed blocks that only it holds are written now."""
        self._decided.pop(seq.seq_id, None)
        if not self.swap or self.closed:
            return
        blocks = self.pool.blocks
        num_full = seq.num_computed_tokens // self.block_size
        for block_id in self.kv.block_ids(seq.seq_id)[:num_full]:
            block = None if block_id is None else blocks[block_id]
            if (block is not None and block.ref_count == 1 and block.block_hash is not None
                    and self.store.wants(block.block_hash)):
                assert block.token_bytes is not None
                self._ops.save(block.block_id, (block.block_hash, block.token_bytes))

    # --- the runner's seam ---

    def take_ops(self, num_batched_tokens: int) -> Callable[[], None] | None:
        """The tier operations of the step being launched (None: none), as one callable for
        its device work; also the end of this step's scheduling for the driver's state."""
        self._launched = True
        self._step_tokens = num_batched_tokens
        if self.closed:
            return None
        self._release_held()
        window = self.kv.window
        pending: list[tuple[Block, BlockHash]] = []
        for block, block_hash in self._computed:
            if block.block_hash != block_hash:
                continue  # evicted or uncached meanwhile (an eviction saves it itself)
            if window is not None and window.slot_of[block.block_id] is not None:
                pending.append((block, block_hash))  # int4: its rows are written once sealed
            elif self.store.wants(block_hash):
                assert block.token_bytes is not None
                self._ops.save(block.block_id, (block_hash, block.token_bytes))
        self._computed, self._fresh = pending + self._fresh, []
        ops, self._ops = self._ops, StepOps()
        if not ops.items:
            return None
        work = []
        for kind, block_ids, items in ops.items:
            if kind == LOAD or self.store.room(len(block_ids)):
                work.append((kind, block_ids, items))
            else:
                self.store.drop(len(block_ids))  # full queues: not even gathered
        copier, store = self.copier, self.store

        def run() -> None:
            for kind, block_ids, items in work:
                if kind == SAVE:
                    store.store(items, copier.gather(block_ids))
                else:
                    copier.scatter(block_ids, items)
        return run

    # --- the engine's seam ---

    def after_step(self, seconds: float, outputs: Sequence_[RequestOutput]) -> None:
        """After Engine.step: its launch's tokens and `seconds` feed the step-cost fit; each
        output names the tokens its request restored from each tier; a step that launched
        nothing while pages load waits for the first to land (up to IDLE_WAIT_S) rather than
        spinning through empty steps."""
        tokens, self._step_tokens = self._step_tokens, 0
        if tokens:
            self.step_cost.observe(tokens, seconds)
        for output in outputs:
            record = (self._restored.pop(output.request_id, None) if output.finished
                      else self._restored.get(output.request_id))
            if record:
                output.metrics.restored_tokens = dict(record)
        self._release_held()
        launched, self._launched = self._launched, False
        if not launched and self._loads:
            next(iter(self._loads.values())).job.done.wait(IDLE_WAIT_S)

    def forget(self, request_id: str) -> None:
        """The request was aborted: its loads' blocks go back at once (the loader reads into
        its own buffer, never into them), and its outputs no longer pass through after_step."""
        self._restored.pop(request_id, None)
        for seq_id, load in list(self._loads.items()):
            if load.request_id == request_id:
                del self._loads[seq_id]
                for block in (*load.blocks, *load.pinned):
                    self.pool.free(block)

    @property
    def prefill_rate(self) -> float | None:
        """Prompt tokens per second that recomputing costs (None: not measured yet)."""
        per_token = self.step_cost.per_token
        return None if per_token is None else 1.0 / per_token

    def stats(self) -> TierStats:
        return self.store.stats(self.block_size)

    def snapshot(self) -> dict[str, Any]:
        """The KV inspector's view: each tier's occupancy, loads in flight, the rates."""
        return {"tiers": self.store.occupancy(), "loads_in_flight": len(self._loads),
                "prefill_tokens_per_s": self.prefill_rate,
                "bandwidth": dict(self.store.counters.bandwidth),
                "write_policy": self.write_policy, "swap": self.swap}

    def close(self, timeout: float = 30.0) -> None:
        """Let queued writes land, stop the tiers' threads; the pool no longer reports to
        the driver, and nothing waits for a load again."""
        self.pool.on_evict = self.pool.on_cache = None
        self.closed = True
        self.store.close(timeout)

    # --- inside ---

    def _evicted(self, block: Block, block_hash: BlockHash, token_bytes: bytes) -> None:
        if self.store.wants(block_hash):
            self._ops.save(block.block_id, (block_hash, token_bytes))

    def _cached(self, block: Block) -> None:
        assert block.block_hash is not None
        self._fresh.append((block, block.block_hash))

    def _start_load(self, seq: Sequence) -> bool:
        """Look a waiting sequence's prefix up past the pool; start loading what the tiers
        hold when that beats recomputing it. True: it loads (the sequence waits)."""
        if not self.kv.enable_prefix_caching:
            return False
        bs = self.block_size
        tokens = seq.token_ids
        hashes = chain_hashes(tokens, bs, seq.cache_salt, (len(tokens) - 1) // bs)
        cached = self.pool.cached
        pack = self.pool.pack_tokens
        hits: list[Block] = []
        for i, block_hash in enumerate(hashes):
            block = cached.get(block_hash)
            if block is None or block.token_bytes != pack(tokens[i * bs:(i + 1) * bs]):
                break
            hits.append(block)
            if self.write_policy == "write_through_selective":
                self._count_hit(block, block_hash)
        num_pool = len(hits)
        found = self.store.find(hashes[num_pool:])
        if not found:
            return False
        # the pool's prefix is held while the pages load (evicting it would orphan them; a
        # block some sequence holds cannot be evicted, and a free one is sealed, int4 or not)
        pinned = [block for block in hits if block.ref_count == 0]
        # as many pages as the pool takes, leaving a block for each running sequence's next
        # token and one for this one's first chunk
        running = sum(s.status is SequenceStatus.RUNNING for s in self.seqs.values())
        num_pages = min(len(found), self.pool.num_free_blocks - len(pinned) - running - 1)
        if num_pages <= 0:
            self._decided.pop(seq.seq_id, None)  # the pool cannot take them yet: look again
            return False
        found = found[:num_pages]
        load_s = sum(self.page_bytes / self.store.bandwidth(t) for t in found)
        per_token = self.step_cost.per_token  # None: not measured yet, loads go ahead
        if per_token is not None and load_s >= num_pages * bs * per_token:
            self.num_loads_skipped += 1
            return False
        for block in pinned:
            self.pool.touch(block)
        blocks = self.pool.allocate(num_pages)  # evictions queue their saves first
        assert blocks is not None
        keys: list[PageKey] = [
            (hashes[i], pack(tokens[i * bs:(i + 1) * bs]))
            for i in range(num_pool, num_pool + num_pages)]
        self._loads[seq.seq_id] = _Load(self.store.load(keys), blocks,
                                        hashes[num_pool:num_pool + num_pages], seq.request_id,
                                        pinned)
        return True

    def _count_hit(self, block: Block, block_hash: BlockHash) -> None:
        count = self._hits.pop(block_hash, 0) + 1
        self._hits[block_hash] = count
        if count == 2:
            self._fresh.append((block, block_hash))
        while len(self._hits) > MAX_HIT_COUNTS:
            self._hits.popitem(last=False)

    def _land(self, load: _Load, waiting: bool) -> None:
        """Landed pages enter the prefix cache (for a waiting sequence held until its
        admission, about to run, found them); their scatter runs before the next forward; the
        rest of the blocks go back to the pool (their tokens are recomputed)."""
        job = load.job
        restored: dict[str, int] = (self._restored.setdefault(load.request_id, {}) if waiting
                                    else {})
        held = self._held if waiting else []
        ids: list[int] = []
        rows: list[int] = []
        for i, block in enumerate(load.blocks):
            if i < job.num_loaded and self.pool.register(block, load.hashes[i], job.keys[i][1]):
                ids.append(block.block_id)
                rows.append(i)
                held.append(block)
                tier = job.tiers[i]
                restored[tier] = restored.get(tier, 0) + self.block_size
            else:
                self.pool.free(block)
        held.extend(load.pinned)
        if not waiting:
            for block in held:
                self.pool.free(block)
        if ids:
            self._ops.load(ids, job.pages if len(rows) == len(job.pages) else job.pages[rows])

    def _release_held(self) -> None:
        """The schedule that wanted the landed pages is over: they stay cached, unheld."""
        for block in self._held:
            self.pool.free(block)
        self._held = []
        self._settle_orphans()

    def _settle_orphans(self) -> None:
        """Loads whose sequence left the queue (admitted without them, finished, aborted):
        landed ones still enter the prefix cache; forget stale lookups."""
        for seq_id, load in list(self._loads.items()):
            seq = self.seqs.get(seq_id)
            if (seq is None or seq.status is not SequenceStatus.WAITING) and (
                    load.job.done.is_set()):
                del self._loads[seq_id]
                self._land(load, False)
        if len(self._decided) > 2 * len(self.seqs) + 64:
            self._decided = {k: v for k, v in self._decided.items() if k in self.seqs}
