"""Your own Python as a model: ``batchline run data.jsonl --model own_function_model:factory``.

``factory()`` returns a batch function: it gets a list of records (each input row as a dict)
and returns one result per record. batchline batches the records, runs the function in a
worker thread, writes every result exactly once, and lists a record whose call raised in
``_skipped.jsonl`` (with ``--on-bad-record skip``), going on with the others.

Run it from this folder: ``python own_function_model.py``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def factory():  # type: ignore[no-untyped-def]
    def word_stats(records: list[dict[str, object]]) -> list[dict[str, object]]:
        results = []
        for record in records:
            text = str(record["text"])
            if not text.strip():
                raise ValueError("empty text")  # fails this record alone
            words = text.split()
            results.append({"words": len(words), "longest": max(words, key=len)})
        return results

    # optional: what a record costs in a batch (default 1 each); the batch budget is
    # --target-batch-tokens of these units
    word_stats.cost = lambda record: 1 + len(str(record["text"])) // 100  # type: ignore[attr-defined]
    return word_stats


def main() -> list[dict[str, object]]:
    from batchline.__main__ import main as batchline
    from batchline.datasets.sinks import read_output, read_skipped

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        texts = ["batching fills the device", "", "one request never waits", "lose nothing"]
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        out = Path(tmp) / "out"
        argv = ["run", str(data), "--model", "own_function_model:factory", "-o", str(out)]
        code = batchline([*argv, "--on-bad-record", "skip", "--quiet"])
        assert code == 0
        rows = [json.loads(r["result"]) for r in read_output(out).to_pylist()]
        for skipped in read_skipped(out):
            print("skipped:", skipped)
        print(rows)
        return rows


if __name__ == "__main__":
    main()
