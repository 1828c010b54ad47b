"""What the backends share, below all of them: a backend imports from here, never from
another backend's inner modules, and nothing here imports a backend.

- ``files``: a folder's files as an identity reads them, a file's or folder's size, a
  package's version.
"""

from __future__ import annotations
