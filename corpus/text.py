"""Raw text as users have it: plain or gzipped UTF-8, one sentence per line, read as a stream.

Lines are split on newlines only (str.splitlines would also split on U+2028, form feeds, ..., and
misalign the two sides of a parallel corpus).
"""

from __future__ import annotations

import gzip
import unicodedata
import zlib
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import BinaryIO

from fathom.common.errors import ConfigError

GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)  # cut short, not gzip, damaged inside


def shipped_data() -> Path:
    """Where the corpora fathom ships are (`multi30k/`), in a checkout and in an installed wheel alike."""
    return Path(str(files("fathom.data")))


def in_folder(folder: Path, prefix: str, lang: str) -> Path | None:
    """PREFIX.LANG, else PREFIX.LANG.gz, in `folder`; None if neither is a file."""
    return next((c for c in (folder / f"{prefix}.{lang}", folder / f"{prefix}.{lang}.gz") if c.is_file()), None)


def find_pair(prefix: str, langs: tuple[str, str]) -> tuple[Path, Path]:
    """Both sides of a parallel prefix, PREFIX.LANG or PREFIX.LANG.gz, from one folder: here, else (PREFIX
    relative and neither side here) the corpus fathom ships (`multi30k/train`), so that an installed fathom
    prepares it from any directory. One side here and the other only in the shipped corpus would pair the
    lines of two corpora: refused."""
    shipped = shipped_data()
    folders = (Path(), shipped) if not Path(prefix).is_absolute() else (Path(),)
    for folder in folders:
        found = [in_folder(folder, prefix, lang) for lang in langs]
        if all(found):
            return found[0], found[1]
        if any(found):
            have, missing = (langs[0], langs[1]) if found[0] else (langs[1], langs[0])
            where = "here" if folder == Path() else f"in the shipped corpus ({shipped})"
            raise ConfigError(
                f"{prefix}.{have} is {where} but {prefix}.{missing} is not (nor {prefix}.{missing}.gz): both "
                "sides of a prefix come from one folder; add the other side or give a prefix that has both"
            )
    splits = sorted(
        str(p.relative_to(shipped)).removesuffix(f".{langs[0]}.gz") for p in shipped.glob(f"*/*.{langs[0]}.gz")
    )
    shipped_note = f"; fathom ships {', '.join(splits)}" if splits else ""
    raise ConfigError(f"{prefix}.{langs[0]}: no such file (also tried {prefix}.{langs[0]}.gz){shipped_note}")


def raw_lines(path: Path) -> Iterator[bytes]:
    """The file's lines as bytes, newline included. gzip checks its checksum only at the end of the
    stream, so a damaged file is a ConfigError when the reader gets there: whoever reads to the end has
    read the file whole, without holding it."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        try:
            yield from f
        except GZIP_ERRORS as err:
            raise ConfigError(f"{path}: not a whole gzip file ({err}); download or compress it again") from None


def decode_line(raw: bytes, name: str | Path, lineno: int) -> str:
    """One line as text without its line ending; bytes that are not UTF-8 are an error naming the line."""
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{name}:{lineno}: not valid UTF-8 ({err.reason} at byte {err.start}); re-encode the file as UTF-8"
        ) from None


def decode_lines(f: BinaryIO, name: str | Path) -> list[str]:
    """Every line of a binary stream as text (decode_line)."""
    return [decode_line(raw, name, lineno) for lineno, raw in enumerate(f, 1)]


def read_lines(path: Path) -> list[str]:
    """Every line of a plain or gzipped file as text: for files of a few thousand lines (references,
    sentences to translate); a corpus is streamed (raw_lines)."""
    return [decode_line(raw, path, lineno) for lineno, raw in enumerate(raw_lines(path), 1)]


def blank(line: str) -> bool:
    """Whether a line shows nothing: only whitespace and invisible format characters (Unicode category
    Cf: zero-width spaces and joiners, the word joiner, bidi marks, a byte order mark)."""
    return all(char.isspace() or unicodedata.category(char) == "Cf" for char in line)
