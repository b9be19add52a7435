"""`bema verify`: a model bema wrote, rebuilt from the provenance in its weights (publish/verify.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from bema_cli import output
from bema_cli.errors import BemaError
from bema_cli.options import JsonOpt, argument, option


class Differs(BemaError):
    """The folder's weights are not what its record rebuilds."""

    exit_code = 1


def verify(
    folder: argument(str, help="A model folder bema wrote (stabilize, select --write, ship)."),
    run_dir: option(str | None, "--run", help="The run's folder, if it moved.") = None,
    base: option(str | None, "--base", help="theta0 (folder or Hub id), if it moved.") = None,
    json: JsonOpt = False,
) -> None:
    """Rebuild FOLDER from the record inside its safetensors files (the method and its settings, the steps, the coefficients, the inputs' fingerprints) and the inputs it names, and say bitwise which tensors differ. The record names its inputs (run/checkpoint-40), never by absolute paths: they are found near FOLDER by name and fingerprint, or where --run and --base say. Exit 0 when every tensor is identical, 1 when any differs (the inputs that changed since are named), 3 when there is no record or an input is gone or not found."""
    from bema_cli.publish.verify import verify as run

    doc = run(Path(folder), Path(run_dir) if run_dir else None, base)
    if json:  # one document on stdout, the difference said on stderr, exit 1
        output.print_json(doc)
        if not doc["identical"]:
            output.error(
                f"{folder}: {len(doc['differ'])} of {doc['tensors']} tensors differ from its rebuild"
                + ("; its coefficients are not its method's" if doc["vector_differs"] else "")
                + (f"; side files differ: {', '.join(doc['files_differ'])}" if doc["files_differ"] else "")
            )
            raise typer.Exit(1)
        return
    changed = "; ".join(doc["changed_inputs"])
    if doc["identical"]:
        said = f" ({len(doc['changed_inputs'])} input(s) changed since: {changed})" if changed else ""
        files = (  # what was checked beside the tensors, or said not to be
            f"; side files not checked (its record holds no digests of them): {', '.join(doc['not_checked'])}"
            if doc["not_checked"]
            else "; its config and tokenizer files are as written"
        )
        output.stdout.print(
            f"{folder}: bitwise identical to its rebuild ({doc['tensors']} tensors){said}{files}",
            highlight=False,
            markup=False,
        )
        return
    if doc["files_differ"] and not doc["differ"] and not doc["vector_differs"]:
        raise Differs(
            f"{folder}: its tensors are bitwise its rebuild, but side files differ from what bema wrote: "
            f"{', '.join(doc['files_differ'])} (edited since: the model may load or prompt differently)"
        )
    if doc["vector_differs"]:
        keys = ", ".join(doc["vector_differs"][:5])
        raise Differs(
            f"{folder}: the coefficients it records are not the ones its method and settings compute "
            f"(they differ at {keys}): its record was edited, or it was not written by bema"
        )
    more = f" and {len(doc['differ']) - 5} more" if len(doc["differ"]) > 5 else ""
    raise Differs(
        f"{folder}: {len(doc['differ'])} of {doc['tensors']} tensors differ from its rebuild: "
        f"{', '.join(doc['differ'][:5])}{more}"
        + (f"; inputs changed since it was written: {changed}" if changed else "")
    )
