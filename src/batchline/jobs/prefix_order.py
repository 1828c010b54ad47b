"""The order a generation job submits a block's prompts in: grouped by shared prefix, so that
the prompts of one prefix run while the engine's prefix cache holds it (``run``'s default;
``--no-prefix-ordering`` keeps input order). The output keeps input order either way."""

from __future__ import annotations

from collections.abc import Sequence

from batchline.datasets.outcomes import Failed

__all__ = ["submission_order"]


#: Prompts whose first this many tokens are the same share a prefix worth waiting for (the
#: prefix cache's own threshold).
_SHARED_PREFIX_TOKENS = 16


def _shares_prefix(a: Sequence[int], b: Sequence[int], common: int) -> bool:
    """Whether ``a`` and ``b`` share a prefix beyond the ``common`` tokens every prompt of the
    block starts with (a chat template's header)."""
    n = common + _SHARED_PREFIX_TOKENS
    return len(a) > n and len(b) > n and a[:n] == b[:n]


def _common_length(order: Sequence[int], encoded: Sequence[list[int] | Failed]) -> int:
    """How many first tokens all the block's prompts share (sorted: its first and last)."""
    ids = [x for x in (encoded[i] for i in order) if not isinstance(x, Failed)]
    if not ids:
        return 0
    first, last = ids[0], ids[-1]
    differ = (n for n, (x, y) in enumerate(zip(first, last, strict=False)) if x != y)
    return next(differ, min(len(first), len(last)))


def submission_order(
    encoded: Sequence[list[int] | Failed], *, grouped: bool
) -> list[tuple[int, int]]:
    """The order to submit a block's records in, each with its place in its group of shared
    prefix (0: it starts one): as read (every place 0), or (``grouped``) group by group, the
    records sorted by token ids, so that prompts that share a prefix run one after the other
    while the engine's prefix cache holds it (``PrefixCache`` learns a prefix from the last
    few prompts and keeps a few thousand positions: over many prefixes in a shuffled file it
    would keep few of them, and only by chance).

    In a group, the first and the last of its sorted prompts go first: they share exactly the
    group's prefix, which is what the cache keeps once the second is prefilled (two
    neighbours would share more, and the cache would keep a prefix the others do not start
    with). Records that failed to encode come first, each alone."""
    if not grouped:
        return [(i, 0) for i in range(len(encoded))]

    def tokens(i: int) -> tuple[int, ...]:
        ids = encoded[i]
        return () if isinstance(ids, Failed) else tuple(ids)

    order = sorted(range(len(encoded)), key=tokens)
    common = _common_length(order, encoded)
    groups: list[list[int]] = []
    previous: Sequence[int] = ()
    for i in order:
        ids = encoded[i]
        if isinstance(ids, Failed) or not groups or not _shares_prefix(previous, ids, common):
            groups.append([i])
        else:
            groups[-1].append(i)
        previous = () if isinstance(ids, Failed) else ids
    out: list[tuple[int, int]] = []
    for group in groups:
        firsts = [group[0], group[-1]] if len(group) > 1 else group
        out.extend((i, place) for place, i in enumerate([*firsts, *group[1:-1]]))
    return out
