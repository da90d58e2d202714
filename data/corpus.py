"""The embedded default corpus: the Python standard library's own source files.

``python -m data.corpus --out DIR`` writes ``DIR/train.jsonl`` and ``DIR/heldout.jsonl``, one
JSON object per line, ``{"text": <file contents>, "path": <path relative to the stdlib>}``.

Which files (documented exactly, so every machine with the same Python gets the same corpus):
every regular file ending in ``.py`` under ``sysconfig.get_paths()["stdlib"]``, walked
recursively, test directories included (``test/``, ``idlelib/idle_test/`` ... are ordinary
Python code and about 60% of the text), except

- anything under a directory named ``site-packages``, ``dist-packages`` or ``__pycache__``
  (third-party packages, bytecode), and symbolic links;
- files that are not valid UTF-8 (on CPython 3.11 four encoding test fixtures:
  ``test/encoded_modules/module_iso_8859_1.py``, ``test/encoded_modules/module_koi8_r.py``,
  ``test/test_source_encoding.py``, ``test/tokenizedata/badsyntax_pep3120.py``) and empty
  files (28 ``__init__.py`` stubs).

Texts are read as bytes and decoded as UTF-8 with newlines untouched (``\\r\\n`` stays).
Order: sorted by relative POSIX path. Held-out split: a file is held out when the first 8
bytes of SHA-256(relative path), as a big-endian integer, modulo 10000 is below
``heldout_per_10k`` (default 100, i.e. ~1%). It depends on the path alone, so the split is
file-disjoint and stable when files are added or removed. CPython 3.11.7: 1,758 documents (1,738 train, 20 held-out),
31.5 MB.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sysconfig

from data.indexed_dataset import DataError, cli_exit, tmp_name

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> str:
    """The standard library directory of the running interpreter."""
    return sysconfig.get_paths()["stdlib"]


def list_files(root: str) -> list[str]:
    """Relative POSIX paths of the corpus files under ``root``, sorted (see module docstring)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in EXCLUDED_DIRS and not os.path.islink(os.path.join(dirpath, d))
        )
        for name in filenames:
            full = os.path.join(dirpath, name)
            if name.endswith(".py") and os.path.isfile(full) and not os.path.islink(full):
                out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(out)


def is_heldout(relpath: str, heldout_per_10k: int = 100) -> bool:
    """Deterministic held-out choice from the path alone (SHA-256, see module docstring)."""
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")
    return h % 10000 < heldout_per_10k


def read_documents(root: str):
    """Yield ``(relpath, text)`` for every corpus file; skipped files are counted in ``.skipped``."""
    for rel in list_files(root):
        with open(os.path.join(root, *rel.split("/")), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text:
            yield rel, text


def write_corpus(out_dir: str, root: str | None = None, heldout_per_10k: int = 100) -> dict:
    """Write ``out_dir/train.jsonl`` and ``out_dir/heldout.jsonl`` atomically.

    Returns counts: {"train": docs, "heldout": docs, "bytes": utf-8 bytes of all texts,
    "skipped": non-UTF-8 or empty files}. Raises DataError when ``root`` holds no ``.py`` files.
    """
    root = root or stdlib_root()
    os.makedirs(out_dir, exist_ok=True)
    final = {k: os.path.join(out_dir, f"{k}.jsonl") for k in ("train", "heldout")}
    tmp = {k: tmp_name(p) for k, p in final.items()}
    counts = {"train": 0, "heldout": 0, "bytes": 0, "skipped": 0}
    files = {k: open(p, "w", encoding="utf-8") for k, p in tmp.items()}
    try:
        listed = 0
        for rel, text in read_documents(root):
            listed += 1
            part = "heldout" if is_heldout(rel, heldout_per_10k) else "train"
            files[part].write(json.dumps({"text": text, "path": rel}, ensure_ascii=False) + "\n")
            counts[part] += 1
            counts["bytes"] += len(text.encode("utf-8"))
        counts["skipped"] = len(list_files(root)) - listed
        if listed == 0:
            raise DataError(f"{root}: no readable .py files; pass --root with a Python stdlib directory")
        for f in files.values():
            f.close()
        for k in final:
            os.replace(tmp[k], final[k])
    finally:
        for k, f in files.items():
            f.close()
            if os.path.exists(tmp[k]):
                os.remove(tmp[k])
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.corpus", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory for train.jsonl / heldout.jsonl")
    p.add_argument("--root", default=None, help="source directory (default: this Python's stdlib)")
    p.add_argument("--heldout-per-10k", type=int, default=100, help="held-out share in 1/10000")
    args = p.parse_args(argv)
    c = write_corpus(args.out, args.root, args.heldout_per_10k)
    print(
        f"wrote {c['train']} train + {c['heldout']} held-out documents ({c['bytes'] / 1e6:.1f} MB, "
        f"{c['skipped']} files skipped: not UTF-8 or empty) to {args.out}"
    )
    return 0


if __name__ == "__main__":
    cli_exit(main)
