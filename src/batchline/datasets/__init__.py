"""The dataset layer shared by ``batchline run``, ``batchline drive``, ``bench`` and Ray.

- ``batchline.datasets.sources``: ``open_source`` streams JSONL, CSV, Parquet and plain text as
  records.
- ``batchline.datasets.sinks``: ``ChunkWriter`` commits results in chunks, exactly once, resumably;
  ``read_output`` reads them back.
- ``batchline.datasets.corpus``: ``demo_corpus_path`` builds the offline demo corpus.
- ``batchline.datasets.outcomes``: what became of each record (result or failure).

The submodules are imported where used, so importing this package needs no pyarrow.
"""
