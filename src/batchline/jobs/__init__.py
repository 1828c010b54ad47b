"""``batchline run``: the offline job over a dataset (``cli``, ``run``, ``generate``, ``display``).

The dataset layer it reads and writes through lives in :mod:`batchline.datasets`.
"""
