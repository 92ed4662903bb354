"""Speculative decoding: draft a tree, verify it with one target forward, accept, repeat.

One jitted function runs a whole cycle with fixed shapes:
  draft tree (expand, rerank) -> target forward over the tree under the tree mask -> choose the
  accepted path and the bonus token (`acceptance`) -> move the accepted target KV entries to
  contiguous slots (rejected ones are dropped by length) -> feed the accepted features to the draft.
`run_span` is a `lax.while_loop` over cycles with donated state, up to an attention span; `extend` feeds prompts
in chunks. `engine.Engine` runs these programs (its clients: `generation`, the chat session, the server). The
compiled programs depend on the tree envelope and the sampling rule (static).

Plain decoding is the same engine with `tree.PLAIN` (a tree of the root alone) and no head: each cycle
verifies the root, which is one decode step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.decoding import acceptance, context, grammar, schedule
from eagle_jax.decoding import logprobs as lps
from eagle_jax.decoding import rows as rows_sampling
from eagle_jax.decoding import tree as trees
from eagle_jax.decoding.emit import PAD_ID, emit
from eagle_jax.decoding.rows import RowControls
from eagle_jax.decoding.sampling import SamplingConfig, sample
from eagle_jax.decoding.tree import PLAIN, Tree, TreeConfig
from eagle_jax.models import draft, kv_cache, target
from eagle_jax.models.config import DraftConfig, TargetConfig
from eagle_jax.models.kv_cache import KVCache
from eagle_jax.parallel import distributed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """Carry of the generation loop (B rows; every cycle of a running row emits >= 1 token)."""

    target_cache: KVCache
    draft_cache: KVCache | None  # None without a head
    root: jax.Array  # [B] int32: next tree root (the target's last token, not yet in its cache)
    draft_hidden: jax.Array | None  # [B, H] draft output at the last committed draft position
    history: jax.Array  # [B, S] int32 committed tokens by position (prompts, answers; the root at the cache length)
    out: jax.Array  # [B, S] int32 generated tokens, PAD_ID past counts (S = cache capacity)
    counts: jax.Array  # [B] int32
    limits: jax.Array  # [B] int32 per-row budgets
    done: jax.Array  # [B] bool
    eos: jax.Array  # [B] bool
    cycle: jax.Array  # [] int32
    accept_lengths: jax.Array  # [S, B] int32 accepted draft tokens per cycle (-1: row not running)
    key: jax.Array
    controls: RowControls | None = None  # per-row sampling (a server's rows); None: the static setting and `key`
    logprobs: lps.Logprobs | None = None  # emitted tokens' logprobs (`decoding.logprobs`); None: not recorded
    sources: jax.Array | None = None  # [B, S] int8 where each token of `out` came from (`SOURCES`); None: untracked


SOURCES = ("target", "head", "context")  # a cycle's root (the target's own token), an accepted head or context draft


# the fields of one row each, [B, ...]
_PER_ROW = ("root", "draft_hidden", "history", "out", "counts", "limits", "done", "eos", "controls", "sources")


@dataclasses.dataclass(frozen=True)
class SpecResult:
    tokens: list[list[int]]  # new tokens per row (exactly max_new_tokens unless eos came first)
    accept_lengths: list[list[int]]  # per row, per cycle it ran
    stop_reasons: list[str]
    prefill_s: float = 0.0  # seconds the prompts took to feed
    decode_s: float = 0.0  # seconds the cycles took

    @property
    def cycles(self) -> list[int]:
        return [len(a) for a in self.accept_lengths]

    @property
    def new_tokens(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def tau(self) -> float:
        """Mean tokens per cycle over all rows."""
        return sum(self.new_tokens) / max(1, sum(self.cycles))

    def accept_histogram(self, max_accept: int) -> list[int]:
        """Counts of accept lengths 0..max_accept over all rows and cycles."""
        return acceptance.accept_histogram([a for row in self.accept_lengths for a in row], max_accept)

    def n_alpha(self, max_accept: int) -> list[float | None]:
        """Acceptance rate at depth n (1..max_accept) given that depths < n were accepted."""
        return acceptance.n_alpha(self.accept_histogram(max_accept))


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """What a compiled program of the engine depends on besides shapes: the target's and the head's configs (None:
    no head), the tree (`tree.PLAIN`: plain decoding) and the sampling rule. Hashable: the engine's one static
    argument."""

    tcfg: TargetConfig
    dcfg: DraftConfig | None = None
    tree: TreeConfig = PLAIN
    sampling: SamplingConfig = SamplingConfig()
    logprobs: int = 0  # alternatives recorded per token for rows `extend` asks to (`decoding.logprobs`); 0: none


def head_for(cfg: DecodeConfig, dparams) -> tuple[DecodeConfig, dict | None]:
    """The settings and head a run with one fixed tree takes: no head when the tree does not grow from it (it would
    only follow along, which a batch that switches trees needs, a fixed one does not)."""
    return (cfg, dparams) if cfg.tree.needs_head else (dataclasses.replace(cfg, dcfg=None), None)


def _feature_layers(tcfg: TargetConfig, dcfg: DraftConfig | None) -> tuple[int, ...]:
    return dcfg.feature_layers(tcfg) if dcfg is not None else ()


def _write(history: jax.Array, start: jax.Array, tokens: jax.Array, n: jax.Array) -> jax.Array:
    """history [B, S] with the first n [B] of tokens [B, T] written at positions start [B] + [0, T)."""
    t = tokens.shape[1]
    at = jnp.where(jnp.arange(t)[None, :] < n[:, None], start[:, None] + jnp.arange(t)[None, :], history.shape[1])
    return history.at[jnp.arange(history.shape[0])[:, None], at].set(tokens, mode="drop")


def _features(dcfg: DraftConfig, out: target.TargetOutput) -> jax.Array:
    """What the head reads: EAGLE-3 the fused layer inputs, EAGLE-1 the final normed hidden state."""
    return out.features if dcfg.kind == "eagle3" else out.hidden


def _expand_fn(dparams: dict, dcfg: DraftConfig, embed: jax.Array, head: jax.Array, k: int, span: int | None):
    def expand(cache, tokens, hidden, positions, mask, offset):
        out, cache = draft.forward(dparams, dcfg, embed, tokens, hidden, positions, cache, mask, offset, span)
        ids, logp = draft.top_k(dparams, dcfg, out, head, k)
        return cache, out, ids, logp

    return expand


def _draft_context(
    dparams, dcfg, embed, cache: KVCache, tokens, features, count, span: int | None
) -> tuple[jax.Array, KVCache]:
    """Append (feature_i, token_{i+1}) pairs [B, T] for the first count [B] of each row; returns the
    draft output at the last appended pair [B, H] and the cache with lengths advanced by count."""
    b, t = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(t)[None, :]
    hidden = draft.project_features(dparams, dcfg, features)
    out, cache = draft.forward(dparams, dcfg, embed, tokens, hidden, positions, cache, span=span)
    last = jnp.take_along_axis(out, (count - 1)[:, None, None], axis=1)[:, 0]
    return last, kv_cache.advance(cache, count)


@functools.partial(jax.jit, static_argnames=("cfg", "capacity"))
def prefill(tparams, dparams, tokens, lengths, limits, key, *, cfg: DecodeConfig, capacity: int) -> SpecState:
    """Prompts [B, P] right-padded with lengths [B] -> the state before the first cycle.

    The target fills its cache and picks the first root; the draft reads the pairs
    (feature_i, token_{i+1}) for i < length (the last token being the root).
    """
    tcfg, dcfg = cfg.tcfg, cfg.dcfg
    b, p = tokens.shape
    out = target.prefill(tparams, tcfg, tokens, capacity, _feature_layers(tcfg, dcfg))
    rows = jnp.arange(b)
    last_hidden = out.hidden[rows, lengths - 1]
    root = sample(jax.random.fold_in(key, 0), target.lm_logits(tparams, tcfg, last_hidden), cfg.sampling)
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1).at[rows, lengths - 1].set(root)
    draft_hidden = dcache = None
    if dcfg is not None:
        dcache = draft.init_cache(dcfg, b, capacity, tparams["embed"].dtype)
        draft_hidden, dcache = _draft_context(
            dparams, dcfg, tparams["embed"], dcache, shifted, _features(dcfg, out), lengths, span=p
        )
    history = jnp.full((b, capacity), PAD_ID, jnp.int32)
    return SpecState(
        target_cache=kv_cache.set_lengths(out.cache, lengths),
        draft_cache=dcache,
        root=root,
        draft_hidden=draft_hidden,
        history=_write(history, jnp.zeros_like(lengths), tokens, lengths).at[rows, lengths].set(root),
        out=jnp.full((b, capacity), PAD_ID, jnp.int32),
        counts=jnp.zeros((b,), jnp.int32),
        limits=limits,
        done=limits <= 0,
        eos=jnp.zeros((b,), bool),
        cycle=jnp.int32(0),
        accept_lengths=jnp.full((capacity, b), -1, jnp.int32),
        key=key,
        sources=jnp.zeros((b, capacity), jnp.int8),
    )


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def extend(
    tparams,
    dparams,
    state: SpecState,
    start,
    tokens,
    next_tokens,
    n,
    final,
    limits,
    key,
    controls: RowControls | None = None,
    rows: jax.Array | None = None,
    logprobs: jax.Array | None = None,
    masks: jax.Array | None = None,
    *,
    cfg: DecodeConfig,
) -> SpecState:
    """Feed a chunk of a conversation into caches kept from earlier chunks and turns (chunked prefill).

    Each fed row's caches are first cut to start [B] tokens (what it keeps of its past), then take the first
    n [B] of tokens [B, C] at positions start + [0, C); next_tokens [B, C] are the tokens that follow them
    (the draft reads (feature_i, token_{i+1}) pairs). A row whose chunk is its last (final [B]) starts a turn
    with budget limits [B]: its root is sampled from the last fed token's logits (key fold_in(key, 0), as
    `prefill`) and closes the last pair. A row fed a chunk that is not its last waits (done) until it is.
    Rows fed nothing (n = 0) are left as they were. With `controls` (per-row sampling, a server's batch) the
    starting rows take their settings and seeds from it (`decoding.rows`: keys follow sequence positions). The tree of
    `cfg` plays no part. With `rows` [R] (distinct int32) only those rows are computed, and the per-row
    arguments are theirs ([R], [R, C]); the others are left as they are. With a state that records logprobs, the
    starting rows record theirs when `logprobs` [B] bool says so (None: every one). `masks` [B, W] (`grammar`): the
    tokens each starting row's root may be.
    """
    args = (start, tokens, next_tokens, n, final, limits, key, controls, logprobs, masks)
    if rows is None:
        return _extend(tparams, dparams, state, *args, cfg)
    return put_rows(state, _extend(tparams, dparams, take_rows(state, rows), *args, cfg), rows)


def _extend(
    tparams, dparams, state: SpecState, start, tokens, next_tokens, n, final, limits, key, controls, wanted, masks, cfg
):
    """`extend` of every row."""
    tcfg, dcfg = cfg.tcfg, cfg.dcfg
    b, c = tokens.shape
    rows = jnp.arange(b)
    fed = n > 0
    start = jnp.where(fed, start, state.target_cache.lengths)
    positions = start[:, None] + jnp.arange(c)[None, :]
    fwd = target.forward(
        tparams,
        tcfg,
        tokens,
        positions,
        kv_cache.set_lengths(state.target_cache, start),
        feature_layers=_feature_layers(tcfg, dcfg),
        compute_logits=False,
    )
    last = jnp.maximum(n - 1, 0)
    starts = fed & final
    if controls is not None:
        old = state.controls if state.controls is not None else controls
        controls = jax.tree.map(lambda new, old: jnp.where(starts, new, old), controls, old)
    raw = target.lm_logits(tparams, tcfg, fwd.hidden[rows, last])  # [B, V]
    logits = grammar.restrict(raw, masks)
    if controls is None:
        root = sample(jax.random.fold_in(key, 0), logits, cfg.sampling)
    else:
        root = rows_sampling.sample(logits[:, None], controls, (start + n)[:, None])[:, 0]
    pair_tokens = next_tokens.at[rows, last].set(jnp.where(final, root, next_tokens[rows, last]))
    draft_hidden = dcache = None
    if dcfg is not None:
        draft_hidden, dcache = _draft_context(
            dparams,
            dcfg,
            tparams["embed"],
            kv_cache.set_lengths(state.draft_cache, start),
            pair_tokens,
            _features(dcfg, fwd),
            n,
            span=None,
        )
        draft_hidden = jnp.where(fed[:, None], draft_hidden, state.draft_hidden)
    history = _write(state.history, start, tokens, n)
    recorded = state.logprobs
    if recorded is not None:  # the root's, at output position 0
        recorded = lps.start(recorded, starts, wanted)
        at, first = jnp.zeros_like(start), jnp.zeros((b, 1), jnp.int32)
        recorded = lps.record(recorded, raw[:, None], first, root[:, None], at, starts.astype(jnp.int32))
    return SpecState(
        target_cache=kv_cache.advance(fwd.cache, n),
        draft_cache=dcache,
        root=jnp.where(starts, root, state.root),
        draft_hidden=draft_hidden,
        history=history.at[rows, jnp.where(starts, start + n, history.shape[1])].set(root, mode="drop"),
        out=jnp.where(starts[:, None], PAD_ID, state.out),
        counts=jnp.where(starts, 0, state.counts),
        limits=jnp.where(starts, limits, state.limits),
        done=jnp.where(fed, ~final | (limits <= 0), state.done),
        eos=jnp.where(fed, False, state.eos),
        cycle=jnp.where(jnp.any(starts), 0, state.cycle),
        accept_lengths=jnp.where(starts[None, :], -1, state.accept_lengths),
        key=key,
        controls=controls,
        logprobs=recorded,
        sources=state.sources,
    )


def empty_state(cfg: DecodeConfig, batch: int, capacity: int, dtype) -> SpecState:
    """A state with empty caches and every row done: what `extend` feeds a conversation into."""
    tcfg, dcfg = cfg.tcfg, cfg.dcfg
    head = dcfg is not None
    return SpecState(
        target_cache=target.init_cache(tcfg, batch, capacity, dtype),
        draft_cache=draft.init_cache(dcfg, batch, capacity, dtype) if head else None,
        root=jnp.zeros((batch,), jnp.int32),
        draft_hidden=jnp.zeros((batch, dcfg.hidden_size), dtype) if head else None,
        history=jnp.full((batch, capacity), PAD_ID, jnp.int32),
        out=jnp.full((batch, capacity), PAD_ID, jnp.int32),
        counts=jnp.zeros((batch,), jnp.int32),
        limits=jnp.zeros((batch,), jnp.int32),
        done=jnp.ones((batch,), bool),
        eos=jnp.zeros((batch,), bool),
        cycle=jnp.int32(0),
        accept_lengths=jnp.full((capacity, batch), -1, jnp.int32),
        key=jax.random.key(0),
        logprobs=lps.empty(batch, capacity, cfg.logprobs) if cfg.logprobs else None,
        sources=jnp.zeros((batch, capacity), jnp.int8),
    )


def _lengths(s: SpecState) -> tuple[jax.Array, ...]:
    return (s.target_cache.lengths,) if s.draft_cache is None else (s.target_cache.lengths, s.draft_cache.lengths)


def host_slots_needed(s: SpecState, tree: TreeConfig) -> np.ndarray:
    """`slots_needed` read on the host."""
    return np.max(distributed.host_value(_lengths(s)), axis=0) + tree.cache_overhead


def slots_needed(s: SpecState, tree: TreeConfig) -> jax.Array:
    """Cache slots [B] each row's next cycle writes up to (in the target's and the draft's cache)."""
    return functools.reduce(jnp.maximum, _lengths(s)) + tree.cache_overhead


def one_cycle(
    tparams, dparams, s: SpecState, cfg: DecodeConfig, span: int | None, masks: jax.Array | None = None
) -> tuple[SpecState, Tree]:
    """One draft -> verify -> accept cycle attending over `span` cache slots (which must hold every
    running row's `slots_needed`). Returns the new state and this cycle's tree. `masks` [B, N, W]: the tokens the
    target may choose after each node (`grammar`; a plain step's root only, as the tree is drafted here).

    When no running row has context candidates, only the head's part of the tree is verified (the root alone
    without a head: plain decoding's step): it accepts what the whole tree would, at the cost of a smaller
    forward."""
    tr, dcache, wide = draft_tree(tparams, dparams, s, cfg, span)
    return verify_tree(tparams, dparams, s, tr, dcache, wide, cfg, span, masks), tr


def draft_tree(
    tparams,
    dparams,
    s: SpecState,
    cfg: DecodeConfig,
    span: int | None,
    forced: tuple | None = None,
    first: jax.Array | None = None,
) -> tuple[Tree, KVCache | None, jax.Array | None]:
    """The cycle's tree, the head's cache after drafting it, and whether a running row has context candidates (None
    without context candidates). `forced` (tokens [B, context], valid [B, context]): chains a grammar forces,
    drafted instead of the context candidates of the rows that have one. `first` [B, W]: the tokens a grammar
    allows after the root, the only ones the head drafts at the first level."""
    tcfg, dcfg, tree = cfg.tcfg, cfg.dcfg, cfg.tree
    embed = tparams["embed"]
    head = target.output_head(tparams, tcfg)
    candidates = None
    if tree.context:
        with jax.named_scope("context"):  # prompt lookup in the row's own history
            history = s.history if span is None else s.history[:, :span]
            candidates = context.propose(history, s.target_cache.lengths, tree.context, tree.min_match)
            if forced is not None:
                use = forced[1][:, :1]  # [B, 1]
                candidates = (jnp.where(use, forced[0], candidates[0]), jnp.where(use, forced[1], candidates[1]))
    if tree.needs_head:
        with jax.named_scope("draft_levels"):
            ids, logp = grammar.draft_top_k(dparams, dcfg, s.draft_hidden, head, tree.top_k, first)
        expand = _expand_fn(dparams, dcfg, embed, head, tree.top_k, span)
        start = trees.TreeStart(s.root, s.draft_hidden, ids, logp, s.draft_cache.lengths)
        tr, dcache = trees.build(tree, start, expand, s.draft_cache, candidates)
    else:
        start = trees.TreeStart(s.root, s.draft_hidden, None, None, None)
        tr, dcache = trees.build(tree, start, None, s.draft_cache, candidates)
    return tr, dcache, None if candidates is None else jnp.any(candidates[1][:, 0] & ~s.done)


def verify_tree(
    tparams,
    dparams,
    s: SpecState,
    tr: Tree,
    dcache: KVCache | None,
    wide: jax.Array | None,
    cfg: DecodeConfig,
    span: int | None,
    masks: jax.Array | None = None,
) -> SpecState:
    """The target's forward over the tree `tr` (`draft_tree`: its cache and `wide`), its choices under masks
    [B, N, W] (every token where None), acceptance and the commit: the state after the cycle."""
    tree, embed = cfg.tree, tparams["embed"]
    forward = functools.partial(_forward, tparams, s, cfg=cfg, span=span)
    if not tree.context:
        fwd, choice = forward(tr, write=True, masks=masks)
    else:  # the cache is only read under the cond (written there, XLA would copy it whole): the path, after
        n, width = tree.head_nodes, tr.tokens.shape[1]  # without candidates, only the head's part (or the root)
        keep_logits = s.logprobs is not None  # logprobs read them after acceptance

        def narrow():
            part = Tree(tr.tokens[:, :n], tr.parents[:, :n], tr.depths[:, :n], tr.mask[:, :n, :n])
            fwd, choice = forward(part, write=False, masks=None if masks is None else masks[:, :n])
            pad = lambda a, axis: jnp.pad(a, [(0, width - n if d == axis else 0) for d in range(a.ndim)])  # noqa: E731
            logits, kv = pad(fwd.logits, 1) if keep_logits else None, tuple(pad(a, 3) for a in fwd.new_kv)
            return logits, pad(fwd.hidden, 1), pad(fwd.features, 1), kv, pad(choice, 1)

        def full():
            fwd, choice = forward(tr, write=False, masks=masks)
            return fwd.logits if keep_logits else None, fwd.hidden, fwd.features, fwd.new_kv, choice

        logits, hidden, features, new_kv, choice = jax.lax.cond(wide, full, narrow)
        fwd = target.TargetOutput(logits, hidden, features, s.target_cache, new_kv)
    return _verify(dparams, s, dcache, tr, fwd, choice, cfg=cfg, span=span, embed=embed)


def _forward(
    tparams, s: SpecState, tr: Tree, *, cfg: DecodeConfig, span: int | None, write: bool, masks: jax.Array | None
) -> tuple[target.TargetOutput, jax.Array]:
    """One target forward over the tree (writing its entries into the cache, or not: `target.forward`) and the
    target's choices [B, N]: the token it takes after each node, among those masks [B, N, W] allow."""
    tcfg = cfg.tcfg
    with jax.named_scope("verify"):
        positions = s.target_cache.lengths[:, None] + tr.depths
        fwd = target.forward(
            tparams,
            tcfg,
            jnp.maximum(tr.tokens, 0),  # unused context slots (NO_TOKEN) are verified as token 0
            positions,
            s.target_cache,
            mask=tr.mask,
            feature_layers=_feature_layers(tcfg, cfg.dcfg),
            span=span,
            write=write,
        )
    with jax.named_scope("sample"):
        return fwd, _draw(s, grammar.restrict(fwd.logits, masks), cfg.sampling, s.cycle + 1, positions + 1)


def _verify(
    dparams,
    s: SpecState,
    dcache: KVCache | None,
    tr: Tree,
    fwd: target.TargetOutput,
    choice: jax.Array,
    *,
    cfg: DecodeConfig,
    span: int | None,
    embed: jax.Array,
) -> SpecState:
    """Accept from the target's choices [B, N] over the tree `tr` (of shape `cfg.tree`), commit, let the head catch
    up; rows stop when their next cycle would need more than the tree's slots past the cache."""
    tcfg, dcfg, tree = cfg.tcfg, cfg.dcfg, cfg.tree
    rows = jnp.arange(s.root.shape[0])
    running = ~s.done
    with jax.named_scope("accept"):  # the deepest node whose whole path agrees; emit up to the budget and eos
        accept_len, path, bonus = acceptance.accept(tr, choice, tree.path_len)
        emitted = jnp.take_along_axis(tr.tokens, path, axis=1)  # root + accepted drafts (valid <= accept_len)
        commit = jnp.where(running, accept_len + 1, 0)
        out, counts, hit_eos = emit(s.out, s.counts, s.limits, emitted, commit, tcfg)
    with jax.named_scope("compact"):  # the accepted target entries to contiguous slots (a chain's already are)
        if fwd.new_kv is not None:
            tcache = kv_cache.write_path(fwd.cache, *fwd.new_kv, path)
        else:
            tcache = fwd.cache if tree.is_chain else kv_cache.compact(fwd.cache, path)
        tcache = kv_cache.advance(tcache, commit)
    pair_tokens = jnp.concatenate([emitted[:, 1:], emitted[:, :1]], axis=1).at[rows, accept_len].set(bonus)
    draft_hidden = s.draft_hidden
    if dcfg is not None:
        with jax.named_scope("draft_catch_up"):  # the draft reads the accepted features
            feats = jnp.take_along_axis(_features(dcfg, fwd), path[:, :, None], axis=1)
            new_hidden, dcache = _draft_context(dparams, dcfg, embed, dcache, pair_tokens, feats, commit, span)
            draft_hidden = jnp.where(running[:, None], new_hidden, s.draft_hidden)
    recorded = s.logprobs
    if recorded is not None:  # the target's logprobs after each accepted node: of the accepted drafts and the bonus
        recorded = lps.record(recorded, fwd.logits, path, pair_tokens, s.counts + 1, commit)
    eos = s.eos | hit_eos
    sources = None if s.sources is None else _write(s.sources, s.counts, node_sources(path, tree), counts - s.counts)
    room = tcache.lengths + tree.cache_overhead <= tcache.capacity
    done = s.done | eos | (counts >= s.limits) | ~room
    return SpecState(
        target_cache=tcache,
        draft_cache=dcache,
        root=jnp.where(running, bonus, s.root),
        draft_hidden=draft_hidden,
        history=_write(s.history, s.target_cache.lengths + 1, pair_tokens, commit),  # accepted drafts, bonus
        out=out,
        counts=counts,
        limits=s.limits,
        done=done,
        eos=eos,
        cycle=s.cycle + 1,
        accept_lengths=s.accept_lengths.at[s.cycle].set(jnp.where(running, accept_len, -1), mode="drop"),
        key=s.key,
        controls=s.controls,
        logprobs=recorded,
        sources=sources,
    )


def node_sources(path: jax.Array, tree: TreeConfig) -> jax.Array:
    """The source (index into `SOURCES`) of each node of paths [B, P]: the root is the target's own token, then the
    head's nodes (a context candidate equal to one merged into it), then the context branch grafted after them."""
    return jnp.where(path == 0, 0, jnp.where(path < tree.head_nodes, 1, 2)).astype(jnp.int8)


def _draw(s: SpecState, logits: jax.Array, sampling: SamplingConfig, step, positions: jax.Array) -> jax.Array:
    """The target's choices [B, N] from logits [B, N, V] for the tokens at sequence positions [B, N]: with
    the state's per-row controls when it has them, else the static `sampling` and the shared key at `step`."""
    if s.controls is not None:
        return rows_sampling.sample(logits, s.controls, positions)
    return sample(jax.random.fold_in(s.key, step), logits, sampling)


@functools.partial(jax.jit, static_argnames=("cfg", "span"), donate_argnames=("state",))
def cycle(
    tparams,
    dparams,
    state: SpecState,
    rows: jax.Array | None = None,
    masks: jax.Array | None = None,
    *,
    cfg: DecodeConfig,
    span: int | None = None,
) -> tuple[SpecState, Tree]:
    """One jitted cycle (the streaming path) of every row, or of `rows` [R] (distinct int32) only: a server's live
    rows cost what R rows cost, and the others are left as they are. `masks` [R, N, W]: `one_cycle`."""
    if rows is None:
        return one_cycle(tparams, dparams, state, cfg, span, masks)
    part, tr = one_cycle(tparams, dparams, take_rows(state, rows), cfg, span, masks)
    return put_rows(state, part, rows), tr


@functools.partial(jax.jit, static_argnames=("cfg", "span"), donate_argnames=("state",))
def cycle_draft(
    tparams,
    dparams,
    state: SpecState,
    rows: jax.Array | None = None,
    forced: tuple | None = None,
    first: jax.Array | None = None,
    *,
    cfg: DecodeConfig,
    span: int | None = None,
) -> tuple[SpecState, Tree, jax.Array | None]:
    """A cycle's first half (rows whose tree is masked by a grammar on the host): the state holding the head's
    cache as drafting left it, the tree and `wide` (`draft_tree`, its `forced` and `first`); `cycle_verify` finishes
    the cycle."""
    part = state if rows is None else take_rows(state, rows)
    tr, dcache, wide = draft_tree(tparams, dparams, part, cfg, span, forced, first)
    part = dataclasses.replace(part, draft_cache=dcache)
    return (part if rows is None else put_rows(state, part, rows)), tr, wide


@functools.partial(jax.jit, static_argnames=("cfg", "span"), donate_argnames=("state",))
def cycle_verify(
    tparams,
    dparams,
    state: SpecState,
    tr: Tree,
    wide: jax.Array | None,
    masks: jax.Array,
    rows: jax.Array | None = None,
    *,
    cfg: DecodeConfig,
    span: int | None = None,
) -> SpecState:
    """A cycle's second half after `cycle_draft`: the tree verified under masks [R, N, W] (`verify_tree`)."""
    part = state if rows is None else take_rows(state, rows)
    part = verify_tree(tparams, dparams, part, tr, part.draft_cache, wide, cfg, span, masks)
    return part if rows is None else put_rows(state, part, rows)


@functools.partial(jax.jit, static_argnames=("cfg",))
def regraft(tr: Tree, wide: jax.Array, candidates: tuple, *, cfg: DecodeConfig) -> tuple[Tree, jax.Array]:
    """Between `cycle_draft` and `cycle_verify`: the tree with new context candidates (tokens [R, context], valid
    [R, context]) in the rows that have any (`tree.regraft`), and whether a row has candidates now."""
    return trees.regraft(cfg.tree, tr, candidates), wide | jnp.any(candidates[1][:, 0])


def take_rows(s: SpecState, rows: jax.Array) -> SpecState:
    """The state of rows [R]: their values, and caches that are views of theirs (written in place)."""
    pick = functools.partial(jax.tree.map, lambda a: a[rows])
    return dataclasses.replace(
        s,
        target_cache=kv_cache.view(s.target_cache, rows),
        draft_cache=None if s.draft_cache is None else kv_cache.view(s.draft_cache, rows),
        logprobs=None if s.logprobs is None else lps.view(s.logprobs, rows),
        **{name: pick(getattr(s, name)) for name in _PER_ROW},
        accept_lengths=s.accept_lengths[:, rows],
    )


def put_rows(s: SpecState, part: SpecState, rows: jax.Array) -> SpecState:
    """The whole state `s` with the state `part` of rows [R] (`take_rows`, then stepped) put back."""
    put = functools.partial(jax.tree.map, lambda a, b: a.at[rows].set(b))
    return dataclasses.replace(
        part,
        target_cache=kv_cache.merge(s.target_cache.lengths, part.target_cache),
        draft_cache=None if s.draft_cache is None else kv_cache.merge(s.draft_cache.lengths, part.draft_cache),
        logprobs=None if s.logprobs is None else lps.merge(s.logprobs.wanted, part.logprobs),
        **{name: put(getattr(s, name), getattr(part, name)) for name in _PER_ROW},
        accept_lengths=s.accept_lengths.at[:, rows].set(part.accept_lengths),
    )


def run_loop(tparams, dparams, state: SpecState, cfg: DecodeConfig, span: int | None = None) -> SpecState:
    """Cycles as one `lax.while_loop` (no host round trip per cycle) until every row is done or a
    running row's next cycle would write past `span` cache slots (default: the whole cache).

    With context candidates in the tree, the cycles in which no running row has one run the tree without them
    (`bare`: what the whole tree accepts then, the same tokens and draws) in a loop of their own, at that tree's
    cost; the whole tree runs once each time a candidate appears (a loop run at most once: a cond whose branches
    wrote the caches would copy them)."""
    span = kv_cache.span_of(state.target_cache, span)

    def go_on(s: SpecState) -> jax.Array:
        return ~jnp.all(s.done) & jnp.all(s.done | (slots_needed(s, cfg.tree) <= span))

    def cycles(settings: DecodeConfig):
        return lambda s: one_cycle(tparams, dparams, s, settings, span)[0]

    if not cfg.tree.context:
        return jax.lax.while_loop(go_on, cycles(cfg), state)
    bare = dataclasses.replace(cfg, tree=dataclasses.replace(cfg.tree, context=0))

    def found(s: SpecState) -> jax.Array:
        with jax.named_scope("context"):
            _, valid = context.propose(
                s.history[:, :span], s.target_cache.lengths, cfg.tree.context, cfg.tree.min_match
            )
        return jnp.any(valid[:, 0] & ~s.done)

    def whole(c: tuple[SpecState, jax.Array]) -> tuple[SpecState, jax.Array]:
        return cycles(cfg)(c[0]), jnp.bool_(True)

    def rounds(s: SpecState) -> SpecState:
        s = jax.lax.while_loop(lambda s: go_on(s) & ~found(s), cycles(bare), s)
        # the whole tree once, when a candidate ended the bare cycles
        return jax.lax.while_loop(lambda c: go_on(c[0]) & ~c[1], whole, (s, jnp.bool_(False)))[0]

    return jax.lax.while_loop(go_on, rounds, state)


run_span = jax.jit(run_loop, static_argnames=("cfg", "span"), donate_argnames=("state",))


def prepare(
    prompts: list[list[int]], max_new_tokens: int, cfg: DecodeConfig, capacity: int | None = None
) -> schedule.Prompts:
    """Size and pad prompts; the cache holds prompt + budget + one cycle's tree."""
    return schedule.prepare(
        prompts,
        max_new_tokens,
        cfg.tree.cache_overhead,
        capacity,
        cfg.tcfg.rope.max_position_embeddings,
        cfg.tcfg.pad_token_id or 0,
    )
