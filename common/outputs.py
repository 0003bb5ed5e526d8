"""The checks that an output a user names can be written, made before the work that produces it: never
over an input, inside a checkpoint or a prepared data directory, or over a run's records."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from fathom.common.checkpoint_format import is_checkpoint
from fathom.common.errors import ConfigError
from fathom.common.run_layout import LATEST, META_FILE, is_run


def check_makeable(out: Path, name: str) -> None:
    """`out` is a directory, or one that can be made: found out by making (and removing) a directory in
    its nearest existing ancestor, which leaves nothing behind. `name`: the option that gave it."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{name}: {out} is a file; choose a directory")
    chain = (out.absolute(), *out.absolute().parents)
    if dangling := next((p for p in chain if p.is_symlink() and not p.exists()), None):
        raise ConfigError(
            f"{name}: {dangling} is a link to {os.readlink(dangling)}, which does not exist; create that "
            "directory, or remove the link"
        )
    existing = next(p for p in chain if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{name}: {existing} is a file, so {out} cannot be made; choose another")
    for folder in chain[1:]:  # what fathom checksums, or replaces and deletes whole, holds nothing else
        if (folder / META_FILE).exists():
            raise ConfigError(f"{name}: {out} is inside the prepared data directory {folder}; choose another")
        if is_checkpoint(folder):
            raise ConfigError(
                f"{name}: {out} is inside the checkpoint {folder}, which holds only its own files (a best one is "
                "deleted whole once superseded); choose another"
            )
    check_writable_folder(existing, f"{name}:")


def check_files_folder(out: Path, name: str) -> None:
    """`out` can take a command's files beside what it holds (zero_to_fp32's OUTPUT_DIR, which may exist and is
    never replaced whole): check_makeable's checks, and `out` is itself none of the folders fathom reads
    back or deletes whole: a checkpoint, a folder of a training run (where its checkpoints go: a later save,
    a better best or a reshape lands on or deletes a tag-named one), a prepared data directory."""
    folder = out.resolve()  # a link to a checkpoint, or RUN/x/.., is that folder
    if is_checkpoint(folder):
        raise ConfigError(
            f"{name}: {out} is a checkpoint, which holds only its own files (a best one is deleted whole once "
            "superseded); choose a directory outside the run"
        )
    if is_run(folder.parent):
        raise ConfigError(
            f"{name}: {out} is inside the training run {folder.parent}, whose folders are its checkpoints; choose "
            "a directory outside the run"
        )
    if (folder / META_FILE).exists():
        raise ConfigError(
            f"{name}: {out} is a prepared data directory, which holds only its own checksummed files; choose "
            "another directory"
        )
    check_makeable(out, name)  # last: it tries a write in the folder, which would touch those folders' times


def check_writable_folder(folder: Path, name: str) -> None:
    """New entries can be made in `folder`: tried by making (and removing) one."""
    try:
        tempfile.TemporaryDirectory(dir=folder, prefix=".fathom-write-test-").cleanup()
    except OSError as err:
        raise ConfigError(f"{name} cannot write in {folder} ({err.strerror}); choose another") from None


def check_writable_file(path: Path, name: str, inputs: Mapping[str, str | Path | None] | None = None) -> None:
    """`path` can be written (atomically, beside itself): not a directory, in a directory that takes new
    files, and none of the command's `inputs` (what reads them: path). Checked before the work that
    produces it."""
    if path.is_dir():
        raise ConfigError(f"{name} {path}: is a directory; name a file")
    if path.exists() and not path.is_file():  # a device or pipe, e.g. /dev/stdout: written in place
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{name} {path}: not writable; choose another")
        return
    target = Path(os.path.realpath(path))  # a link's target is what gets replaced
    folder = target.parent
    if not folder.is_dir():
        raise ConfigError(f"{name} {path}: {folder} is not a directory; create it or choose another")
    check_not_fathoms(target, f"{name} {path}")
    check_not_an_input(path, name, inputs or {})
    check_writable_folder(folder, f"{name} {path}:")


def check_not_an_input(path: Path, name: str, inputs: Mapping[str, str | Path | None]) -> None:
    """An output file is none of the files its command reads, however either path is spelled (relative,
    through a link, a hard link): written there, the input would be lost, or (a hard link) split from it."""
    for what, source in inputs.items():
        if source is not None and path.is_file() and Path(source).is_file() and os.path.samefile(path, source):
            raise ConfigError(
                f"{name} {path}: is the same file as {what} {source}, which it reads; choose another file"
            )


def check_not_fathoms(target: Path, name: str) -> None:
    """An output never lands among the files fathom reads back: a prepared data directory (every file
    checksummed), a run's checkpoints (its subdirectories), or a run's records, which are JSON, JSONL,
    torch files and `latest`; tools write their text and images beside those (generate.py's
    SAVE_DIR/generate-test.txt)."""
    folder = target.parent
    if (folder / META_FILE).exists():
        raise ConfigError(f"{name}: inside the prepared data directory {folder}; write it elsewhere")
    if is_run(folder.parent):
        raise ConfigError(f"{name}: inside the checkpoint {folder}; write it elsewhere")
    if (
        is_run(folder)
        and target.exists()
        and (target.suffix in (".json", ".jsonl", ".pt", ".py") or target.name == LATEST)
    ):
        raise ConfigError(f"{name}: would replace the training run's {target.name}; choose another file")


def check_output_dir(out: Path, force: bool, marker: str, inputs: Iterable[Path | str]) -> None:
    """An output directory that is new, empty, or, with --force, an earlier output of the same script:
    one holding `marker`, the file that script writes. --force never deletes anything else (a training
    run, the data, the current directory), nor a directory holding one of the `inputs`."""
    check_makeable(out, "--out")
    where = out.resolve()
    for path, what in ((Path.cwd(), "the current directory"), *((Path(p), f"the input {p}") for p in inputs)):
        if where == path.resolve() or where in path.resolve().parents:
            raise ConfigError(f"--out {out}: is or holds {what}, which replacing it would delete; choose another")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ConfigError(f"{out}: already exists; choose a new --out or pass --force to replace it")
        if not (out / marker).is_file():
            raise ConfigError(
                f"--out {out}: exists and was not written by this script (no {marker}), so --force does not "
                "replace it; choose another directory"
            )
