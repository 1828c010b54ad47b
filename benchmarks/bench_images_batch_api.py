"""A batch file of image lines through ``/v1/batches`` against ``batchline run`` on the same
pictures as a folder, ratios in one run.

The pictures are the image benchmark's (``bench_images.make_images``: JPEGs of 0.3 to 12
megapixels from a fixed seed, written once to ``--workdir``). Each becomes one line of an
OpenAI batch file, its picture a data URI in infinity's shape::

    {"custom_id": "img-7", "method": "POST", "url": "/v1/classify",
     "body": {"model": "img", "input": ["data:image/jpeg;base64,..."], "modality": "image"}}

(``--route embeddings``: ``/v1/embeddings`` lines). Then, on the same model:

1. ``batchline run IMAGES/ --model FOLDER/`` in this process, before the server starts and
   after it stops (the mean of the two: the machine drifts), pictures per second over its
   pipeline's wall time (its model load left out);
2. ``batchline serve --model img=FOLDER/`` (127.0.0.1) answers the file as a batch: uploaded,
   created, polled until ``completed``; lines per second from creation to completion.


It prints both rates and their ratio (goal >= 0.85). The model: ``--route classify`` the image
classifier of the image benchmarks (``bench_images_peers.make_model``: a ViT-S/16-shaped
folder, random weights, 1,000 labels); ``--route embeddings`` a DINOv2-S/14-shaped folder
(random weights). Building either needs torch and transformers, once per ``--workdir``.

The file is large (2,000 pictures are ~600 MB of base64): the server is started with
``max_batch_file_bytes`` set to take it.

Usage::

    python benchmarks/bench_images_batch_api.py                        # 2,000 classify lines
    python benchmarks/bench_images_batch_api.py --route embeddings     # 2,000 embeddings lines
    python benchmarks/bench_images_batch_api.py --images 24            # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import tempfile
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from bench_batch_api import run_batch, started_serve
from bench_images import picture_folder
from bench_images_peers import make_model

URL = {"classify": "/v1/classify", "embeddings": "/v1/embeddings"}


def make_embedder(folder: Path) -> Path:
    """A random-weight DINOv2-S/14-shaped folder with its processor config (built once)."""
    import torch
    import transformers

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    config = transformers.Dinov2Config(
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=6,
        intermediate_size=1536,
        patch_size=14,
        image_size=224,
    )
    processor = transformers.BitImageProcessorPil(
        size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}
    )
    transformers.Dinov2Model(config).eval().save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def write_lines(path: Path, pictures: list[Path], url: str) -> Path:
    """The batch file: one line per picture, its JPEG a data URI."""
    with path.open("w") as f:
        for i, picture in enumerate(pictures):
            uri = "data:image/jpeg;base64," + base64.b64encode(picture.read_bytes()).decode()
            body = {"model": "img", "input": [uri], "modality": "image"}
            line = {"custom_id": f"img-{i}", "method": "POST", "url": url, "body": body}
            f.write(json.dumps(line) + "\n")
    return path


def run_folder(images: Path, model: Path, out: Path) -> float:
    """``batchline run`` over the folder, in this process: pictures per second."""
    from batchline.jobs.options import RunOptions
    from batchline.jobs.run import run

    summary = run(RunOptions(input=images, output=out, model=f"{model}/", overwrite=True))
    return summary.total_records / summary.wall_s


def serve_batch(model: Path, lines: Path, url: str, work: Path) -> float:
    """The batch file through a started ``batchline serve``: lines per second."""
    size = lines.stat().st_size
    flags = ["--model", f"img={model}/", "--set", f"max_batch_file_bytes={size + (1 << 20)}"]
    with started_serve(flags, work) as port:

        async def one() -> float:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
                return await run_batch(c, lines, url)

        return asyncio.run(one())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=int, default=2000, help="pictures, one line each")
    p.add_argument("--route", choices=tuple(URL), default="classify")
    p.add_argument("--shape", choices=("vit-s16", "resnet50"), default="vit-s16",
                   help="the classifier's shape (--route classify)")  # fmt: skip
    p.add_argument("--workdir", type=Path, default=None, help="keeps pictures and models")
    args = p.parse_args(argv)

    work = args.workdir or Path(tempfile.gettempdir()) / "bench-images-batch-api"
    work.mkdir(parents=True, exist_ok=True)
    pictures, images = picture_folder(work, args.images)
    if args.route == "classify":
        model = make_model(work / f"classifier-{args.shape}", args.shape)
    else:
        model = make_embedder(work / "dinov2-s14")
    url = URL[args.route]
    lines = write_lines(work / f"lines-{args.route}-{args.images}.jsonl", pictures, url)

    before = run_folder(images, model, work / "run-out")
    batch = serve_batch(model, lines, url, work)
    after = run_folder(images, model, work / "run-out")
    run_rate = (before + after) / 2
    print(f"pictures: {len(pictures):,}  route: {url}  file: {lines.stat().st_size / 1e6:,.0f} MB")
    print(f"batchline run (folder): {run_rate:.1f} pictures/s "
          f"(before the server {before:.1f}, after {after:.1f})")  # fmt: skip
    print(f"/v1/batches:            {batch:.1f} lines/s = {batch / run_rate:.2f}x batchline run "
          "(goal >= 0.85x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    if os.environ.get("BATCHLINE_CACHE_DIR") is None:
        print(
            "note: BATCHLINE_CACHE_DIR unset: models load from the default cache", file=sys.stderr
        )
    sys.exit(main())
