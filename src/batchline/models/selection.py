"""The model a command runs, as one set of options: :class:`ModelSelection`.

``run``, ``bench`` and ``tune`` name a model the same way: a spec (``--model``) and the
options that say what it does (``--task``, ``--tokenizer``, ``--labels``, ``--pooling``,
``--normalize``, ``--top-k``). Their option classes take these fields from
:class:`ModelSelection`, their parsers the flags from :func:`add_model_arguments`, and
:func:`model_options` carries the parsed flags over. Standard library only: every
``--help`` imports it.

Example::

    p = argparse.ArgumentParser()
    add_model_arguments(p)
    options = BenchOptions(**model_options(p.parse_args(["--model", "clf.onnx"])))
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline.models.protocol import TASKS

if TYPE_CHECKING:
    from batchline.models.specs import ModelSpec

__all__ = [
    "MODEL_HELP",
    "TASK_HELP",
    "ModelSelection",
    "add_model_arguments",
    "add_model_spec_argument",
    "model_options",
    "parse_labels",
]

#: ``--model``'s one meaning in every command that loads a model (run, serve, bench, tune).
MODEL_HELP = (
    "a model spec: default (all-MiniLM-L6-v2 embeddings), smollm2 (text generation), "
    "PATH.onnx, PATH/ (a Hugging Face folder: embedder, classifier, reranker or causal LM, read "
    "for what it is), or module:factory (your own Python: a batch function or a model object), "
    "optionally named NAME=; see "
    "'batchline models list'"
)


@dataclass(kw_only=True)
class ModelSelection:
    """A model spec and its options, as ``batchline run`` reads them (``models/specs.py``)."""

    #: a model spec: ``default``, ``PATH.onnx``, ``module:factory`` (``batchline.models.specs``)
    model: str = "default"
    task: str | None = None
    tokenizer: Path | None = None
    labels: tuple[str, ...] | None = None
    pooling: str | None = None
    normalize: bool | None = None
    top_k: int | None = None

    def spec_options(self) -> dict[str, Any]:
        """The options of the spec (all but ``model`` and ``task``), as ``parse_specs`` and
        ``ModelSpec.with_options`` take them."""
        return {
            "tokenizer": self.tokenizer,
            "labels": self.labels,
            "pooling": self.pooling,
            "normalize": self.normalize,
            "top_k": self.top_k,
        }

    def parse_spec(self, task: str | None) -> ModelSpec:
        """The one spec these options name, with ``task`` (None: the spec's own default)."""
        from batchline.models.specs import parse_specs

        (spec,) = parse_specs([self.model], tasks=[task] if task else [], **self.spec_options())
        return spec

    def model_argv(self) -> list[str]:
        """The flags that name this model again, defaults left out (for a command to copy)."""
        argv: list[str] = []
        if self.model != "default":
            argv += ["--model", self.model]
        if self.task is not None:
            argv += ["--task", self.task]
        if self.tokenizer is not None:
            argv += ["--tokenizer", str(self.tokenizer)]
        if self.labels is not None:
            argv += ["--labels", ",".join(self.labels)]
        if self.pooling is not None:
            argv += ["--pooling", self.pooling]
        if self.normalize is not None:
            argv += ["--normalize" if self.normalize else "--no-normalize"]
        if self.top_k is not None:
            argv += ["--top-k", str(self.top_k)]
        return argv


#: The one description of ``--task`` (run, serve, bench, tune; serve adds how to name the
#: model it applies to). The README says the same: it overrides what was detected.
TASK_HELP = (
    f"what the model does: {', '.join(TASKS)}; overrides what was detected (a built-in "
    "model's task; a folder's, read from its config; a .onnx file's: embed if it takes "
    "input_ids, else predict)"
)


def parse_labels(text: str) -> tuple[str, ...]:
    """``--labels``: a file of one label a line (blank lines skipped) when ``text`` names one,
    else comma-separated labels."""
    path = Path(text)
    if path.is_file():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read labels file {path}: {exc}") from None
        labels = tuple(line.strip() for line in lines if line.strip())
        if not labels:
            raise argparse.ArgumentTypeError(f"labels file {path} holds no label")
        return labels
    return tuple(x.strip() for x in text.split(","))


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`ModelSelection` fields as parsed by :func:`add_model_arguments`: keyword
    arguments for any option class built on it."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelSelection)}


def add_model_spec_argument(p: argparse.ArgumentParser, *, several: bool, more: str = "") -> None:
    """``--model [NAME=]SPEC`` (:data:`MODEL_HELP`, then ``more``); ``several``: repeatable,
    parsed as a list or None, else one spec (default ``default``)."""
    p.add_argument(
        "--model",
        action="append" if several else "store",
        default=None if several else "default",
        metavar="[NAME=]SPEC",
        help=MODEL_HELP + more,
    )


def add_model_arguments(p: argparse.ArgumentParser, *, several: bool = False) -> None:
    """The flags that name a model (``run``, ``bench``, ``tune``): a spec and its options;
    ``several``: ``--model`` repeats (``run``'s OpenAI batch files), parsed as a list or None."""
    add_model_spec_argument(
        p,
        several=several,
        more="; repeatable for an OpenAI batch file, each line's body.model picking one by NAME "
        "(one generator, one embedding model and one reranker at most)"
        if several
        else "",
    )
    p.add_argument(
        "--task",
        choices=list(TASKS),
        metavar="TASK",
        help=TASK_HELP + "; generate alone runs the default generator, smollm2",
    )
    p.add_argument(
        "--tokenizer", type=Path, help="tokenizer.json of a text model (default: beside the .onnx)"
    )
    p.add_argument(
        "--labels",
        type=parse_labels,
        help="classify: comma-separated labels, or a file of one label a line (default: "
        "config.json's id2label beside the model; CLIP/SigLIP: classify images zero-shot)",
    )
    p.add_argument(
        "--pooling", choices=["mean", "cls", "lasttoken", "none"], help="embed: token pooling"
    )
    p.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        help="classify: keep the K likeliest labels per record (default: every label's score)",
    )
    p.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="embed: L2-normalise the vectors (default: yes when the model's output is pooled)",
    )
