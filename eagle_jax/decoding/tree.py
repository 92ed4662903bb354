"""Draft trees with static shapes: EAGLE-2 dynamic trees and EAGLE-1 static trees.

A tree has N nodes (node 0 is the root: the token the target produced last) and is described by
  tokens  [B, N]  target ids
  parents [B, N]  parent node (root: 0)
  depths  [B, N]  0 for the root; the target verifies node j at position context_len + depths[j]
  mask    [B, N, N] ancestor closure including self (the tree attention mask)

Dynamic trees follow upstream `topK_genrate` exactly: `total_tokens` counts the root, `depth`
expansion steps give depth + 1 draft levels, nodes keep their recorded order (level, parent rank,
child rank) after the global top-(total_tokens - 1) rerank.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.decoding import context
from eagle_jax.errors import EagleError

# Upstream default EAGLE-1 static tree (26 nodes with the root), as top-k rank paths.
MAX_CONTEXT = 16  # most context candidates one cycle verifies

MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)  # fmt: skip


class _Envelope:
    """What a tree shape implies for a cycle. A shape gives its head's part (head_nodes counting the root,
    head_depth, draft_window, top_k) and `context`: up to that many candidates copied from the row's own
    history where its last `min_match` or more tokens occurred before (`context.propose`), grafted onto the
    head's tree as one more branch (`context.graft`)."""

    @property
    def num_nodes(self) -> int:
        """Nodes one cycle verifies: the head's tree and one slot per context candidate."""
        return self.head_nodes + self.context

    @property
    def max_depth(self) -> int:
        """Deepest node level (the root is level 0): a context branch reaches depth `context` at most."""
        return max(self.head_depth, self.context)

    @property
    def is_chain(self) -> bool:
        """Node i sits at depth i (a head chain, or a context branch alone), so an accepted path is already
        in slot order."""
        return self.head_nodes == 1 or (self.top_k == 1 and self.context == 0)

    @property
    def path_len(self) -> int:
        """Most tokens one cycle appends (root + deepest draft level)."""
        return self.max_depth + 1

    @property
    def max_accept(self) -> int:
        """Most drafted tokens one cycle can accept: the deepest level, at most the drafted nodes."""
        return min(self.max_depth, self.num_nodes - 1)

    @property
    def cache_overhead(self) -> int:
        """Cache slots one cycle needs past the committed context."""
        return max(self.num_nodes, self.draft_window, self.path_len)

    @property
    def drafts(self) -> bool:
        """Whether a cycle proposes anything (else it is plain decoding's step)."""
        return self.num_nodes > 1

    @property
    def needs_head(self) -> bool:
        """Whether the tree grows from a draft head's proposals."""
        return self.head_nodes > 1

    def _check_context(self) -> None:
        if not 0 <= self.context <= MAX_CONTEXT:
            raise EagleError(f"context={self.context}: context candidates per cycle must lie in [0, {MAX_CONTEXT}]")
        if not 1 <= self.min_match <= context.MAX_NGRAM:
            raise EagleError(f"min_match={self.min_match}: a context match must span 1 to {context.MAX_NGRAM} tokens")


@dataclasses.dataclass(frozen=True)
class DynamicTree(_Envelope):
    """EAGLE-2 envelope (upstream defaults 60 / 7 / 10). total_tokens counts the root."""

    total_tokens: int = 60
    depth: int = 7
    top_k: int = 10
    context: int = 0
    min_match: int = 2

    def __post_init__(self):
        self._check_context()
        candidates = self.top_k + self.depth * self.top_k**2
        if self.top_k < 1 or self.depth < 1 or self.total_tokens < 2:
            raise EagleError(f"bad tree envelope {self}: need top_k >= 1, depth >= 1, total_tokens >= 2")
        if self.total_tokens - 1 > candidates:
            raise EagleError(
                f"total_tokens={self.total_tokens} exceeds the {candidates} candidates of depth={self.depth}, "
                f"top_k={self.top_k}; lower total_tokens or raise depth/top_k"
            )

    @property
    def head_nodes(self) -> int:
        return self.total_tokens

    @property
    def head_depth(self) -> int:
        """Deepest level of the head's tree (the root is level 0)."""
        return self.depth + 1

    @property
    def draft_window(self) -> int:
        """Uncommitted draft-cache slots one tree build writes."""
        return self.depth * self.top_k

    @property
    def expansions(self) -> int:
        """Draft passes a build runs: `depth`, but no level deeper than total_tokens - 1 can be kept (a kept
        node's ancestors score at least as high and are recorded first), so a chain N+1 / N / 1 stops at N - 1."""
        return min(self.depth, self.total_tokens - 2)


@dataclasses.dataclass(frozen=True)
class StaticTree(_Envelope):
    """A fixed tree given as top-k rank paths, e.g. ((0,), (1,), (0, 0), ...); node order = (length, path)."""

    paths: tuple[tuple[int, ...], ...] = MC_SIM_7B_63
    context: int = 0
    min_match: int = 2

    def __post_init__(self):
        self._check_context()
        paths = tuple(sorted({tuple(p) for p in self.paths}, key=lambda p: (len(p), p)))
        if not paths:
            raise EagleError("a static tree needs at least one path, e.g. [[0],[1],[0,0]]")
        for p in paths:
            if not p or min(p) < 0 or (len(p) > 1 and p[:-1] not in paths):
                raise EagleError(f"static tree path {list(p)} is invalid: every prefix of a path must be a path too")
        object.__setattr__(self, "paths", paths)

    @property
    def head_nodes(self) -> int:
        return len(self.paths) + 1

    @property
    def head_depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def top_k(self) -> int:
        return max(p[-1] for p in self.paths) + 1

    @property
    def width(self) -> int:
        """Most nodes on one level."""
        return max(sum(len(p) == d for p in self.paths) for d in range(1, self.head_depth + 1))

    @property
    def draft_window(self) -> int:
        return max(self.head_depth - 1, 1) * self.width


@dataclasses.dataclass(frozen=True)
class NoDraft(_Envelope):
    """A cycle whose head drafts nothing: the target verifies the root alone (plain decoding), or with
    `context` the root and a branch copied from the row's history (speculation without a head). A head,
    when there is one, still reads every accepted feature, so a batch can switch trees without losing context."""

    context: int = 0
    min_match: int = 2
    head_nodes = 1
    head_depth = 0
    draft_window = 0
    top_k = 1

    def __post_init__(self):
        self._check_context()


TreeConfig = DynamicTree | StaticTree | NoDraft
PLAIN = NoDraft()  # plain decoding: the engine's cycle verifies the root alone


def check_fits(tree: TreeConfig, draft_vocab_size: int) -> None:
    """Refuse a tree that asks a level for more children (top_k) than the head's draft vocabulary holds."""
    if tree.top_k > draft_vocab_size:
        raise EagleError(
            f"tree top_k={tree.top_k} exceeds the head's draft vocabulary of {draft_vocab_size} tokens; "
            f"use {draft_vocab_size} or less",
            "tree_top_k",
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    tokens: jax.Array  # [B, N]
    parents: jax.Array  # [B, N]
    depths: jax.Array  # [B, N]
    mask: jax.Array  # [B, N, N]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeStart:
    """What a tree grows from: the root and the draft output that proposes level 1."""

    root: jax.Array  # [B] the root token
    hidden: jax.Array  # [B, H] draft output at the last committed position (the level-1 nodes' hidden input)
    ids: jax.Array  # [B, k] its top-k proposals (target ids), best first
    logp: jax.Array  # [B, k] their log-probabilities
    position: jax.Array  # [B] draft position of the level-1 nodes


# A draft expansion: expand(state, tokens [B, K], hidden [B, K, H], positions [B, K], mask [B, K, W], offset)
#   -> (state, outputs [B, K, H], top-k target ids [B, K, k], top-k log-probs [B, K, k]); it writes the
#   K entries into the draft cache window at `offset` (the cache is the threaded `state`).
ExpandFn = Callable[..., tuple[Any, jax.Array, jax.Array, jax.Array]]


def ancestor_mask(parents: jax.Array, max_depth: int) -> jax.Array:
    """Ancestor closure including self: [B, N] parents (root's parent = 0) -> [B, N, N] bool."""
    n = parents.shape[-1]
    eye = jnp.eye(n, dtype=bool)
    m = jnp.broadcast_to(eye, parents.shape + (n,))
    for _ in range(max_depth):
        m = eye | jnp.take_along_axis(m, parents[..., None], axis=-2)
    return m


def root_paths(mask: jax.Array, depths: jax.Array, num_cols: int) -> jax.Array:
    """paths[b, j, d] = the ancestor of node j at depth d (-1 past depth j). [B, N, num_cols]."""
    d = jnp.arange(num_cols)
    at_depth = depths[:, None, :, None] == d[None, None, None, :]  # [B, 1, N, C]
    hit = mask[..., None] & at_depth  # [B, N, N, C]
    node = jnp.arange(mask.shape[-1])[None, None, :, None]
    return jnp.where(jnp.any(hit, axis=2), jnp.sum(jnp.where(hit, node, 0), axis=2), -1)


def _finish(tokens: jax.Array, parents: jax.Array, max_depth: int) -> Tree:
    with jax.named_scope("tree_mask"):
        mask = ancestor_mask(parents, max_depth)
        return Tree(tokens, parents, jnp.sum(mask, axis=-1) - 1, mask)


def _build_dynamic(tree: DynamicTree, start: TreeStart, expand: ExpandFn, state) -> tuple[jax.Array, jax.Array, Any]:
    """EAGLE-2 tree (upstream `topK_genrate`): expand the top_k best frontier nodes `depth` times (`expansions`),
    then keep the best total_tokens - 1 of all candidates in recorded order. Returns (tokens, parents, state)."""
    root, root_ids, root_hidden = start.root, start.ids, start.hidden
    b, k = root.shape[0], tree.top_k
    w = tree.draft_window
    rows = jnp.arange(b)[:, None]
    # level 1
    frontier_tokens, frontier_scores = root_ids, start.logp  # [B, k]
    frontier_hidden = jnp.broadcast_to(root_hidden[:, None, :], (b, k, root_hidden.shape[-1]))
    frontier_flat = jnp.broadcast_to(jnp.arange(k), (b, k))  # flat candidate index of each frontier node
    frontier_mask = jnp.broadcast_to(jnp.eye(k, w, dtype=bool), (b, k, w))  # window slots each node sees

    def step(carry, i):
        state, tokens, scores, hidden, flat, mask = carry
        positions = jnp.broadcast_to(start.position[:, None] + i, (b, k))
        state, out, ids, logp = expand(state, tokens, hidden, positions, mask, i * k)  # ids/logp [B, k, k]
        cum = (logp + scores[..., None]).reshape(b, k * k)
        child_tokens = ids.reshape(b, k * k)
        child_parents = jnp.repeat(flat + 1, k, axis=-1)  # flat index + 1 of the parent; 0 = root
        next_scores, pick = jax.lax.top_k(cum, k)  # [B, k]
        parent_rank = pick // k
        next_mask = jnp.take_along_axis(mask, parent_rank[..., None], axis=1)
        next_mask = next_mask | (jnp.arange(w)[None, None, :] == ((i + 1) * k + jnp.arange(k))[None, :, None])
        carry = (
            state,
            child_tokens[rows, pick],
            next_scores,
            out[rows, parent_rank],
            k + i * k * k + pick,
            next_mask,
        )
        return carry, (child_tokens, cum, child_parents)

    init = (state, frontier_tokens, frontier_scores, frontier_hidden, frontier_flat, frontier_mask)
    with jax.named_scope("draft_levels"):
        (state, *_), (tok_l, score_l, parent_l) = jax.lax.scan(step, init, jnp.arange(tree.expansions))
    with jax.named_scope("rerank"):
        tokens, parents = _rerank(tree, root, root_ids, start.logp, tok_l, score_l, parent_l)
    return tokens, parents, state


def _rerank(tree: DynamicTree, root, root_ids, root_logp, tok_l, score_l, parent_l) -> tuple[jax.Array, jax.Array]:
    """The best total_tokens - 1 of every recorded candidate, in recorded order: (tokens, parents) [B, N]."""
    b, k = root_ids.shape
    all_tokens = jnp.concatenate([root_ids, jnp.moveaxis(tok_l, 0, 1).reshape(b, -1)], axis=1)
    all_scores = jnp.concatenate([root_logp, jnp.moveaxis(score_l, 0, 1).reshape(b, -1)], axis=1)
    all_parents = jnp.concatenate(
        [jnp.zeros((b, k), jnp.int32), jnp.moveaxis(parent_l, 0, 1).reshape(b, -1).astype(jnp.int32)], axis=1
    )
    _, chosen = jax.lax.top_k(all_scores, tree.total_tokens - 1)
    chosen = jnp.sort(chosen, axis=-1)  # recorded order
    parent_flat = jnp.take_along_axis(all_parents, chosen, axis=1)  # [B, N-1]
    parent_node = jax.vmap(jnp.searchsorted)(chosen, parent_flat - 1) + 1
    parent_node = jnp.where(parent_flat == 0, 0, parent_node)
    tokens = jnp.concatenate([root[:, None], jnp.take_along_axis(all_tokens, chosen, axis=1)], axis=1)
    parents = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parent_node.astype(jnp.int32)], axis=1)
    return tokens, parents


@dataclasses.dataclass(frozen=True)
class _StaticLayout:
    """Numpy tables of a static tree: per level, which nodes, their parents' slots and ranks."""

    parents: np.ndarray  # [N]
    level_nodes: np.ndarray  # [D, width] node index per level slot (-1 = padding)
    level_rank: np.ndarray  # [D, width] top-k rank of each node under its parent
    level_parent_slot: np.ndarray  # [D, width] slot of the parent in the previous level (level 1: 0)
    window_mask: np.ndarray  # [D-1, width, W] ancestors (and self) among expanded levels 1..D-1


def static_layout(tree: StaticTree) -> _StaticLayout:
    paths = tree.paths
    index = {p: i + 1 for i, p in enumerate(paths)}
    parents = np.array([0] + [index.get(p[:-1], 0) for p in paths], np.int32)
    d_max, width = tree.head_depth, tree.width
    level_nodes = -np.ones((d_max, width), np.int32)
    level_rank = np.zeros((d_max, width), np.int32)
    level_parent_slot = np.zeros((d_max, width), np.int32)
    slot_of: dict[tuple[int, ...], int] = {}
    for d in range(1, d_max + 1):
        level = [p for p in paths if len(p) == d]
        for s, p in enumerate(level):
            slot_of[p] = s
            level_nodes[d - 1, s] = index[p]
            level_rank[d - 1, s] = p[-1]
            level_parent_slot[d - 1, s] = slot_of[p[:-1]] if d > 1 else 0
    w = tree.draft_window
    window_mask = np.zeros((max(d_max - 1, 1), width, w), bool)
    for d in range(1, d_max):
        for s, p in enumerate(q for q in paths if len(q) == d):
            for a in range(1, d + 1):
                window_mask[d - 1, s, (a - 1) * width + slot_of[p[:a]]] = True
    return _StaticLayout(parents, level_nodes, level_rank, level_parent_slot, window_mask)


def _build_static(tree: StaticTree, start: TreeStart, expand: ExpandFn, state) -> tuple[jax.Array, jax.Array, Any]:
    """EAGLE-1 static tree: node tokens are the parent's draft top-k at the node's rank.
    Returns (tokens, parents, state)."""
    lay = static_layout(tree)
    b = start.root.shape[0]
    with jax.named_scope("draft_levels"):
        tokens, state = _static_levels(tree, lay, start, expand, state)
    return tokens, jnp.broadcast_to(jnp.asarray(lay.parents), (b, tree.head_nodes)), state


def _static_levels(tree: StaticTree, lay: _StaticLayout, start: TreeStart, expand: ExpandFn, state):
    """Node tokens [B, N] level by level, every level but the last expanded by one draft pass; (tokens, state)."""
    b, width, h = start.root.shape[0], tree.width, start.hidden.shape[-1]
    rows = jnp.arange(b)[:, None]
    tokens = jnp.zeros((b, tree.head_nodes), start.root.dtype).at[:, 0].set(start.root)
    level_tokens = start.ids[:, lay.level_rank[0]]  # [B, width]
    hidden = start.hidden[:, None, :]  # [B, 1 or width, H]: outputs of the level above
    for d in range(1, tree.head_depth + 1):
        valid = lay.level_nodes[d - 1] >= 0
        tokens = tokens.at[:, lay.level_nodes[d - 1][valid]].set(level_tokens[:, valid])
        if d == tree.head_depth:
            break
        parent_hidden = jnp.broadcast_to(hidden[:, lay.level_parent_slot[d - 1]], (b, width, h))
        positions = jnp.broadcast_to(start.position[:, None] + d - 1, (b, width))
        mask = jnp.broadcast_to(jnp.asarray(lay.window_mask[d - 1]), (b, width, tree.draft_window))
        state, hidden, ids, _ = expand(state, level_tokens, parent_hidden, positions, mask, (d - 1) * width)
        level_tokens = ids[rows, lay.level_parent_slot[d], lay.level_rank[d]]
    return tokens, state


def build(
    tree: TreeConfig, start: TreeStart, expand: ExpandFn, state, candidates: tuple[jax.Array, jax.Array] | None = None
) -> tuple[Tree, Any]:
    """Grow the configured tree from `start`; `expand` runs the draft (threading `state`). With `tree.context`,
    `candidates` (tokens [B, context], valid [B, context] from `context.propose`) join it as a grafted branch."""
    if isinstance(tree, NoDraft):
        tokens, parents = start.root[:, None], jnp.zeros_like(start.root)[:, None]
    else:
        builder = _build_dynamic if isinstance(tree, DynamicTree) else _build_static
        tokens, parents, state = builder(tree, start, expand, state)
    if tree.context:
        with jax.named_scope("graft"):
            tokens, parents = context.graft(tokens, parents, *candidates)
    return _finish(tokens, parents, tree.max_depth), state


def regraft(tree: TreeConfig, tr: Tree, candidates: tuple[jax.Array, jax.Array]) -> Tree:
    """`tr` (built with `tree.context`) with its context branch replaced by candidates (tokens [B, context], valid
    [B, context]) in the rows that have any: grafted onto the head's nodes as `build` grafts them."""
    n = tree.head_nodes
    tokens, parents = context.graft(tr.tokens[:, :n], tr.parents[:, :n], *candidates)
    new, use = _finish(tokens, parents, tree.max_depth), candidates[1][:, 0]  # [B]
    return jax.tree.map(lambda a, b: jnp.where(use.reshape(-1, *[1] * (a.ndim - 1)), a, b), new, tr)


def parse_static(text: str) -> StaticTree:
    """'default' / 'mc_sim_7b_63' or a JSON list of rank paths."""
    import json

    if text in ("default", "static", "mc_sim_7b_63"):
        return StaticTree()
    try:
        paths: Sequence[Sequence[int]] = json.loads(text)
        return StaticTree(tuple(tuple(int(x) for x in p) for p in paths))
    except (json.JSONDecodeError, TypeError, ValueError):
        raise EagleError(
            f"bad static tree {text!r}: give 'mc_sim_7b_63' or a JSON list of rank paths like [[0],[1],[0,0]]"
        ) from None


def envelope_name(tree: TreeConfig) -> str:
    """'5/4/1' (total_tokens/depth/top_k), '5/4/1+ctx7' (with 7 context candidates), 'ctx7' (context alone),
    'ctx7m3' (a match of 3 tokens or more), 'plain' (nothing drafted); a static tree by its node count."""
    if not tree.drafts:
        return "plain"
    ctx = f"ctx{tree.context}" + (f"m{tree.min_match}" if tree.min_match != 2 else "") if tree.context else ""
    if isinstance(tree, NoDraft):
        return ctx
    head = (
        f"{tree.total_tokens}/{tree.depth}/{tree.top_k}"
        if isinstance(tree, DynamicTree)
        else f"static {tree.head_nodes} nodes"
    )
    return head + ("+" + ctx if ctx else "")


def envelope_json(tree: TreeConfig) -> dict | None:
    """A tree's fields (a static tree's as static_paths); the context's only when it has candidates; None for
    plain decoding."""
    if not tree.drafts:
        return None
    doc = dataclasses.asdict(tree)
    if isinstance(tree, StaticTree):
        doc = {"static_paths": [list(p) for p in doc.pop("paths")], **doc}
    return doc if tree.context else {k: v for k, v in doc.items() if k not in ("context", "min_match")}


def envelope_from_json(doc: dict | None) -> DynamicTree | NoDraft:
    """`envelope_json`'s inverse (a dict without total_tokens is a head-less envelope, None plain decoding)."""
    if doc is None:
        return PLAIN
    return DynamicTree(**doc) if "total_tokens" in doc else NoDraft(**doc)


_HEAD, _CONTEXT = r"(\d+)/(\d+)/(\d+)", r"ctx(\d+)(?:m(\d+))?"


def parse_envelopes(text: str) -> list[DynamicTree | NoDraft]:
    """'60/7/10,5/4/1+ctx7,ctx7m3' -> envelopes: TOTAL/DEPTH/TOP_K of the head's dynamic tree, +ctxK for K
    context candidates grafted on (mM: found where the last M tokens recur, default 2), ctxK alone for context
    candidates only."""
    trees: list[DynamicTree | NoDraft] = []
    for part in text.split(","):
        m = re.fullmatch(rf"{_HEAD}(?:\+{_CONTEXT})?|{_CONTEXT}", part.strip())
        if m is None:
            raise EagleError(
                f"bad tree envelope {part.strip()!r}: expected TOTAL/DEPTH/TOP_K (e.g. 60/7/10), optionally "
                f"+ctxK (e.g. 5/4/1+ctx7), or ctxK alone (context candidates only, e.g. ctx7; ctx7m3 for matches "
                f"of 3 tokens or more)"
            )
        total, depth, top_k, k1, m1, k2, m2 = m.groups()
        ctx = dict(context=int(k1 or k2 or 0), min_match=int(m1 or m2 or 2))
        trees.append(DynamicTree(int(total), int(depth), int(top_k), **ctx) if total else NoDraft(**ctx))
    return trees
