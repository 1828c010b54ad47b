"""The gate of ``precision = "auto"`` (:mod:`batchline.jobs.precision`): what a lower
precision's outputs must reach against fp32's, one candidate's measured figures, and the
choice among them. Standard library only: the text and the picture measurements
(:mod:`batchline.jobs.precision_pictures`) both fill :class:`Figures`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["AUTO_GATE", "MIN_GAIN", "Figures", "Gate", "decide"]

#: A candidate must be this much faster than fp32 to be chosen.
MIN_GAIN = 1.10


@dataclass(frozen=True, slots=True)
class Gate:
    """What a lower precision's outputs must reach against fp32's (``top1_agreement``: a
    classifier's labels, where measured)."""

    mean_cosine: float
    top10_overlap: float
    top1_agreement: float = 0.95


#: The issue-55 bar: the same vectors for every practical purpose (issue 51: and an image
#: classifier's labels agree on 95 % of the gate's photographs).
AUTO_GATE = Gate(mean_cosine=0.999, top10_overlap=0.95, top1_agreement=0.95)


@dataclass(frozen=True, slots=True)
class Figures:
    """One candidate's measurement: model-call records/s and its outputs against fp32's (or
    ``error``: it did not load or run). ``None``: not measured for this kind of model (an
    image model's neighbours; an embedder's labels)."""

    records_per_s: float = 0.0
    mean_cosine: float = 1.0
    top10_overlap: float | None = 1.0
    error: str = ""
    top1_agreement: float | None = None

    def misses(self, gate: Gate) -> str:
        """What misses ``gate``, in words ("" when it passes)."""
        if self.error:
            return self.error
        out = []
        if self.mean_cosine < gate.mean_cosine:
            out.append(f"cosine {self.mean_cosine:.4f} < {gate.mean_cosine}")
        if self.top10_overlap is not None and self.top10_overlap < gate.top10_overlap:
            out.append(f"top-10 {self.top10_overlap:.3f} < {gate.top10_overlap}")
        if self.top1_agreement is not None and self.top1_agreement < gate.top1_agreement:
            out.append(f"top-1 {self.top1_agreement:.3f} < {gate.top1_agreement}")
        return ", ".join(out)

    def agreement(self) -> str:
        """The quality figures measured, in words."""
        out = [f"cosine {self.mean_cosine:.5f}"]
        if self.top10_overlap is not None:
            out.append(f"top-10 {self.top10_overlap:.3f}")
        if self.top1_agreement is not None:
            out.append(f"top-1 {self.top1_agreement:.3f}")
        return ", ".join(out)


def decide(
    figures: Mapping[str, Figures],
    *,
    gate: Gate = AUTO_GATE,
    min_gain: float = MIN_GAIN,
    unit: str = "records",
) -> tuple[str, str]:
    """The precision ``figures`` (fp32's and each candidate's) choose, and why, in words
    (speeds in ``unit``/s)."""
    base = figures["fp32"].records_per_s
    notes: list[str] = []
    passing: dict[str, float] = {}
    for name, fig in figures.items():
        if name == "fp32":
            continue
        missed = fig.misses(gate)
        if missed:
            notes.append(f"{name} misses the gate ({missed})")
            continue
        ratio = fig.records_per_s / base if base > 0 else 0.0
        passing[name] = ratio
        notes.append(
            f"{name} x{ratio:.2f} fp32 ({fig.records_per_s:,.0f} vs {base:,.0f} {unit}/s), "
            f"{fig.agreement()}"
        )
    best = max(passing, key=lambda n: passing[n], default=None)
    if best is None or passing[best] < min_gain:
        if best is not None:
            notes.append(f"none faster than fp32 by x{min_gain:.2f}")
        return "fp32", "; ".join(notes) or "no other candidate"
    return best, "; ".join(notes)
