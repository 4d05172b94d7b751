"""The prefix trie of one training row (docs/algorithms.md §4.1).

One row is one DP rank's forward. Its samples are folded into a prefix trie over their `input_ids`, so a token
shared by several samples (the prompt of a GRPO group, the earlier turns of a multi-turn chain) is forwarded once.

A node is keyed by `(token, next token)`; a sample's last token is keyed `(token, None)`. Two samples therefore
share a node only if they agree on the token *and* on what follows it: the trie branches one token before the
samples diverge, every node has exactly one next-token label, and every sample ends on a leaf of its own kind
(nobody extends a `None`-keyed node; identical samples end on the same leaf).

Costs kept up to date by `add` (what the planners price rows with):
  num_tokens  unique forwarded tokens (= nodes)
  load        Σ over nodes of (depth + 1) = query-key pairs tree attention computes (a chain of L costs L(L+1)/2)
  trained     Σ completion_mask over the samples (bounds the row's loss terms)

Pure Python/numpy: `layout.pack` turns a row into arrays.
"""

from __future__ import annotations

import numpy as np

from rlasync.records import PackableSample

Key = tuple[int, int | None]


class TreeRow:
    """A growing row: samples folded into a prefix trie, children kept in insertion order.

    `share_prefixes=False` gives plain padding-free packing: every sample is its own chain (nothing is
    shared), with the same layout, attention rule and costs. Benchmarks compare against it, and the
    distillation trainer packs that way.
    """

    def __init__(self, share_prefixes: bool = True) -> None:
        self.share_prefixes = share_prefixes
        self._node_tokens: list[int] = []  # [n] token id of each node
        self._node_depths: list[int] = []  # [n] 0-based depth = position in every sample through the node
        self._node_parents: list[int] = []  # [n] parent node, -1 for a root
        self._children: list[dict[Key, int]] = []  # [n] key -> child node, insertion-ordered
        self._roots: dict[Key, int] = {}  # key -> root node, insertion-ordered
        self._sample_nodes: list[np.ndarray] = []  # per sample, [L_i] int64 node of each position
        self._samples: list[PackableSample] = []
        self._groups: set[int] = set()
        self._trained = 0
        self._load = 0
        self._num_raw_tokens = 0

    # ---- costs -------------------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Unique tokens (trie nodes) the row forwards."""
        return len(self._node_tokens)

    @property
    def num_raw_tokens(self) -> int:
        """Σ sample lengths, i.e. what plain concatenation would forward."""
        return self._num_raw_tokens

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    @property
    def load(self) -> int:
        """Σ over nodes of (depth + 1): the number of query-key pairs tree attention computes for the row."""
        return self._load

    @property
    def trained(self) -> int:
        """Σ completion_mask over the row's samples."""
        return self._trained

    @property
    def samples(self) -> list[PackableSample]:
        """Samples in the order they were added (index = `sample_index` of their loss terms). Do not mutate."""
        return self._samples

    @property
    def groups(self) -> set[int]:
        """`group_id`s present in the row. Do not mutate."""
        return self._groups

    # ---- trie structure (read by layout.pack) ---------------------------------------------------------------

    @property
    def node_tokens(self) -> list[int]:
        return self._node_tokens

    @property
    def node_depths(self) -> list[int]:
        return self._node_depths

    @property
    def node_parents(self) -> list[int]:
        return self._node_parents

    @property
    def root_nodes(self) -> list[int]:
        """Root nodes in insertion order."""
        return list(self._roots.values())

    def children(self, node: int) -> list[int]:
        """Children of `node` in insertion order."""
        return list(self._children[node].values())

    @property
    def sample_nodes(self) -> list[np.ndarray]:
        """Per sample, the node of each of its positions ([L_i] int64)."""
        return self._sample_nodes

    # ---- pricing and insertion ---------------------------------------------------------------------------

    def shared_length(self, sample: PackableSample) -> int:
        """Length of the longest prefix of the sample's keys already in the trie."""
        return len(self._walk(sample.input_ids.tolist()))

    def fits(self, sample: PackableSample, budget: int) -> bool:
        """Whether adding `sample` keeps the row within `budget` unique tokens and `budget` trained tokens."""
        novel = len(sample) - self.shared_length(sample)
        return self.num_tokens + novel <= budget and self._trained + sample.num_trained_tokens <= budget

    def delta_load(self, sample: PackableSample) -> int:
        """Load the sample would add: Σ (depth + 1) over its novel nodes, depths shared..L-1."""
        length, shared = len(sample), self.shared_length(sample)
        return length * (length + 1) // 2 - shared * (shared + 1) // 2

    def add(self, sample: PackableSample) -> None:
        """Fold `sample` into the trie, creating its novel nodes and updating the costs."""
        ids = sample.input_ids.tolist()
        if not ids:
            raise ValueError("TreeRow.add: a sample needs at least one token (got an empty input_ids)")
        nodes = self._walk(ids)
        parent = nodes[-1] if nodes else -1
        for depth in range(len(nodes), len(ids)):
            key = _key(ids, depth)
            if parent < 0 and not self.share_prefixes:
                key = (-1 - len(self._samples), None)  # a root of its own: no later sample can walk into it
            parent = self._new_node(key, ids[depth], depth, parent)
            nodes.append(parent)
            self._load += depth + 1
        self._sample_nodes.append(np.asarray(nodes, dtype=np.int64))
        self._samples.append(sample)
        self._groups.add(sample.group_id)
        self._trained += sample.num_trained_tokens
        self._num_raw_tokens += len(ids)

    def _walk(self, ids: list[int]) -> list[int]:
        """Nodes of the longest prefix of `ids`' keys already in the trie."""
        nodes: list[int] = []
        if not self.share_prefixes:
            return nodes
        level = self._roots
        for depth in range(len(ids)):
            node = level.get(_key(ids, depth))
            if node is None:
                break
            nodes.append(node)
            level = self._children[node]
        return nodes

    def _new_node(self, key: Key, token: int, depth: int, parent: int) -> int:
        node = len(self._node_tokens)
        self._node_tokens.append(token)
        self._node_depths.append(depth)
        self._node_parents.append(parent)
        self._children.append({})
        siblings = self._roots if parent < 0 else self._children[parent]
        siblings[key] = node
        return node


def _key(ids: list[int], position: int) -> Key:
    """Trie key of `ids[position]`: the token and the token after it (None for the last one)."""
    return ids[position], ids[position + 1] if position + 1 < len(ids) else None
