"""What the backends share, below all of them: a backend imports from here, never from
another backend's inner modules, and nothing here imports a backend.

- ``files``: a folder's files as an identity reads them, a file's or folder's size, a
  package's version;
- ``folder``: what a Hugging Face model folder holds, read from its JSON files at parse time
  (``FolderModel``, ``detect_folder``);
- ``image_options``: ``ImageOptions``, the flags of a plain ``.onnx`` that reads pictures;
- ``minilm``: where the built-in encoder's weights package is;
- ``torch_weights`` and ``packed_linear``: transformers kept quiet while a model loads, and
  linears packed once for oneDNN (the generators' and the torch embedder's).
"""

from __future__ import annotations
