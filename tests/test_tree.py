"""Draft trees against hand-built references: the draft's proposals come from a fixed table, so the tree
every envelope must grow from them is known independently of the builders."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.decoding import tree as trees
from eagle_jax.decoding.tree import DynamicTree, StaticTree

VOCAB = 40
# token -> the fake draft's log-probabilities of the next token (float32, as the engine computes them)
LOGP = np.asarray(jax.nn.log_softmax(np.random.default_rng(0).normal(size=(VOCAB, VOCAB)).astype(np.float32) * 2))


def proposals(tokens: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The fake draft's top-k after `tokens` [...]: (ids [..., k], log-probs [..., k]), ties to the lower id."""
    ids = np.argsort(-LOGP[tokens], axis=-1, kind="stable")[..., :k]
    return ids, np.take_along_axis(LOGP[tokens], ids, axis=-1)


def fake_expand(k: int):
    """An `ExpandFn` whose proposals depend only on the fed tokens; its state counts the calls."""

    def expand(calls, tokens, hidden, positions, mask, offset):
        logp, ids = jax.lax.top_k(jnp.asarray(LOGP)[tokens], k)
        return calls + 1, hidden, ids, logp

    return expand


def start(roots: list[int], k: int, hidden: int = 4) -> trees.TreeStart:
    ids, logp = proposals(np.asarray(roots), k)
    b = len(roots)
    return trees.TreeStart(
        jnp.asarray(roots), jnp.zeros((b, hidden)), jnp.asarray(ids), jnp.asarray(logp), jnp.zeros((b,), jnp.int32)
    )


def reference_static(tree: StaticTree, root: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) node by node: the node at rank path p holds the rank-p[-1] proposal after its parent."""
    index = {p: i + 1 for i, p in enumerate(tree.paths)}
    tokens, parents = [root], [0]
    for p in tree.paths:
        parent_token = root if len(p) == 1 else tokens[index[p[:-1]]]
        tokens.append(int(proposals(np.asarray(parent_token), max(tree.top_k, 1))[0][p[-1]]))
        parents.append(index.get(p[:-1], 0))
    return tokens, parents


def reference_dynamic(tree: DynamicTree, root: int) -> tuple[list[int], list[int]]:
    """Upstream `topK_genrate` written out: expand the top_k best frontier nodes `depth` times, record every
    candidate, keep the best total_tokens - 1 by score in recorded order (ties to the earlier record)."""
    k = tree.top_k
    ids, logp = proposals(np.asarray(root), k)
    tokens, scores, parents = list(ids), list(logp), [-1] * k  # parents: recorded index, -1 = the root
    frontier = list(range(k))
    for _ in range(tree.depth):
        children = []
        for node in frontier:
            child_ids, child_logp = proposals(np.asarray(tokens[node]), k)
            children += [(int(t), np.float32(scores[node] + lp), node) for t, lp in zip(child_ids, child_logp)]
        base = len(tokens)
        tokens += [c[0] for c in children]
        scores += [c[1] for c in children]
        parents += [c[2] for c in children]
        frontier = [base + j for j in sorted(range(len(children)), key=lambda j: -children[j][1])[:k]]
    chosen = sorted(sorted(range(len(scores)), key=lambda j: -scores[j])[: tree.total_tokens - 1])
    node_of = {c: n + 1 for n, c in enumerate(chosen)}
    return [root] + [int(tokens[c]) for c in chosen], [0] + [node_of.get(parents[c], 0) for c in chosen]


def check(tree_cfg, built: trees.Tree, roots: list[int], reference) -> None:
    for row, root in enumerate(roots):
        tokens, parents = reference(tree_cfg, root)
        assert np.asarray(built.tokens[row]).tolist() == tokens, (tree_cfg, row)
        assert np.asarray(built.parents[row]).tolist() == parents, (tree_cfg, row)
        depths = [0]
        for p in parents[1:]:
            depths.append(depths[p] + 1)
        assert np.asarray(built.depths[row]).tolist() == depths
        closure = np.eye(len(parents), dtype=bool)
        for j in range(1, len(parents)):
            closure[j] |= closure[parents[j]]
        np.testing.assert_array_equal(built.mask[row], closure)


STATIC = {
    "mc_sim_7b_63": StaticTree(),
    "chain": StaticTree(((0,), (0, 0), (0, 0, 0))),
    "json": trees.parse_static("[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,1,1]]"),
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_tree_against_hand_built(name):
    tree_cfg = STATIC[name]
    roots = [3, 17]
    built, calls = trees.build(tree_cfg, start(roots, tree_cfg.top_k), fake_expand(tree_cfg.top_k), 0)
    assert calls == tree_cfg.max_depth - 1  # one draft pass per expanded level
    check(tree_cfg, built, roots, reference_static)
    siblings = [np.asarray(built.tokens[0])[np.asarray(built.parents[0]) == 0][1:]]  # level-1 nodes (root excluded)
    assert all(len(set(s.tolist())) == len(s) for s in siblings)  # distinct ranks give distinct tokens


@pytest.mark.parametrize(
    "envelope",
    [DynamicTree(*e) for e in ((60, 7, 10), (16, 4, 4), (5, 3, 1), (12, 5, 2), (3, 2, 1), (4, 3, 2), (6, 7, 3))],
    ids=str,
)
def test_dynamic_tree_against_upstream_rule(envelope):
    """Upstream's tree from every `depth` expansion, though a build stops where no deeper level can be kept
    (3 / 2 / 1: one draft pass, not two)."""
    roots = [3, 17, 29]
    built, calls = trees.build(envelope, start(roots, envelope.top_k), fake_expand(envelope.top_k), 0)
    assert calls == min(envelope.depth, envelope.total_tokens - 2)
    check(envelope, built, roots, reference_dynamic)


def test_max_accept_is_bounded_by_the_drafted_nodes():
    # a chain of two drafts drafts three levels but keeps two nodes: at most 2 tokens are accepted
    assert DynamicTree(3, 2, 1).max_accept == 2
    assert DynamicTree(60, 7, 10).max_accept == 8
    assert StaticTree(((0,), (0, 0), (1,))).max_accept == 2
