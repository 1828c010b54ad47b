"""The offline job's data layer, shared by ``batchline run``, ``batchline drive`` and Ray.

- ``batchline.jobs.sources``: ``open_source`` streams JSONL, CSV, Parquet and plain text as records.
- ``batchline.jobs.sinks``: ``ChunkWriter`` commits results in chunks, exactly once, resumably;
  ``read_output`` reads them back.
- ``batchline.jobs.corpus``: ``demo_corpus_path`` builds the offline demo corpus.

The submodules are imported where used, so importing this package needs no pyarrow.
"""
