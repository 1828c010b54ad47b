"""The OpenAI Batch API on ``batchline serve``: ``/v1/files`` and ``/v1/batches``.

``store`` keeps the metadata (SQLite) and the files (the data directory), ``runner`` runs each
batch through ``batchline run``'s pipeline on the served models at ``batch`` priority, and
``routes`` answers OpenAI's calls, so the openai-python client works unchanged::

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY)
    batch_input = client.files.create(file=open("requests.jsonl", "rb"), purpose="batch")
    batch = client.batches.create(input_file_id=batch_input.id,
                                  endpoint="/v1/embeddings", completion_window="24h")
    batch = client.batches.retrieve(batch.id)   # ... until batch.status == "completed"
    results = client.files.content(batch.output_file_id).text

See ``docs/batch-api.md``. Nothing here is imported until the app starts (FastAPI).
"""

from __future__ import annotations

__all__: list[str] = []
