"""One reader per input format, each a ``Source`` subclass (``base.py``); ``open_source``
(``batchline.datasets.sources``) picks one by the file's extension. A new format is one new
module here and one line in ``sources._READERS``."""
