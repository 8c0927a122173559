"""Real text without a data hub: Jane Austen's novels from Debian's ``r-cran-janeaustenr`` package.

Why a parser for R's files: the package stores the six novels in R's lazy-load database
(``data/Rdata.rdx`` + ``data/Rdata.rdb``), and installing R to read them would be absurd for one
evaluation text. The format is small and stable:

- ``Rdata.rdx`` is one serialized R object (gzip-compressed as a whole, or in older files a 4-byte
  big-endian length followed by zlib data): a named list whose ``variables`` entry maps each object
  name to an integer ``(offset, length)`` pair into ``Rdata.rdb``;
- each record of ``Rdata.rdb`` is a 4-byte big-endian uncompressed length followed by zlib data,
  which holds one R serialization (XDR, ``X\\n``, format version 2 or 3).

:func:`unserialize` reads the subset of R's serialization such data uses (character, numeric and
list vectors, pairlists, symbols, attributes, references, ALTREP compact sequences); anything else
is an error naming the type, never a silent skip.

Getting the package (no R needed; documented in docs/model.md; :data:`INSTALL` holds the command)::

    apt-get download r-cran-janeaustenr && mkdir -p ~/.cache/hal/janeaustenr && dpkg -x r-cran-janeaustenr_*.deb ~/.cache/hal/janeaustenr

(``dpkg -x`` creates only the last folder of its destination: on a fresh machine without
``~/.cache/hal`` it fails with "failed to create directory" unless the folder is made first.)

A plain text file works everywhere a book does (``hal-eval --text FILE``).
"""

from __future__ import annotations

import gzip
import os
import pathlib
import re
import struct
import zlib

__all__ = ["BOOKS", "INSTALL", "CorpusError", "book_text", "find_janeaustenr", "paragraphs", "read_rdata", "unserialize"]

# janeaustenr's object names for the six novels (each a character vector, one element per line).
BOOKS = {
    "pride": "prideprejudice",
    "sense": "sensesensibility",
    "emma": "emma",
    "mansfield": "mansfieldpark",
    "northanger": "northangerabbey",
    "persuasion": "persuasion",
}

_REL = pathlib.Path("usr/lib/R/site-library/janeaustenr")

# The documented install step (docs/model.md, README.md), also in the error of a missing corpus. The
# destination is the first of candidates(); mkdir -p because dpkg -x makes only its last folder.
INSTALL = ("apt-get download r-cran-janeaustenr && mkdir -p ~/.cache/hal/janeaustenr && "
           "dpkg -x r-cran-janeaustenr_*.deb ~/.cache/hal/janeaustenr")


class CorpusError(RuntimeError):
    """The corpus is missing or unreadable; the message says where hal looked or what was wrong."""


def candidates() -> list[pathlib.Path]:
    """Where the janeaustenr package may be: the ``dpkg -x`` folder of the documented step, and a
    system install of the Debian package."""
    home = pathlib.Path(os.path.expanduser("~"))
    return [home / ".cache/hal/janeaustenr" / _REL, pathlib.Path("/") / _REL]


def find_janeaustenr(root: str | os.PathLike | None = None) -> pathlib.Path:
    """The package folder holding ``data/Rdata.rdx``. ``root`` may be the package folder itself or
    a ``dpkg -x`` destination; without it the :func:`candidates` are searched."""
    looked = []
    if root is not None:
        root = pathlib.Path(root).expanduser()
        looked = [root, root / _REL]
    else:
        looked = candidates()
    for p in looked:
        if (p / "data" / "Rdata.rdx").is_file():
            return p
    raise CorpusError(
        "janeaustenr not found (looked for data/Rdata.rdx in: " + ", ".join(map(str, looked)) + "). "
        "Install it without R: " + INSTALL)


# --------------------------------------------------------------------------- R unserialization
_NIL, _REF, _GLOBALENV, _UNBOUND, _MISSING, _BASENS = 254, 255, 253, 252, 251, 250
_EMPTYENV, _BASEENV, _ALTREP, _ATTRLIST, _ATTRLANG = 242, 241, 238, 239, 240
_SYM, _LIST, _LANG, _CHAR, _LGL, _INT, _REAL, _CPLX, _STR, _VEC, _EXPR, _RAW = 1, 2, 6, 9, 10, 13, 14, 15, 16, 19, 20, 24
NA_INT = -(2 ** 31)


class RObject:
    """An R value with attributes: ``value`` (list, tuple of pairs, str...) and ``attrs`` (dict)."""

    def __init__(self, value, attrs: dict | None = None):
        self.value, self.attrs = value, attrs or {}

    def __repr__(self) -> str:
        return f"RObject({type(self.value).__name__}, attrs={sorted(self.attrs)})"


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos, self.refs = data, 0, []

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise CorpusError(f"R serialization truncated at byte {self.pos} (wanted {n} more)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + (lo & 0xFFFFFFFF)
        return n

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind in (_NIL, _GLOBALENV, _UNBOUND, _MISSING, _BASENS, _EMPTYENV, _BASEENV):
            return None
        if kind == _REF:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == _SYM:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == _CHAR:
            n = self.int()
            return None if n == -1 else self.take(n).decode("utf-8", "replace")
        if kind in (_LIST, _LANG, _ATTRLIST, _ATTRLANG):
            return self._pairlist(has_attr, has_tag)
        if kind == _ALTREP:
            info, state, attrs = self.item(), self.item(), self.item()
            return self._wrap(_altrep(info, state), attrs)
        if kind in (_LGL, _INT):
            n = self.length()
            value = list(struct.unpack(f">{n}i", self.take(4 * n)))
        elif kind == _REAL:
            n = self.length()
            value = list(struct.unpack(f">{n}d", self.take(8 * n)))
        elif kind == _CPLX:
            n = self.length()
            raw = struct.unpack(f">{2 * n}d", self.take(16 * n))
            value = [complex(raw[2 * i], raw[2 * i + 1]) for i in range(n)]
        elif kind == _RAW:
            value = self.take(self.length())
        elif kind == _STR:
            value = [self.item() for _ in range(self.length())]
        elif kind in (_VEC, _EXPR):
            value = [self.item() for _ in range(self.length())]
        else:
            raise CorpusError(f"R serialization: SEXP type {kind} at byte {self.pos - 4} is not supported "
                              f"by this reader (it reads data vectors, lists and attributes)")
        return self._wrap(value, self._pairlist_dict(self.item()) if has_attr else None)

    def _pairlist(self, has_attr: bool, has_tag: bool):
        """A pairlist as a tuple of (tag, value) pairs; iterative over the CDR chain."""
        pairs = []
        while True:
            if has_attr:
                self.item()  # attributes on a pairlist cell: not needed for data
            tag = self.item() if has_tag else None
            pairs.append((tag, self.item()))
            flags = self.int()
            kind = flags & 0xFF
            if kind == _NIL:
                return tuple(pairs)
            if kind not in (_LIST, _ATTRLIST):
                self.pos -= 4
                tail = self.item()
                pairs.append((None, tail))
                return tuple(pairs)
            has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))

    @staticmethod
    def _pairlist_dict(pairs) -> dict:
        return {tag: value for tag, value in (pairs or ())}

    @staticmethod
    def _wrap(value, attrs):
        return RObject(value, attrs) if attrs else value


def _altrep(info, state):
    """Expand the ALTREP classes plain data uses (compact sequences; wrappers keep their payload)."""
    cls = info[0][1] if isinstance(info, tuple) and info else None
    if cls in ("compact_intseq", "compact_realseq"):
        n, start, step = (state.value if isinstance(state, RObject) else state)[:3]
        seq = [start + i * step for i in range(int(n))]
        return [int(x) for x in seq] if cls == "compact_intseq" else seq
    if cls in ("deferred_string", "wrap_integer", "wrap_real", "wrap_string", "wrap_logical", "wrap_list"):
        payload = state[0][1] if isinstance(state, tuple) else state
        return payload.value if isinstance(payload, RObject) else payload
    raise CorpusError(f"R serialization: ALTREP class {cls!r} is not supported by this reader")


def unserialize(data: bytes):
    """One R serialization (XDR format, versions 2 and 3) as Python values: character vectors are
    lists of str (None for NA), lists are lists, values with attributes are :class:`RObject`."""
    if data[:2] != b"X\n":
        raise CorpusError(f"R serialization: expected the XDR format 'X\\n'; got {data[:2]!r}")
    r = _Reader(data)
    r.pos = 2
    version = r.int()
    r.int(), r.int()  # writer's R version, minimal reader version
    if version == 3:
        r.take(r.int())  # native encoding name
    elif version != 2:
        raise CorpusError(f"R serialization: format version {version} is not supported (2 or 3)")
    return r.item()


def _decompress(blob: bytes, what: str) -> bytes:
    if blob[:2] == b"\x1f\x8b":
        return gzip.decompress(blob)
    if len(blob) < 5:
        raise CorpusError(f"{what}: too short for a compressed record ({len(blob)} bytes)")
    (n,) = struct.unpack(">I", blob[:4])
    out = zlib.decompress(blob[4:])
    if len(out) != n:
        raise CorpusError(f"{what}: record says {n} bytes, zlib gave {len(out)}")
    return out


def read_rdata(folder: str | os.PathLike, name: str | None = None):
    """Objects of a lazy-load database ``folder/Rdata.{rdx,rdb}``: every variable (dict), or one."""
    folder = pathlib.Path(folder)
    index = unserialize(_decompress((folder / "Rdata.rdx").read_bytes(), str(folder / "Rdata.rdx")))
    if not isinstance(index, RObject) or "names" not in index.attrs:
        raise CorpusError(f"{folder / 'Rdata.rdx'}: expected a named list (variables, references, compressed)")
    top = dict(zip(index.attrs["names"], index.value))
    variables = top.get("variables")
    if not isinstance(variables, RObject):
        raise CorpusError(f"{folder / 'Rdata.rdx'}: no 'variables' table")
    table = dict(zip(variables.attrs["names"], variables.value))
    if name is not None and name not in table:
        raise CorpusError(f"{folder / 'Rdata.rdb'}: no object {name!r} (has: {', '.join(sorted(table))})")
    out = {}
    with open(folder / "Rdata.rdb", "rb") as f:
        for var in ([name] if name is not None else table):
            offset, length = table[var]
            f.seek(offset)
            out[var] = unserialize(_decompress(f.read(length), f"{folder / 'Rdata.rdb'} [{var}]"))
    return out[name] if name is not None else out


def book_text(book: str = "pride", root: str | os.PathLike | None = None) -> str:
    """A novel as plain text: paragraphs separated by a blank line, each paragraph on one line.

    The package keeps Project Gutenberg's hard-wrapped lines (one R string per ~70-column line);
    the wrapping is typesetting, not text, so each paragraph's lines are joined with single spaces
    (runs of whitespace collapsed). This is the text the issue's reference perplexities were measured
    on (SmolLM2-135M, 4 x 2048 tokens of Pride and Prejudice: 23.65). ``book`` is a key of
    :data:`BOOKS` or a janeaustenr object name; ``root`` as for :func:`find_janeaustenr`.
    """
    name = BOOKS.get(book, book)
    value = read_rdata(find_janeaustenr(root) / "data", name)
    if isinstance(value, RObject):  # a data frame: take its text column
        cols = dict(zip(value.attrs.get("names", []), value.value))
        value = cols.get("text", value.value)
    if not (isinstance(value, list) and all(x is None or isinstance(x, str) for x in value)):
        raise CorpusError(f"janeaustenr object {name!r} is not a character vector")
    return paragraphs("\n".join(x for x in value if x is not None))


def paragraphs(text: str) -> str:
    """Hard-wrapped text -> one line per paragraph, paragraphs separated by a blank line."""
    paras = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    return "\n\n".join(p for p in paras if p)
