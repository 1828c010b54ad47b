"""Hugging Face model folders behind the seam: a folder as people hold it (a
sentence-transformers embedder, a sequence classifier, a cross-encoder reranker, a causal LM,
or a folder with a ``model.onnx``) is read once for what it is, converted once to what runs it
fast, and loaded by the backend that fits.

Nothing here is imported by ``batchline.models.loader`` at module level; the conversion needs
torch only where the folder's architecture has no graph builder of our own.
"""
