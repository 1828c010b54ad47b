"""Built-in demo prompts: grade-school math word problems made from templates (no download).

>>> prompts = demo_prompts(3)
>>> sorted(prompts[0])
['answer', 'id', 'prompt']

The same ``(n, seed)`` gives the same prompts on every Python version and platform: numbers
come from a SplitMix64 generator written here (integer arithmetic only; neither ``random`` nor
``hash()``), and the JSONL is written with fixed separators and key order.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from batchline._cache import write_whole

__all__ = ["DemoPrompt", "demo_prompts", "write_demo_prompts"]

_MASK = (1 << 64) - 1

_NAMES = (
    ("Ava", "she"), ("Ben", "he"), ("Chloe", "she"), ("Diego", "he"), ("Emma", "she"),
    ("Farid", "he"), ("Grace", "she"), ("Hiro", "he"), ("Ines", "she"), ("Jonas", "he"),
    ("Kemi", "she"), ("Liam", "he"), ("Maya", "she"), ("Noah", "he"), ("Olga", "she"),
    ("Pedro", "he"), ("Quinn", "she"), ("Ravi", "he"), ("Sara", "she"), ("Tomas", "he"),
)  # fmt: skip
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cards", "shells", "stamps", "books")
_FOODS = ("cookies", "muffins", "cupcakes", "pancakes", "dumplings")


class DemoPrompt(TypedDict):
    """One demo record: ``id`` (``"gsm-0000"``...), ``prompt`` (the question and an
    instruction to end with the number) and ``answer`` (the integer solution)."""

    id: str
    prompt: str
    answer: int


class _SplitMix64:
    """A tiny deterministic generator (Steele, Lea & Flood's SplitMix64)."""

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK

    def next(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def between(self, low: int, high: int) -> int:
        """An integer in ``[low, high]`` (the modulo bias is irrelevant here)."""
        return low + self.next() % (high - low + 1)

    def pick(self, options: tuple[str, ...]) -> str:
        return options[self.next() % len(options)]

    def person(self) -> tuple[str, str]:
        return _NAMES[self.next() % len(_NAMES)]


def _buy_and_give(r: _SplitMix64) -> tuple[str, int]:
    (name, pronoun), item = r.person(), r.pick(_ITEMS)
    a, b = r.between(5, 60), r.between(2, 40)
    c = r.between(1, a + b)
    return (
        f"{name} has {a} {item}. {pronoun.capitalize()} buys {b} more and then gives {c} to a "
        f"friend. How many {item} does {name} have now?",
        a + b - c,
    )


def _boxes(r: _SplitMix64) -> tuple[str, int]:
    item = r.pick(_ITEMS)
    a, b = r.between(3, 24), r.between(2, 15)
    return f"A box holds {a} {item}. How many {item} are there in {b} boxes?", a * b


def _pages(r: _SplitMix64) -> tuple[str, int]:
    (name, _), per_day, days = r.person(), r.between(5, 40), r.between(2, 20)
    return (
        f"{name} reads {per_day} pages every day. How many days does it take {name} to read a "
        f"book of {per_day * days} pages?",
        days,
    )


def _change(r: _SplitMix64) -> tuple[str, int]:
    (name, pronoun), price, count = r.person(), r.between(3, 25), r.between(2, 6)
    paid = (price * count // 10 + 1 + r.between(0, 4)) * 10
    return (
        f"A notebook costs ${price}. {name} buys {count} notebooks and pays with ${paid}. "
        f"How many dollars of change does {pronoun} get?",
        paid - price * count,
    )


def _teams(r: _SplitMix64) -> tuple[str, int]:
    teams, size = r.between(2, 9), r.between(3, 12)
    return (
        f"{teams * size} students are split evenly into {teams} teams. How many students are "
        "on each team?",
        size,
    )


def _train(r: _SplitMix64) -> tuple[str, int]:
    speed, hours = r.between(4, 12) * 10, r.between(2, 9)
    return (
        f"A train travels at {speed} kilometers per hour for {hours} hours. How many "
        "kilometers does it travel?",
        speed * hours,
    )


def _savings(r: _SplitMix64) -> tuple[str, int]:
    (name, pronoun), weekly, weeks = r.person(), r.between(4, 30), r.between(3, 12)
    spent = r.between(1, weekly * weeks)
    return (
        f"{name} saves ${weekly} every week. After {weeks} weeks {pronoun} spends ${spent} on a "
        "present. How many dollars does {name} have left?".replace("{name}", name),
        weekly * weeks - spent,
    )


def _legs(r: _SplitMix64) -> tuple[str, int]:
    chickens, cows = r.between(2, 30), r.between(1, 20)
    return (
        f"A farm has {chickens} chickens and {cows} cows. How many legs do these animals have "
        "in total?",
        2 * chickens + 4 * cows,
    )


def _share(r: _SplitMix64) -> tuple[str, int]:
    (name, pronoun), food = r.person(), r.pick(_FOODS)
    friends, each, eaten = r.between(2, 8), r.between(2, 9), r.between(1, 6)
    return (
        f"{name} bakes {friends * each + eaten} {food} and eats {eaten} of them. "
        f"{pronoun.capitalize()} shares the rest equally among {friends} friends. How many "
        f"{food} does each friend get?",
        each,
    )


def _ages(r: _SplitMix64) -> tuple[str, int]:
    (a_name, _), (b_name, _) = r.person(), r.person()
    if a_name == b_name:
        b_name = "Zoe"
    age, gap, years = r.between(4, 15), r.between(2, 30), r.between(2, 10)
    return (
        f"{a_name} is {age} years old. {b_name} is {gap} years older than {a_name}. How old "
        f"will {b_name} be in {years} years?",
        age + gap + years,
    )


_TEMPLATES: tuple[Callable[[_SplitMix64], tuple[str, int]], ...] = (
    _buy_and_give,
    _boxes,
    _pages,
    _change,
    _teams,
    _train,
    _savings,
    _legs,
    _share,
    _ages,
)

_INSTRUCTION = "Solve the problem step by step, then end with 'The answer is N.'"


def demo_prompts(n: int = 300, *, seed: int = 0) -> list[DemoPrompt]:
    """``n`` grade-school math word problems, the same for the same ``(n, seed)``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = _SplitMix64(seed)
    out: list[DemoPrompt] = []
    for i in range(n):
        template = _TEMPLATES[rng.next() % len(_TEMPLATES)]
        question, answer = template(rng)
        out.append(
            {"id": f"gsm-{i:04d}", "prompt": f"{question}\n{_INSTRUCTION}", "answer": answer}
        )
    return out


def write_demo_prompts(path: str | Path, n: int = 300, *, seed: int = 0) -> Path:
    """Write :func:`demo_prompts` as JSONL (``{"id", "prompt", "answer"}`` per line).

    The file is replaced atomically, and left alone when it already holds these prompts (so a
    job resumed over it sees the same input only when the prompts are the same).
    """
    target = Path(path)
    data = "".join(
        json.dumps(record, ensure_ascii=False, separators=(", ", ": ")) + "\n"
        for record in demo_prompts(n, seed=seed)
    ).encode("utf-8")
    with contextlib.suppress(OSError):
        if target.read_bytes() == data:
            return target
    write_whole(target, data, "cache.demo")
    return target
