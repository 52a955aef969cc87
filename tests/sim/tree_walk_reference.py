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

Recency is a logical clock (one tick per operation), so runs are deterministic.

(Changed since that commit: the rule's candidates carry their heirs and branch-end heirs,
counted over every checkpoint, so the reference scores ``eviction.BONUS`` as the rule does.)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional, Sequence

# Called through the module object: a test that swaps the rule sees the change.
from sglang_kda.cache import eviction as eviction_mod


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


class RadixTree:
    """See the module docstring.

    max_checkpoints: cap on checkpoints held (``None``: unbounded).
    max_tokens: cap on KV tokens held (``None``: unbounded).
    alpha: which checkpoints go under checkpoint pressure: ``None`` LRU, else the weight of
        serial work saved per byte in :func:`sglang_kda.cache.eviction.pick_victims`
        (``eviction.parse_eviction`` of ``--kda-eviction``).
    state_nbytes / kda_layers: one state's bytes and the model's KDA layers (the rule's value
        per byte; a constant for one model, so only their ratio to other candidates matters).
    """

    def __init__(
        self,
        max_checkpoints: int | None = None,
        max_tokens: int | None = None,
        alpha: float | None = None,
        state_nbytes: int = 1,
        kda_layers: int = 1,
    ):
        if alpha is not None and not alpha >= 0:
            raise ValueError("alpha must be None (LRU) or >= 0")
        if max_checkpoints is not None and max_checkpoints < 0:
            raise ValueError("max_checkpoints must be >= 0")
        if max_tokens is not None and max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        self.root = Node()
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

    # -- helpers ------------------------------------------------------------------------------
    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _touch(self, node: Node, t: int) -> None:
        # Only the node: an ancestor's recency is the most recent of its subtree, derived when
        # eviction needs it (:meth:`_walk`), so touching a 10,000-node path costs O(1).
        node.last_access = t

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
        )
        parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    # -- queries ------------------------------------------------------------------------------
    def match(
        self, ids: Sequence[int], limit: int | None = None, start: Node | None = None
    ) -> Match:
        """Deepest checkpointed node on ``ids``' path at most ``limit`` tokens deep.

        ``limit`` defaults to ``len(ids) - 1``. Touches the matched path (recency).
        ``start``: a node known to lie on ``ids``' path (e.g. one the request locks); the walk
        begins there and only checkpoints from it down are considered (a shortcut for long
        paths: an in-flight request looks for checkpoints past its progress).
        """
        limit = len(ids) - 1 if limit is None else min(limit, len(ids))
        node = self.root if start is None else start
        pos = node.depth
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
            if node.checkpoint and node.depth <= limit:
                best = node
        t = self._tick()
        self._touch(best, t)
        if best.checkpoint:  # a hit: the state's recency for the eviction rule
            best.state_access = t
        return Match(best, best.depth, kv)

    def nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
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
                node.state_access = t
                if not node.checkpoint:
                    node.checkpoint = True
                    self.n_checkpoints += 1
                    new += 1
        self._touch(node, t)
        self.stats.checkpoints_inserted += new
        if enforce:
            self.enforce_caps()  # LRU: what was just inserted goes last
        return new

    def lock(self, node: Node) -> Node:
        node.lock_own += 1
        return node

    def unlock(self, node: Node) -> None:
        if node.lock_own <= 0:
            raise TreeIntegrityError("unlock of a node that is not locked")
        node.lock_own -= 1

    def enforce_caps(self) -> None:
        """Evict down to the caps (checkpoints by the tree's rule, KV by LRU)."""
        if self.max_checkpoints is not None and self.n_checkpoints > self.max_checkpoints:
            self.evict(checkpoints=self.n_checkpoints - self.max_checkpoints)
        if self.max_tokens is not None and self.n_tokens > self.max_tokens:
            self.evict(tokens=self.n_tokens - self.max_tokens)

    def evict(self, checkpoints: int = 0, tokens: int = 0) -> tuple[int, int]:
        """Evict at least ``checkpoints`` checkpoints (by the tree's rule: LRU, or
        ``eviction.pick_victims`` with ``alpha``) and ``tokens`` KV tokens (LRU).

        Checkpoint pressure evicts checkpoints only (their KV stays, for other requests' KV
        matches); KV pressure evicts least recently used unlocked leaves, each taking its
        checkpoint with it (a state is never kept without its KV). Returns
        ``(checkpoints evicted, tokens evicted)``; less than asked when everything left is
        locked.
        """
        done_c = done_t = 0
        if checkpoints <= 0 and tokens <= 0:
            return 0, 0
        order, recency, locked = self._walk()
        if checkpoints > 0 and self.alpha is not None:
            done_c = self._evict_by_rule(checkpoints)
        elif checkpoints > 0:
            cands = [
                (recency[id(n)], -n.depth, n.serial, n)
                for n in order
                if n.checkpoint and n.lock_own == 0
            ]
            heapq.heapify(cands)
            while cands and done_c < checkpoints:
                _, _, _, n = heapq.heappop(cands)
                n.checkpoint = False
                self.n_checkpoints -= 1
                done_c += 1
        if tokens > 0:
            leaves = [
                (recency[id(n)], -n.depth, n.serial, n)
                for n in order
                if n is not self.root and not n.children and n.lock_own == 0
            ]
            heapq.heapify(leaves)
            while leaves and done_t < tokens:
                _, _, _, n = heapq.heappop(leaves)
                parent = n.parent
                del parent.children[n.key[0]]
                n.parent = None
                self.n_tokens -= len(n.key)
                done_t += len(n.key)
                self.stats.nodes_evicted += 1
                if n.checkpoint:
                    self.n_checkpoints -= 1
                    done_c += 1
                if parent is not self.root and not parent.children and parent.lock_own == 0:
                    heapq.heappush(
                        leaves, (recency[id(parent)], -parent.depth, parent.serial, parent)
                    )
        self.stats.checkpoints_evicted += done_c
        self.stats.tokens_evicted += done_t
        return done_c, done_t

    def _evict_by_rule(self, n: int) -> int:
        """Drop up to ``n`` unlocked checkpoints chosen by ``eviction.pick_victims``."""
        cands, by_id, heirs, anc_of = [], {}, {}, {}
        stack = [(self.root, None)]  # (node, nearest checkpointed ancestor)
        while stack:
            node, anc = stack.pop()
            if node.checkpoint:
                anc_of[node.serial] = anc
                if anc is not None:  # heirs over every checkpoint, locked or not (branch ends)
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
        ends = {}  # branch-end heirs, over every checkpoint too
        for nid, a in anc_of.items():
            if a is not None and nid not in heirs:
                ends[a.serial] = ends.get(a.serial, 0) + 1
        cands = [
            replace(c, heirs=heirs.get(c.node_id, 0), end_heirs=ends.get(c.node_id, 0))
            for c in cands
        ]
        victims = eviction_mod.pick_victims(cands, n, self.alpha)
        for nid in victims:
            node = by_id[nid]
            node.checkpoint = False
            self.n_checkpoints -= 1
        return len(victims)
