"""ONNX models behind the seam, one module per task: ``embed`` (text encoders), ``classify``
(sequence classifiers) and ``predict`` (tensors in, tensors out), each with its ``load_*``
function; ``sessions`` lays out their ONNX Runtime sessions from the knobs, ``runtime`` runs
them, ``embedder`` and ``minilm`` are the text encoder and the built-in model's weights.
Nothing here imports the loader: :func:`batchline.models.loader.load_model` dispatches to
these modules, never the other way round."""
