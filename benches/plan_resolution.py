"""Plan resolution against the baselines, every size and plan, with the walk's floor; rewrites the
results section of docs/benchmarks.md.

    python benches/plan_resolution.py --sizes 8x16,61x256,61x1024,1M --plans deep,shallow,per_layer,globstar,typo,moe \\
        --json bench-results/plan_resolution.json --plot docs/plan_resolution.png --docs docs/benchmarks.md

The methods and the way each is timed are in ``resolution_methods.py``; this adds
``rust_walk_floor`` (a Rust walk over every module that matches nothing), ``hand_pruned_walk``
(a walk written by hand for the plan, in Rust: it enters only the modules the patterns' literal
segments lead to and compares names as strings, sharing nothing with the matcher; plans of
literals and ``*`` only) and the rewriting of the docs' table between its markers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import resolution_methods

from meshbind import PatternSet, _core

DOCS_START, DOCS_END = "<!-- bench:start -->", "<!-- bench:end -->"


def rust_walk_floor(target: resolution_methods.Target, plan: tuple[str, ...]) -> resolution_methods.Outcome:
    """A Rust walk over every module that matches nothing: the floor of any full walk."""
    if isinstance(target, list):
        raise resolution_methods.NotExpressible("no tree to walk")
    return resolution_methods.Outcome(len(PatternSet([]).walk(target, prune=False)), False)


def hand_pruned_walk(target: resolution_methods.Target, plan: tuple[str, ...]) -> resolution_methods.Outcome:
    """The plan walked by hand: the floor of a pruned walk (``_core._hand_pruned_walk``)."""
    if isinstance(target, list):
        raise resolution_methods.NotExpressible("no tree to walk")
    if any(part != "*" and not part.replace("_", "").isalnum() for pattern in plan for part in pattern.split(".")):
        raise resolution_methods.NotExpressible("a hand walk compares literal segments and '*' only")
    return resolution_methods.Outcome(_core._hand_pruned_walk(target, list(plan)), False)


METHODS: dict[str, resolution_methods.Method] = {
    **resolution_methods.METHODS,
    "rust_walk_floor": rust_walk_floor,
    "hand_pruned_walk": hand_pruned_walk,
}


def docs_text(path: str) -> str:
    """The document's text; a ``ValueError`` when it cannot be read or has no results section."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as error:
        raise ValueError(f"--docs {path}: {error.strerror}") from None
    if DOCS_START not in text or DOCS_END not in text:
        raise ValueError(f"--docs {path} has no {DOCS_START} ... {DOCS_END} section")
    return text


def update_docs(path: str, rows: Sequence[resolution_methods.Row], command: str, plot_path: str | None) -> None:
    """Replace the document's results section (between the bench markers) with this run's."""
    text = docs_text(path)
    body = [
        f"Machine: {resolution_methods.machine()}.",
        "",
        f"Regenerate: `{command}`",
        "",
        *resolution_methods.table(rows, markdown=True),
        "",
    ]
    body += [f"- {line}" for line in resolution_methods.summary(rows)]
    if plot_path:
        body += ["", f"![plan resolution, log-log]({os.path.relpath(plot_path, os.path.dirname(os.path.abspath(path)))})"]
    head, rest = text.split(DOCS_START, 1)
    tail = rest.split(DOCS_END, 1)[1]
    with open(path, "w") as f:
        f.write(head + DOCS_START + "\n" + "\n".join(body) + "\n" + DOCS_END + tail)


def main(argv: Sequence[str] | None = None) -> int:
    flags = resolution_methods.parser(
        "plan_resolution.py", __doc__ or "", "8x16,61x256,61x1024", "deep,shallow", None, list(METHODS)
    )
    flags.add_argument("--docs", metavar="PATH", help="rewrite the results section of this document")
    args = resolution_methods.parse(flags, argv, METHODS)
    if args.docs:
        try:
            docs_text(args.docs)
        except ValueError as error:
            flags.error(str(error))
    rows = resolution_methods.run_each_size_apart(
        args.sizes, args.plans, args.repeat, {name: METHODS[name] for name in args.methods}
    )
    resolution_methods.report(args, rows)
    if args.docs:
        command = "python benches/plan_resolution.py " + " ".join(argv if argv is not None else sys.argv[1:])
        update_docs(args.docs, rows, command, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
