"""A plain-Python radix tree of token prefixes with KV on every node and KDA checkpoints on some.

In the server the tree is SGLang's ``UnifiedRadixCache`` (Rust core) fed with grid checkpoints by
:mod:`sglang_kda.cache.insert`. The simulator (:mod:`sglang_kda.sim`) and unit tests need a
model of it that runs without tensors or SGLang; this is it, with the same rules:

* A node holds the KV of its edge (the tokens from its parent's end to its own end); the path
  root -> node is a cached prefix. A node may also hold a **checkpoint**: the KDA state after the
  tokens of its whole path. A checkpoint is usable only while the KV of its path is cached, which
  holds by construction (a checkpoint lives on the node that ends at its position; removing a
  node's KV removes the node and its checkpoint).
* :meth:`RadixTree.match`: the deepest node *with a checkpoint* on the prompt's path, at most
  ``limit`` tokens deep (callers pass ``len(prompt) - 1``: the engine recomputes at least the last
  prompt token). The KV match (which may go deeper, even mid-edge) is reported separately.
* :meth:`RadixTree.insert`: caches the KV of a token path and checkpoints at given positions
  (the caller chooses them: every grid point inside a computed slice plus chunk ends for the
  ``kda`` policy; chunk ends and the end of a finished request for ``stock``). Inserting splits
  edges so that a node ends at every checkpoint position.
* Locks (:meth:`lock` / :meth:`unlock`): a running request locks the node it resumed from. A lock
  protects the KV of the whole path root -> node (a node with a lock at or below it is never a
  leaf to evict) and the checkpoint of the node itself (SGLang locks the FULL component along
  the path, the MAMBA component on the node only).
* Eviction (:meth:`evict`): checkpoint pressure drops checkpoints only (never KV), KV pressure
  drops unlocked leaves (with their checkpoints), least recently used first (ties: deepest
  first, as leaves go before their ancestors). Which *checkpoints* go is the server's rule,
  ``--kda-eviction`` (``alpha``): ``None`` is SGLang's LRU as above; a number calls
  :func:`sglang_kda.cache.eviction.pick_victims` (recency + ``alpha`` x serial work saved per
  byte, one victim at a time with rescoring) through the module object, on the unlocked
  checkpoints, each with its nearest checkpointed ancestor (locked or not) and the tick of its
  last insert or hit (:attr:`Node.state_access`, what the server's ``StateBook`` records).
  ``max_checkpoints`` caps the checkpoints held (``--kda-checkpoint-pool-size``): an insert past
  the cap evicts (``insert(..., enforce=False)`` defers it to :meth:`enforce_caps`, as the
  server sheds states once after a prefill step); ``max_tokens`` caps the KV tokens held.
* :meth:`integrity`: walks the tree; see its docstring.

Recency is a logical clock (one tick per operation), so runs are deterministic.

Eviction costs what the evictions cost, not a walk of the tree: the tree keeps, incrementally,
each node's recency (the most recent access in its subtree), each checkpoint's distance to its
nearest checkpointed ancestor (the rule's saved work), the checkpoints in the order of their
last insert or hit, each checkpoint's heirs (the checkpoints that have it as nearest checkpointed
ancestor: none makes it a branch end) and how many of them are branch ends (the two set the
rule's bonus, ``eviction.BONUS``), and lazy heaps of the LRU candidates (checkpoints; unlocked
leaves). The victims are the ones the old walk picked, in the same order
(``tests/sim/test_tree_fast.py`` checks it against the walk, kept there as the reference).
``eviction.pick_victims`` is evaluated incrementally (:meth:`RadixTree._pick_by_rule`: the same
float operations on the candidates that can win); when a test or an experiment swaps the
module's function, the tree walks and calls it.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

# Called through the module object: a test that swaps the rule sees the change.
from sglang_kda.cache import eviction as eviction_mod

_RULE = eviction_mod.pick_victims  # the rule the incremental pick reproduces


class TreeIntegrityError(AssertionError):
    pass


@dataclass(eq=False)
class Node:
    key: tuple = ()
    parent: Optional["Node"] = None
    children: dict = field(default_factory=dict)
    depth: int = 0  # tokens on the path root -> end of this node
    checkpoint: bool = False
    lock_own: int = 0  # locks taken on this very node (a lock protects the path above it too)
    last_access: int = 0
    serial: int = 0  # creation order: a deterministic tie-break
    state_access: int = 0  # tick of the checkpoint's last insert or hit (the eviction rule's)
    recency: int = 0  # the most recent last_access in this node's subtree (LRU's key)
    gap: int = 0  # checkpoint: depth - depth of the nearest checkpointed ancestor (root: 0)
    heirs: int = 0  # checkpoint: checkpoints that have it as their nearest checkpointed ancestor
    end_heirs: int = 0  # checkpoint: how many of its heirs are branch ends (have no heirs)
    filed: tuple = ()  # unlocked checkpoint: its key in the rule's index (see ``_key``)
    host: bool = False  # its state is on the host tier only (``host_checkpoints``)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Node(depth={self.depth}, len={len(self.key)}, ckpt={self.checkpoint})"


@dataclass(frozen=True)
class Match:
    """Result of :meth:`RadixTree.match`.

    node / length: the deepest node with a checkpoint within the limit, and its depth (root, 0
        when none).
    kv_length: tokens of the prompt whose KV is cached (may end mid-edge, >= ``length``).
    """

    node: Node
    length: int
    kv_length: int


@dataclass
class TreeStats:
    checkpoints_inserted: int = 0
    checkpoints_evicted: int = 0
    tokens_evicted: int = 0
    nodes_evicted: int = 0
    host_moved: int = 0  # states the device cap shed that the host tier kept
    host_promotions: int = 0  # host-only states loaded back on a match
    host_evicted: int = 0  # host-only states the host cap dropped (KV evictions not counted)


class RadixTree:
    """See the module docstring.

    max_checkpoints: cap on checkpoints held (``None``: unbounded).
    max_tokens: cap on KV tokens held (``None``: unbounded).
    alpha: which checkpoints go under checkpoint pressure: ``None`` LRU, else the weight of
        serial work saved per byte in :func:`sglang_kda.cache.eviction.pick_victims`
        (``eviction.parse_eviction`` of ``--kda-eviction``).
    state_nbytes / kda_layers: one state's bytes and the model's KDA layers (the rule's value
        per byte; a constant for one model, so only their ratio to other candidates matters).
    host_checkpoints: the host tier's state slots (SGLang's HiCache host state pool; 0: no host
        tier). Write-through, as the server runs it: every device state has its copy on the
        host, so the host holds the device's states plus up to ``host_checkpoints`` minus those
        host-only ones. A state the device cap sheds stays on the host (host-only, not counted
        in :attr:`n_checkpoints`); a match may end on it (``promote``), which loads it back to
        the device (counted in :attr:`promotions`, for the caller to charge the load time) and
        may push the device over its cap until the next :meth:`enforce_caps`. The host frees
        slots for new states' copies before the device sheds (as the write-through copy is
        taken at insert), oldest host-only state first (SGLang's host LRU by the state's last
        insert or hit; the server applies ``--kda-eviction`` there, the simulator does not).
        A KV eviction removes a node with its host-only state (the host tier holds states only).
    """

    def __init__(
        self,
        max_checkpoints: int | None = None,
        max_tokens: int | None = None,
        alpha: float | None = None,
        state_nbytes: int = 1,
        kda_layers: int = 1,
        host_checkpoints: int = 0,
    ):
        if alpha is not None and not alpha >= 0:
            raise ValueError("alpha must be None (LRU) or >= 0")
        if max_checkpoints is not None and max_checkpoints < 0:
            raise ValueError("max_checkpoints must be >= 0")
        if max_tokens is not None and max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if host_checkpoints < 0:
            raise ValueError("host_checkpoints must be >= 0")
        self.root = Node()
        self.host_checkpoints = int(host_checkpoints)
        self.n_host = 0  # host-only states
        self.promotions = 0  # host loads since the caller last took them (take_promotions)
        self.max_checkpoints = max_checkpoints
        self.max_tokens = max_tokens
        self.alpha = alpha
        self.state_nbytes = state_nbytes
        self.kda_layers = kda_layers
        self.n_checkpoints = 0
        self.n_tokens = 0
        self.clock = 0
        self._serial = 0
        self.stats = TreeStats()
        self._index_reset()

    def _index_reset(self) -> None:
        # checkpointed nodes, oldest state_access first (ties: shallower first, as inserted)
        self._ckpts: OrderedDict = OrderedDict()
        # (branch end?, above a branch end?, fork?, gap) -> count, over the unlocked checkpoints
        self._gaps: dict = {}
        # the same key -> heap of (state_access, depth, serial, node) of the unlocked
        # checkpoints under it, lazy (an entry whose node moved on is dropped at the top)
        self._by_gap: dict = {}
        self._by_gap_entries = 0
        self._lru_ckpt: list = []  # (recency, -depth, serial, seq, node), lazy
        self._lru_leaf: list = []  # the same, for unlocked leaves
        self._seq = itertools.count()
        self._host_heap: list = []  # (state_access, -depth, serial, node) of host-only, lazy

    # -- helpers ------------------------------------------------------------------------------
    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _touch(self, node: Node, t: int) -> None:
        node.last_access = t
        self._bump(node, t)

    @staticmethod
    def _bump(node: Optional[Node], t: int) -> None:
        """``t`` is the newest tick: the recency of ``node`` and of every ancestor."""
        while node is not None and node.recency < t:
            node.recency = t
            node = node.parent

    # -- the incremental eviction index -------------------------------------------------------
    def _push(self, heap: list, node: Node) -> None:
        heapq.heappush(heap, (node.recency, -node.depth, node.serial, next(self._seq), node))

    @staticmethod
    def _key(node: Node) -> tuple:
        """A checkpoint's place in the rule's index: what sets its bonus (``eviction.Bonus``:
        branch end, above a branch end, fork) and its gap (its saved work)."""
        return (node.heirs == 0, node.end_heirs > 0, node.heirs >= 2, node.gap)

    def _gap_add(self, node: Node) -> None:
        """``node`` (an unlocked checkpoint) joins the candidates of its key (:meth:`_key`)."""
        key = node.filed = self._key(node)
        self._gaps[key] = self._gaps.get(key, 0) + 1
        self._file(node)

    def _file(self, node: Node) -> None:
        heap = self._by_gap.get(node.filed)
        if heap is None:
            heap = self._by_gap[node.filed] = []
        heapq.heappush(heap, (node.state_access, node.depth, node.serial, node))
        self._by_gap_entries += 1

    def _gap_remove(self, node: Node) -> None:
        key = node.filed
        c = self._gaps[key] - 1
        if c:
            self._gaps[key] = c
        else:
            del self._gaps[key]
            self._by_gap_entries -= len(self._by_gap.pop(key, ()))

    def _oldest(self, key: tuple) -> Node:
        """The unlocked checkpoint filed under ``key`` with the oldest (state_access, depth)."""
        heap = self._by_gap[key]
        while True:
            t, _, _, n = heap[0]
            if n.checkpoint and n.lock_own == 0 and n.filed == key and n.state_access == t:
                return n
            heapq.heappop(heap)
            self._by_gap_entries -= 1

    def _set_gap(self, node: Node, gap: int) -> None:
        if node.lock_own == 0:
            self._gap_remove(node)
            node.gap = gap
            self._gap_add(node)
        else:
            node.gap = gap

    def _add_heirs(self, node: Optional[Node], k: int, ends: int) -> None:
        """``node`` (a checkpoint, or None: the root) gains ``k`` heirs, ``ends`` of them branch
        ends (either may be negative); a change of key refiles it, and a change of its being a
        branch end changes its own ancestor's count of branch-end heirs."""
        if node is None or (k == 0 and ends == 0):
            return
        was, before = node.heirs == 0, self._key(node)
        node.heirs += k
        node.end_heirs += ends
        if node.lock_own == 0 and self._key(node) != before:
            self._gap_remove(node)
            self._gap_add(node)
        if (node.heirs == 0) != was:
            self._add_heirs(self._ancestor(node), 0, -1 if was else 1)

    @staticmethod
    def _ancestor(node: Node) -> Optional[Node]:
        """The nearest checkpointed proper ancestor (None: the root)."""
        p = node.parent
        while p is not None and not p.checkpoint:
            p = p.parent
        return p

    @classmethod
    def _ancestor_depth(cls, node: Node) -> int:
        """Depth of the nearest checkpointed proper ancestor (the root: 0)."""
        p = cls._ancestor(node)
        return 0 if p is None else p.depth

    @staticmethod
    def _heirs(node: Node) -> list:
        """The checkpoints below ``node`` with no checkpoint between them and it."""
        out, stack = [], list(node.children.values())
        while stack:
            c = stack.pop()
            if c.checkpoint:
                out.append(c)
            else:
                stack.extend(c.children.values())
        return out

    def _add_checkpoint(self, node: Node) -> None:
        node.checkpoint = True
        self.n_checkpoints += 1
        anc = self._ancestor(node)
        node.gap = node.depth - (0 if anc is None else anc.depth)
        heirs = self._heirs(node)
        node.heirs = len(heirs)
        node.end_heirs = sum(1 for h in heirs if h.heirs == 0)
        self._ckpts[node] = None
        if node.lock_own == 0:
            self._gap_add(node)
            self._push(self._lru_ckpt, node)
        for h in heirs:
            self._set_gap(h, h.depth - node.depth)
        # its heirs below ``node`` are now ``node``'s, and ``node`` is its heir
        self._add_heirs(anc, 1 - len(heirs), int(node.heirs == 0) - node.end_heirs)

    def _drop_checkpoint(self, node: Node) -> None:
        node.checkpoint = False
        self.n_checkpoints -= 1
        del self._ckpts[node]
        if node.lock_own == 0:
            self._gap_remove(node)
        above = node.depth - node.gap
        for h in self._heirs(node):
            self._set_gap(h, h.depth - above)
        ends = node.end_heirs - int(node.heirs == 0)
        self._add_heirs(self._ancestor(node), node.heirs - 1, ends)
        node.heirs = node.end_heirs = 0

    def _state_touched(self, node: Node, t: int) -> None:
        node.state_access = t
        self._ckpts.move_to_end(node)
        if node.lock_own == 0:
            self._file(node)

    # -- the host tier ------------------------------------------------------------------------
    def _shed(self, node: Node) -> None:
        """The device cap drops ``node``'s state; with a host tier its copy stays there."""
        self._drop_checkpoint(node)
        if self.host_checkpoints and self.n_host + self.n_checkpoints < self.host_checkpoints:
            node.host = True
            self.n_host += 1
            self.stats.host_moved += 1
            heapq.heappush(self._host_heap, (node.state_access, -node.depth, node.serial, node))

    def _host_forget(self, node: Node) -> None:
        """``node``'s host-only state leaves the host-only set (loaded back, recomputed on the
        device, or its node evicted); heap entries are dropped lazily."""
        node.host = False
        self.n_host -= 1

    def _host_evict(self, n: int) -> int:
        """Drop up to ``n`` host-only states, oldest (state_access) first, deeper first."""
        done = 0
        heap = self._host_heap
        while done < n and heap:
            t, _, _, node = heapq.heappop(heap)
            if not node.host or node.state_access != t:
                continue
            self._host_forget(node)
            done += 1
        self.stats.host_evicted += done
        if len(heap) > 4 * (self.n_host + 64):
            self._host_heap = [e for e in heap if e[3].host and e[3].state_access == e[0]]
            heapq.heapify(self._host_heap)
        return done

    def _promote(self, node: Node) -> None:
        """Load ``node``'s host-only state back into the device tier."""
        self._host_forget(node)
        self._add_checkpoint(node)
        self.stats.host_promotions += 1
        self.promotions += 1

    def take_promotions(self) -> int:
        """Host loads since the last call (the caller charges their time), reset to 0."""
        n, self.promotions = self.promotions, 0
        return n

    def _walk(self) -> tuple[list, dict, dict]:
        """Post-order figures of every node: (nodes, recency = the most recent access in its
        subtree, locked = a lock on it or below)."""
        order = self.nodes()
        recency: dict = {}
        locked: dict = {}
        for n in reversed(order):  # children before parents (``nodes`` is a pre-order)
            r, lk = n.last_access, n.lock_own > 0
            for c in n.children.values():
                r = max(r, recency[id(c)])
                lk = lk or locked[id(c)]
            recency[id(n)], locked[id(n)] = r, lk
        return order, recency, locked

    def locks_held(self) -> int:
        return sum(n.lock_own for n in self.nodes())

    @staticmethod
    def _common(key: tuple, ids: Sequence[int], start: int, stop: int | None = None) -> int:
        """Length of the common prefix of ``key`` and ``ids[start:stop]`` (slice compares run in
        C: one for a full match, a binary search otherwise; edges can be 1M tokens long)."""
        n = min(len(key), (len(ids) if stop is None else stop) - start)
        if n <= 0 or key[0] != ids[start]:
            return 0
        ids = tuple(ids[start : start + n])
        if key[:n] == ids:
            return n
        lo, hi = 1, n - 1  # key[:lo] == ids[:lo]; key[:hi + 1] != ids[:hi + 1]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key[:mid] == ids[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, node: Node, at: int) -> Node:
        """Split ``node``'s edge after ``at`` tokens; returns the new upper node."""
        assert 0 < at < len(node.key)
        parent = node.parent
        self._serial += 1
        upper = Node(
            serial=self._serial,
            key=node.key[:at],
            parent=parent,
            depth=node.depth - len(node.key) + at,
            last_access=node.last_access,
            recency=node.recency,
        )
        parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    # -- queries ------------------------------------------------------------------------------
    def match(
        self,
        ids: Sequence[int],
        limit: int | None = None,
        start: Node | None = None,
        promote: bool = True,
    ) -> Match:
        """Deepest checkpointed node on ``ids``' path at most ``limit`` tokens deep.

        ``limit`` defaults to ``len(ids) - 1``. Touches the matched path (recency).
        ``start``: a node known to lie on ``ids``' path (e.g. one the request locks); the walk
        begins there and only checkpoints from it down are considered (a shortcut for long
        paths: an in-flight request looks for checkpoints past its progress).
        ``promote``: with a host tier, a host-only state counts as a checkpoint and the match
        loads it back (:meth:`_promote`); False (a router's look) sees the device tier only.
        """
        limit = len(ids) - 1 if limit is None else min(limit, len(ids))
        node = self.root if start is None else start
        pos = node.depth
        host = promote and self.n_host > 0
        best = node if node.checkpoint and node.depth <= limit else self.root
        kv = pos
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = self._common(child.key, ids, pos)
            kv = pos + n
            if n < len(child.key):
                break
            node, pos = child, pos + n
            if (node.checkpoint or (host and node.host)) and node.depth <= limit:
                best = node
        if best.host:
            self._promote(best)
        t = self._tick()
        self._touch(best, t)
        if best.checkpoint:  # a hit: the state's recency for the eviction rule
            self._state_touched(best, t)
        return Match(best, best.depth, kv)

    def path_ids(self, node: Node) -> tuple:
        parts = []
        while node is not None and node is not self.root:
            parts.append(node.key)
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)

    def nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def checkpoint_positions(self, ids: Sequence[int]) -> list[int]:
        """Depths of the checkpoints on ``ids``' path (fully matched nodes only)."""
        node, pos, out = self.root, 0, []
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = self._common(child.key, ids, pos)
            if n < len(child.key):
                break
            node, pos = child, pos + n
            if node.checkpoint:
                out.append(node.depth)
        return out

    # -- updates ------------------------------------------------------------------------------
    def insert(
        self,
        ids: Sequence[int],
        checkpoints: Iterable[int] = (),
        start: Node | None = None,
        end: int | None = None,
        enforce: bool = True,
    ) -> int:
        """Cache the KV of ``ids`` and checkpoints at the given positions (``0 < p <= len``).

        Returns how many checkpoints were new. Enforces the caps afterwards (LRU: what was just
        inserted is the most recent, evicted only when nothing older can go). ``start``: a node
        known to lie on ``ids``' path; the walk begins there (marks above it are ignored).
        ``end``: insert ``ids[:end]`` (without copying a long prompt each round).
        ``enforce``: False leaves the caps to a later :meth:`enforce_caps`.
        """
        ids = tuple(ids)
        n_ids = len(ids) if end is None else min(end, len(ids))
        node = self.root if start is None else start
        pos = node.depth
        marks = sorted({int(p) for p in checkpoints if pos < int(p) <= n_ids})
        t = self._tick()
        new = 0
        mi = 0
        created: list = []
        while pos < n_ids:
            # The end of this step: the next checkpoint mark or the end of the ids.
            while mi < len(marks) and marks[mi] <= pos:
                mi += 1
            child = node.children.get(ids[pos])
            if child is None:
                stop = marks[mi] if mi < len(marks) else n_ids
                self._serial += 1
                child = Node(ids[pos:stop], node, depth=stop, last_access=t, serial=self._serial)
                node.children[ids[pos]] = child
                self.n_tokens += stop - pos
                created.append(child)
            else:
                n = self._common(child.key, ids, pos, n_ids)
                stop_mark = marks[mi] - pos if mi < len(marks) else None
                if stop_mark is not None and stop_mark < n:
                    n = stop_mark
                if n < len(child.key):
                    child = self._split(child, n)
            child.last_access = t
            node, pos = child, child.depth
            if mi < len(marks) and marks[mi] == pos:
                if not node.checkpoint:
                    if node.host:  # computed again: the device holds it, its host copy backs it
                        self._host_forget(node)
                    self._add_checkpoint(node)
                    new += 1
                self._state_touched(node, t)
        self._touch(node, t)  # the recency of the whole path
        for c in created:
            if not c.children:
                self._push(self._lru_leaf, c)
        self.stats.checkpoints_inserted += new
        if enforce:
            self.enforce_caps()  # LRU: what was just inserted goes last
        return new

    def lock(self, node: Node) -> Node:
        node.lock_own += 1
        if node.lock_own == 1 and node.checkpoint:
            self._gap_remove(node)
        return node

    def unlock(self, node: Node) -> None:
        if node.lock_own <= 0:
            raise TreeIntegrityError("unlock of a node that is not locked")
        node.lock_own -= 1
        if node.lock_own == 0:
            if node.checkpoint:
                self._gap_add(node)
                self._push(self._lru_ckpt, node)
            if not node.children and node is not self.root:
                self._push(self._lru_leaf, node)

    def enforce_caps(self) -> int:
        """Evict down to the caps (checkpoints by the tree's rule, KV by LRU). With a host
        tier, first the host frees the slots the new states' copies took (write-through: the
        device's states and the host-only ones share the host pool). Returns the checkpoints
        held."""
        if self.n_host and self.n_host + self.n_checkpoints > self.host_checkpoints:
            self._host_evict(self.n_host + self.n_checkpoints - self.host_checkpoints)
        if self.max_checkpoints is not None and self.n_checkpoints > self.max_checkpoints:
            self.evict(checkpoints=self.n_checkpoints - self.max_checkpoints)
        if self.max_tokens is not None and self.n_tokens > self.max_tokens:
            self.evict(tokens=self.n_tokens - self.max_tokens)
        return self.n_checkpoints

    # -- the scheduler's interface (sglang_kda.cache.tree_api.CheckpointTree) ------------------
    # A request here is anything with ``ids`` (its prompt), ``prefix`` (prompt tokens done) and
    # ``node`` (the node it locks, or None), as the simulator's SimReq; its match limit is
    # ``len(ids) - 1`` (the last prompt token is always computed).
    def probe(self, req) -> int:
        """What the admission match would grant ``req`` now, without touching the tree (no
        recency, no host promotion): the deepest device checkpoint on its path within its
        limit, as :func:`sglang_kda.cache.probe.cached_prefix` reads the server's."""
        limit = len(req.ids) - 1
        return max((d for d in self.checkpoint_positions(req.ids) if d <= limit), default=0)

    def relock(self, req, node: Node) -> None:
        """``req``'s lock moves to ``node``."""
        self.lock(node)
        if req.node is not None:
            self.unlock(req.node)
        req.node = node

    def resume(self, req) -> int:
        """The in-flight chunked ``req`` re-matches from the node it locks and jumps to the
        deepest checkpoint past its progress (its ``prefix`` and lock move there); returns the
        tokens skipped."""
        m = self.match(req.ids, len(req.ids) - 1, start=req.node)
        if m.length <= req.prefix:
            return 0
        skipped = m.length - req.prefix
        req.prefix = m.length
        self.relock(req, m.node)
        return skipped

    def check(self, live) -> dict:
        """:meth:`integrity`, expecting one lock per ``live`` request that holds one."""
        return self.integrity(expected_locks=sum(1 for r in live if r.node is not None))

    def evict(self, checkpoints: int = 0, tokens: int = 0) -> tuple[int, int]:
        """Evict at least ``checkpoints`` checkpoints (by the tree's rule: LRU, or
        ``eviction.pick_victims`` with ``alpha``) and ``tokens`` KV tokens (LRU).

        Checkpoint pressure evicts checkpoints only (their KV stays, for other requests' KV
        matches); KV pressure evicts least recently used unlocked leaves, each taking its
        checkpoint with it (a state is never kept without its KV). Returns
        ``(checkpoints evicted, tokens evicted)``; less than asked when everything left is
        locked.

        LRU keys are (recency, deeper first, creation order), the recency of a node being the
        most recent access in its subtree as it stood when the call began (a parent left a leaf
        by the call is keyed by its recency with the children it had).
        """
        done_c = done_t = 0
        if checkpoints <= 0 and tokens <= 0:
            return 0, 0
        if checkpoints > 0 and self.alpha is not None:
            done_c = self._evict_by_rule(checkpoints)
        elif checkpoints > 0:
            heap = self._lru_ckpt
            while heap and done_c < checkpoints:
                n = self._pop_lru(heap, lambda n: n.checkpoint and n.lock_own == 0)
                if n is None:
                    break
                self._shed(n)
                done_c += 1
            self._maybe_rebuild()
        if tokens > 0:
            heap = self._lru_leaf
            parents = []
            while heap and done_t < tokens:
                n = self._pop_lru(heap, self._is_leaf_candidate)
                if n is None:
                    break
                parent = n.parent
                if n.checkpoint:
                    self._drop_checkpoint(n)  # a leaf: no heirs
                    done_c += 1
                elif n.host:  # the host tier holds states, not KV: its state goes too
                    self._host_forget(n)
                del parent.children[n.key[0]]
                n.parent = None
                self.n_tokens -= len(n.key)
                done_t += len(n.key)
                self.stats.nodes_evicted += 1
                parents.append(parent)
                if parent is not self.root and not parent.children and parent.lock_own == 0:
                    self._push(heap, parent)  # keyed by its recency before the call
            self._recompute_recency(parents)
            self._maybe_rebuild()
        self.stats.checkpoints_evicted += done_c
        self.stats.tokens_evicted += done_t
        return done_c, done_t

    def _is_leaf_candidate(self, n: Node) -> bool:
        return n.parent is not None and not n.children and n.lock_own == 0

    def _pop_lru(self, heap: list, valid) -> Optional[Node]:
        """The valid node with the lowest (recency, -depth, serial). Entries are lazy: a node's
        recency only grows between calls unless :meth:`_recompute_recency` lowers it (which
        pushes a fresh entry), so an entry below the node's recency is re-pushed at it and one
        above is stale (the node has a lower entry)."""
        while heap:
            rec, nd, serial, _, n = heapq.heappop(heap)
            if not valid(n):
                continue
            if rec < n.recency:
                heapq.heappush(heap, (n.recency, nd, serial, next(self._seq), n))
                continue
            if rec > n.recency:
                continue
            return n
        return None

    def _recompute_recency(self, parents: list) -> None:
        """After KV evictions: the recency of the nodes that lost children (and of their
        ancestors) is the most recent access in what is left below them."""
        todo = {id(p): p for p in parents if p.parent is not None or p is self.root}
        heap = [(-p.depth, p.serial, p) for p in todo.values()]
        heapq.heapify(heap)
        done: set = set()
        while heap:
            _, _, p = heapq.heappop(heap)
            if id(p) in done:
                continue
            done.add(id(p))
            r = max([p.last_access] + [c.recency for c in p.children.values()])
            if r == p.recency:
                continue
            p.recency = r
            if p is self.root or p.parent is None:
                continue
            if p.lock_own == 0:
                if p.checkpoint:
                    self._push(self._lru_ckpt, p)
                if not p.children:
                    self._push(self._lru_leaf, p)
            q = p.parent
            if id(q) not in done:
                heapq.heappush(heap, (-q.depth, q.serial, q))

    def _maybe_rebuild(self) -> None:
        """Drop the lazy heaps' dead entries once they outnumber the live ones."""
        live = len(self._ckpts) + 64
        if self._by_gap_entries > 4 * live:
            self._by_gap = {}
            self._by_gap_entries = 0
            for n in self._ckpts:
                if n.lock_own == 0:
                    self._file(n)
        if len(self._lru_ckpt) > 4 * live:
            self._lru_ckpt = []
            for n in self._ckpts:
                if n.lock_own == 0:
                    self._push(self._lru_ckpt, n)
        if len(self._lru_leaf) > 4 * live + 4 * 4096:
            self._lru_leaf = []
            for n in self.nodes():
                if n is not self.root and self._is_leaf_candidate(n):
                    self._push(self._lru_leaf, n)

    def _evict_by_rule(self, n: int) -> int:
        """Drop up to ``n`` unlocked checkpoints chosen by ``eviction.pick_victims``."""
        if eviction_mod.pick_victims is _RULE:
            return self._pick_by_rule(n)
        # The module's function was swapped: walk the tree for its candidates and call it.
        cands, by_id = [], {}
        stack = [(self.root, None)]  # (node, nearest checkpointed ancestor)
        heirs: dict = {}
        anc_of: dict = {}  # every checkpoint's nearest checkpointed ancestor (serials)
        while stack:
            node, anc = stack.pop()
            if node.checkpoint:
                anc_of[node.serial] = None if anc is None else anc.serial
                if anc is not None:
                    heirs[anc.serial] = heirs.get(anc.serial, 0) + 1
                if node.lock_own == 0:
                    cands.append(
                        eviction_mod.Candidate(
                            node_id=node.serial,
                            depth=node.depth,
                            ancestor_depth=anc.depth if anc is not None else 0,
                            last_access=node.state_access,
                            nbytes=self.state_nbytes,
                            kda_layers=self.kda_layers,
                            ancestor_id=anc.serial if anc is not None else None,
                        )
                    )
                    by_id[node.serial] = node
                anc = node
            # insertion order (deterministic): the candidates' order for exact ties
            stack.extend((c, anc) for c in reversed(list(node.children.values())))
        ends: dict = {}
        for nid, a in anc_of.items():
            if a is not None and nid not in heirs:
                ends[a] = ends.get(a, 0) + 1
        cands = [
            dataclasses.replace(c, heirs=heirs.get(c.node_id, 0), end_heirs=ends.get(c.node_id, 0))
            for c in cands
        ]
        victims = eviction_mod.pick_victims(cands, n, self.alpha)
        for nid in victims:
            self._shed(by_id[nid])
        return len(victims)

    def _pick_by_rule(self, n: int) -> int:
        """:func:`eviction.pick_victims` on the unlocked checkpoints, without building them.

        Per pick, the rule's own score (``eviction.score`` of ``eviction.serial_steps`` per byte,
        plus ``eviction.BONUS``: branch end, above a branch end, fork); lowest score, then oldest,
        then shallowest. ``v`` grows with the gap, so ``vmax`` is the largest
        gap's; among checkpoints with equal gaps and equal bonus the oldest (then the shallowest)
        scores lowest, so only each key's oldest is scored (the unlocked checkpoints are filed by
        :meth:`_key`, (branch end?, above a branch end?, fork?, gap), oldest first).
        ``(state_access, depth)`` is unique (one insert marks one path, a hit one node), so no tie
        goes further. A victim's checkpoint is dropped at once, so the
        checkpoints that had it as nearest ancestor inherit its ancestor (their gap grows), as the
        rule's rescoring does.
        """
        grid, per, nbytes = eviction_mod.GRID, self.kda_layers, max(self.state_nbytes, 1)
        alpha = self.alpha
        bonus = eviction_mod.BONUS
        bonused = bool(bonus.end or bonus.above_end or bonus.fork)
        score, steps = eviction_mod.score, eviction_mod.serial_steps
        done = 0
        while done < n and self._gaps:
            tops = [(k, self._oldest(k)) for k in self._gaps]
            lo = min(x.state_access for _, x in tops)
            hi = next(x for x in reversed(self._ckpts) if x.lock_own == 0).state_access
            vmax = steps(max(k[-1] for k in self._gaps), per, grid) / nbytes
            best = None
            for (end, above, fork, g), x in tops:
                v = steps(g, per, grid) / nbytes
                bon = bonus.of(end, above, fork) if bonused else 0.0
                key = (score(x.state_access, lo, hi, v, vmax, alpha, bon), x.state_access, x.depth)
                if best is None or key < best[0]:
                    best = (key, x)
            self._shed(best[1])
            done += 1
        self._maybe_rebuild()
        return done

    def reset(self) -> None:
        """Drop everything (``/flush_cache``); refused while locks are held."""
        if self.locks_held():
            raise TreeIntegrityError("reset while locks are held")
        self.root = Node()
        self.n_checkpoints = self.n_tokens = self.n_host = 0
        self._index_reset()

    # -- integrity ----------------------------------------------------------------------------
    def _check_index(self, order: list, recency: dict, fail) -> None:
        """The incremental eviction index against a walk: recency, gaps, heirs, branch-end heirs,
        the checkpoints in order of their last insert or hit, the counts per key (``_key``)."""
        ckpts = [n for n in order if n.checkpoint]
        for n in order:
            if n is not self.root and n.recency != recency[id(n)]:
                fail(f"recency {n.recency} != {recency[id(n)]} walked")
        gaps: dict = {}
        heirs: dict = {}
        for n in ckpts:
            a = self._ancestor(n)
            if a is not None:
                heirs[id(a)] = heirs.get(id(a), 0) + 1
        ends: dict = {}
        for n in ckpts:
            a = self._ancestor(n)
            if a is not None and id(n) not in heirs:
                ends[id(a)] = ends.get(id(a), 0) + 1
        for n in ckpts:
            if n.gap != n.depth - self._ancestor_depth(n):
                fail(f"gap {n.gap} != {n.depth - self._ancestor_depth(n)} walked")
            if n.heirs != heirs.get(id(n), 0):
                fail(f"heirs {n.heirs} != {heirs.get(id(n), 0)} walked")
            if n.end_heirs != ends.get(id(n), 0):
                fail(f"branch-end heirs {n.end_heirs} != {ends.get(id(n), 0)} walked")
            if n.lock_own == 0:
                key = self._key(n)
                if n.filed != key:
                    fail(f"filed under {n.filed}, not {key}")
                gaps[key] = gaps.get(key, 0) + 1
        if set(map(id, self._ckpts)) != set(map(id, ckpts)) or len(self._ckpts) != len(ckpts):
            fail("the checkpoint index is not the tree's checkpoints")
        seen = [(n.state_access, n.depth) for n in self._ckpts]
        if seen != sorted(seen):
            fail("the checkpoint index is out of order")
        if gaps != self._gaps:
            fail("gap counts are not the tree's")

    def integrity(self, expected_locks: int | None = None) -> dict:
        """Walk the tree and check it; raises :class:`TreeIntegrityError` on the first fault.

        - every child is filed under its key's first token, points back to its parent, has a
          non-empty key and ``depth = parent depth + len(key)``; no node is reachable twice;
        - lock counts are never negative; with ``expected_locks``, the locks held add up to it
          (one per running request);
        - the token and checkpoint counters equal what the walk finds; the root has no
          checkpoint (a state after zero tokens is the zero state, never cached);
        - the caps hold, unless locked nodes keep the tree over them.
        Returns the figures walked.
        """
        seen: set[int] = set()
        tokens = ckpts = nodes = 0

        def fail(msg: str):
            raise TreeIntegrityError(msg)

        if self.root.checkpoint or self.root.key or self.root.parent is not None:
            fail("root carries a key, a parent or a checkpoint")
        stack = [self.root]
        order = []
        while stack:
            n = stack.pop()
            if id(n) in seen:
                fail("node reachable twice")
            seen.add(id(n))
            order.append(n)
            nodes += 1
            if n.lock_own < 0:
                fail("negative lock count")
            for first, c in n.children.items():
                if not c.key:
                    fail("empty edge")
                if c.key[0] != first:
                    fail("child filed under the wrong token")
                if c.parent is not n:
                    fail("child's parent pointer is wrong")
                if c.depth != n.depth + len(c.key):
                    fail(f"depth {c.depth} != {n.depth} + {len(c.key)}")
                tokens += len(c.key)
                ckpts += c.checkpoint
                stack.append(c)
        _, recency, locked_below = self._walk()
        held = sum(n.lock_own for n in order)
        self._check_index(order, recency, fail)
        hosted = sum(1 for n in order if n.host)
        if hosted != self.n_host:
            fail(f"host counter {self.n_host} != {hosted} walked")
        if any(n.host and n.checkpoint for n in order):
            fail("a state both on the device and host-only")
        if hosted and hosted + ckpts > self.host_checkpoints:
            fail(
                f"{hosted} host-only + {ckpts} device states over the host pool "
                f"{self.host_checkpoints}"
            )
        if tokens != self.n_tokens:
            fail(f"token counter {self.n_tokens} != {tokens} walked")
        if ckpts != self.n_checkpoints:
            fail(f"checkpoint counter {self.n_checkpoints} != {ckpts} walked")
        if expected_locks is not None and held != expected_locks:
            fail(f"{held} locks held, expected {expected_locks}")
        if self.max_checkpoints is not None and ckpts > self.max_checkpoints:
            locked = sum(1 for n in order if n.checkpoint and n.lock_own)
            if ckpts - locked > self.max_checkpoints:
                fail(f"{ckpts} checkpoints over the cap {self.max_checkpoints}")
        if self.max_tokens is not None and tokens > self.max_tokens:
            locked = sum(len(n.key) for n in order if locked_below[id(n)] and n is not self.root)
            if tokens - locked > self.max_tokens:
                fail(f"{tokens} KV tokens over the cap {self.max_tokens}")
        out = {"nodes": nodes, "tokens": tokens, "checkpoints": ckpts, "locks": held}
        if self.host_checkpoints:
            out["host"] = hosted
        return out
