"""OpenAI's request and response shapes, written once for the server's routes and the batch
files (``batchline run`` on one, and the Batch API on ``batchline serve``)."""
