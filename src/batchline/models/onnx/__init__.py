"""ONNX models behind the seam, one module per task: ``embed`` (text encoders), ``classify``
(sequence classifiers) and ``predict`` (tensors in, tensors out). Each is loaded by
:func:`batchline.models.loader.load_model` from a ``PATH.onnx`` spec."""
