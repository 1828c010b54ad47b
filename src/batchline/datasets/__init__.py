"""The dataset layer shared by ``batchline run``, ``batchline drive``, ``bench`` and Ray.

- ``sources``: ``open_source`` streams JSONL, CSV, Parquet, plain text and ``.npy`` as records,
  one reader per format (``formats/``).
- ``pipeline``: the one loop of every job over a dataset; what runs the records is an adapter.
- ``sinks``: ``ChunkWriter`` commits results in chunks, exactly once, resumably (``manifest``);
  ``columns`` says how each result kind becomes an Arrow column; ``readers`` reads them back.
- ``outcomes``: what became of each record (result or failure); ``corpus``: the demo corpus.

The submodules are imported where used, so importing this package needs no pyarrow.
"""
