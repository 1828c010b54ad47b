"""Prefix affinity: ``drive --route generate`` sends the prompts of one long prefix to one replica.

A generation server's prefix cache (the torch engine's ``PrefixCache``, 4,096 positions by
default) prefills a prompt fast when it recently kept the long prefix the prompt starts with
(few-shot examples, a long instruction). Least-loaded routing sends every prefix to every
replica: with 40 few-shot prefixes over 2 replicas, each replica sees all 40 and its cache
thrashes. So, for a generation route, ``drive``:

1. keys each record by the prefix it shares with others (:func:`prefix_keys`: no tokenizer);
2. reads the records in windows and packs each window's requests prefix by prefix, the
   prefixes of one replica together (:func:`plan_requests`); the outputs stay in input order;
3. sends a request to its prefix's replica, the first of the up replicas in rendezvous order
   (:func:`rendezvous_score`: a replica that leaves or comes back moves only its own
   prefixes), while that replica is not overloaded (``EndpointPool.acquire``: at most
   ``affinity_slack`` chunks in flight beyond the least-loaded one, and none idle); otherwise
   to the least loaded.

The key. A record's key is a hash of its first ``L`` bytes (UTF-8) for the longest ``L`` in
:data:`LEVELS_BYTES` whose prefix some other record of the window shares, but not all of them:
the longest prefix that sets a group apart.

- 256 bytes (~64 tokens of English) is the shortest level: a shorter shared start (an
  instruction line, "Translate to French:") saves the cache little, and such prompts stay apart
  rather than collapse into one key. The chat template's header is added by the server, after
  keying: it is not in the text.
- A prefix every record of the window shares (one system prompt for the whole job) says nothing
  about where a record should go: every replica learns it by itself, and the records spread by
  their longer prefixes (a system prompt followed by 40 few-shot sets keys by the sets).
- A record that shares no level with another is keyed by its own first 16 KiB: such records
  spread evenly over the replicas by their hashes.
- Levels grow by x1.5 and x1.33 in turn, so two prefix sets that part within a level are told
  apart by the next one; 16,384 bytes (~4,096 tokens) is the last: the cache keeps no longer
  prefix.

Keys are computed per window (popularity needs the neighbours), over the records actually sent
(duplicates are answered without being sent); a prefix with two records or more in every window
keys the same in each, so it keeps its replica across windows.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import zip_longest

__all__ = ["LEVELS_BYTES", "Planned", "plan_requests", "prefix_keys", "rendezvous_score"]

#: The prefix lengths (UTF-8 bytes) a record is keyed by: see the module's docstring.
LEVELS_BYTES = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)

_DIGEST_BYTES = 8


def _level_digests(text: str) -> list[bytes]:
    """The digests of the text's first ``L`` bytes for each level, up to the first that holds
    the whole text (one pass: the hash of a level goes on from the previous one's)."""
    data = memoryview(text.encode("utf-8", "surrogatepass"))
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    out: list[bytes] = []
    start = 0
    for level in LEVELS_BYTES:
        h.update(data[start:level])
        start = level
        out.append(h.copy().digest())
        if level >= len(data):
            break
    return out


def prefix_keys(texts: Sequence[str]) -> list[bytes]:
    """One key per text of a window: the hash of its longest prefix level that another text
    of the window shares and not every one does, else of its own first 16 KiB.

        >>> rubric = "You triage tickets. " * 40          # a few-shot prefix, 800 bytes
        >>> a, b, c = prefix_keys([rubric + "ticket 1", rubric + "ticket 2", "hello"])
        >>> a == b != c
        True
    """
    digests = [_level_digests(t) for t in texts]
    # a digest stands for its bytes: two texts count together at a level only when they
    # share those bytes (a level's digest of a shorter text is that of its whole self)
    counts = Counter(d for levels in digests for d in levels)
    n = len(texts)
    keys: list[bytes] = []
    for levels in digests:
        telling = [d for d in levels if 2 <= counts[d] < n]
        keys.append(telling[-1] if telling else levels[-1])
    return keys


def rendezvous_score(key: bytes, url: str) -> int:
    """The key's score on an endpoint: a key belongs to the up endpoint that scores highest
    (rendezvous hashing), so an endpoint leaving or coming back moves only its own keys."""
    digest = hashlib.blake2b(key + url.encode(), digest_size=_DIGEST_BYTES).digest()
    return int.from_bytes(digest, "big")


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of a window: its records (indices into the window) and the key that routes
    it (its first record's; every prefix in it belonged to the same replica when planned)."""

    key: bytes
    indices: list[int]


def plan_requests(
    keys: Sequence[bytes], home: Callable[[bytes], Hashable], size: int
) -> list[Planned]:
    """A window's requests of at most ``size`` records: each prefix's records together (in
    input order), the prefixes of one replica (``home(key)``, as routing stands now) packed
    together, and the replicas' requests taken in turn, so that each replica's first requests
    go out together and the in-flight counts stay level while the window lasts.

    Small groups share a request rather than go alone: a request per record would leave
    ``--concurrency`` records in flight."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    groups: dict[bytes, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    by_home: dict[Hashable, list[bytes]] = {}
    for key in groups:
        by_home.setdefault(home(key), []).append(key)
    lanes: list[list[Planned]] = []
    for home_keys in by_home.values():
        lane: list[Planned] = []
        first, indices = b"", list[int]()
        for key in home_keys:
            for i in groups[key]:
                if not indices:
                    first = key
                indices.append(i)
                if len(indices) == size:
                    lane.append(Planned(first, indices))
                    indices = []
        if indices:
            lane.append(Planned(first, indices))
        lanes.append(lane)
    return [p for turn in zip_longest(*lanes) for p in turn if p is not None]
