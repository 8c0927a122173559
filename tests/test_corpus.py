"""The R lazy-load reader behind the evaluation corpus: on hand-built R serializations (always), and
on Debian's r-cran-janeaustenr when it is installed (skipped otherwise, with how to install it)."""

from __future__ import annotations

import gzip
import pathlib
import shutil
import struct
import subprocess
import zlib

import pytest

from hal.integrations import corpus

# --- a tiny R serializer (XDR, version 3), enough to build the structures the reader must handle --
NIL = struct.pack(">i", 254)


def _flags(kind: int, attr: bool = False, tag: bool = False) -> bytes:
    return struct.pack(">i", kind | (attr << 9) | (tag << 10))


def charsxp(s: str | None) -> bytes:
    if s is None:
        return _flags(9) + struct.pack(">i", -1)
    raw = s.encode()
    return struct.pack(">i", 9 | (8 << 12)) + struct.pack(">i", len(raw)) + raw  # UTF-8 level bit


def sym(name: str) -> bytes:
    return _flags(1) + charsxp(name)


def attrs(**named: bytes) -> bytes:
    out = b""
    for tag, value in named.items():
        out += _flags(2, tag=True) + sym(tag) + value
    return out + NIL


def strsxp(xs, names=None) -> bytes:
    body = struct.pack(">i", len(xs)) + b"".join(charsxp(x) for x in xs)
    if names is None:
        return _flags(16) + body
    return _flags(16, attr=True) + body + attrs(names=strsxp(names))


def intsxp(xs) -> bytes:
    return _flags(13) + struct.pack(">i", len(xs)) + struct.pack(f">{len(xs)}i", *xs)


def vecsxp(items, names=None) -> bytes:
    body = struct.pack(">i", len(items)) + b"".join(items)
    if names is None:
        return _flags(19) + body
    return _flags(19, attr=True) + body + attrs(names=strsxp(names))


def compact_intseq(n: int, start: int) -> bytes:
    info = _flags(2) + sym("compact_intseq") + _flags(2) + sym("base") + _flags(2) + intsxp([13]) + NIL
    state = _flags(14) + struct.pack(">i", 3) + struct.pack(">3d", n, start, 1)
    return struct.pack(">i", 238) + info + state + NIL


def serialized(item: bytes) -> bytes:
    return b"X\n" + struct.pack(">iii", 3, 0x40200, 0x30500) + struct.pack(">i", 5) + b"UTF-8" + item


def write_db(folder, objects: dict[str, bytes]) -> None:
    """An R lazy-load database: zlib records in Rdata.rdb, a gzip'd index in Rdata.rdx."""
    rdb, table = b"", {}
    for name, item in objects.items():
        data = serialized(item)
        record = struct.pack(">I", len(data)) + zlib.compress(data)
        table[name] = (len(rdb), len(record))
        rdb += record
    index = vecsxp([vecsxp([intsxp(list(v)) for v in table.values()], names=list(table)), vecsxp([]),
                    _flags(10) + struct.pack(">ii", 1, 1)], names=["variables", "references", "compressed"])
    (folder / "Rdata.rdb").write_bytes(rdb)
    (folder / "Rdata.rdx").write_bytes(gzip.compress(serialized(index)))


# --- the reader on hand-built data ----------------------------------------------------------------
def test_unserialize_character_vector_with_na():
    assert corpus.unserialize(serialized(strsxp(["a", None, "ü"]))) == ["a", None, "ü"]


def test_unserialize_named_list_and_altrep():
    obj = corpus.unserialize(serialized(vecsxp([strsxp(["x"]), compact_intseq(4, 1)], names=["text", "n"])))
    assert isinstance(obj, corpus.RObject)
    assert obj.attrs["names"] == ["text", "n"]
    assert obj.value == [["x"], [1, 2, 3, 4]]


def test_unserialize_refuses_what_it_cannot_read():
    with pytest.raises(corpus.CorpusError, match="expected the XDR format"):
        corpus.unserialize(b"A\n" + b"\0" * 20)
    with pytest.raises(corpus.CorpusError, match="SEXP type 4 .* not supported"):
        corpus.unserialize(serialized(_flags(4)))  # an environment
    with pytest.raises(corpus.CorpusError, match="truncated"):
        corpus.unserialize(serialized(strsxp(["abc"]))[:-2])


def test_lazy_load_database_and_book_text(tmp_path):
    data = tmp_path / "usr/lib/R/site-library/janeaustenr/data"
    data.mkdir(parents=True)
    lines = ["TITLE", "", "A first line", "  wrapped here.", "", "", "Second para.", None]
    write_db(data, {"prideprejudice": strsxp(lines), "emma": strsxp(["E"])})
    everything = corpus.read_rdata(data)
    assert set(everything) == {"prideprejudice", "emma"} and everything["emma"] == ["E"]
    assert corpus.read_rdata(data, "prideprejudice") == lines
    # the dpkg -x destination and the package folder both work as roots
    for root in (tmp_path, data.parent):
        assert corpus.book_text("pride", root) == "TITLE\n\nA first line wrapped here.\n\nSecond para."
    with pytest.raises(corpus.CorpusError, match="no object 'nope'"):
        corpus.read_rdata(data, "nope")


ROOT = pathlib.Path(__file__).resolve().parents[1]


def _install_hint(tmp_path) -> str:
    with pytest.raises(corpus.CorpusError) as exc:
        corpus.find_janeaustenr(tmp_path)
    message = str(exc.value)
    assert "Install it without R: " in message
    return message.split("Install it without R: ", 1)[1]


def test_missing_corpus_says_how_to_install(tmp_path):
    hint = _install_hint(tmp_path)
    assert hint.startswith("apt-get download r-cran-janeaustenr && ")
    # dpkg -x makes only the last folder of its destination: the parent must be made first
    assert "mkdir -p ~/.cache/hal/janeaustenr && dpkg -x r-cran-janeaustenr_*.deb ~/.cache/hal/janeaustenr" in hint


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb not installed (not a Debian system)")
def test_install_hint_works_on_a_fresh_home(tmp_path, monkeypatch):
    """The error's command, after its download step, run on a home without ~/.cache (a fresh
    machine), with a .deb laid out like r-cran-janeaustenr's: hal then finds the corpus."""
    pkg = tmp_path / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN/control").write_text("Package: r-cran-janeaustenr\nVersion: 1.0.0-1\nArchitecture: all\n"
                                        "Maintainer: hal tests <tests@example.invalid>\nDescription: test\n")
    data = pkg / "usr/lib/R/site-library/janeaustenr/data"
    data.mkdir(parents=True)
    write_db(data, {"prideprejudice": strsxp(["PRIDE AND PREJUDICE", "", "It is a truth."])})
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(pkg),
                    str(downloads / "r-cran-janeaustenr_1.0.0-1_all.deb")], check=True, capture_output=True)
    home = tmp_path / "home"
    home.mkdir()
    download, rest = _install_hint(tmp_path / "nowhere").split(" && ", 1)
    assert download == "apt-get download r-cran-janeaustenr"
    r = subprocess.run(["bash", "-c", rest], cwd=downloads, env={"HOME": str(home), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{rest!r} failed on a fresh home: {r.stderr.strip()}"
    monkeypatch.setenv("HOME", str(home))
    assert corpus.book_text("pride") == "PRIDE AND PREJUDICE\n\nIt is a truth."


def test_docs_give_the_install_step_of_the_error(tmp_path):
    """README.md ("A real model") and docs/model.md show the same command as the error message."""
    hint = _install_hint(tmp_path)
    for doc in ("README.md", "docs/model.md"):
        text = " ".join((ROOT / doc).read_text().split())
        assert hint in text, f"{doc} does not give the install step {hint!r}"


# --- the real package, when installed --------------------------------------------------------------
def _installed():
    try:
        return corpus.find_janeaustenr()
    except corpus.CorpusError as exc:
        return pytest.skip(f"janeaustenr not installed: {exc}")


def test_janeaustenr_six_novels():
    root = _installed()
    books = corpus.read_rdata(root / "data")
    assert set(corpus.BOOKS.values()) <= set(books)
    pride = books["prideprejudice"]
    assert pride[0] == "PRIDE AND PREJUDICE" and len(pride) == 13030
    text = corpus.book_text("pride")
    assert text.startswith("PRIDE AND PREJUDICE\n\nBy Jane Austen\n\nChapter 1\n\nIt is a truth universally "
                           "acknowledged, that a single man in possession of a good fortune, must be in want "
                           "of a wife.\n\n")
    assert corpus.book_text("sense").startswith("SENSE AND SENSIBILITY")
