"""A real-text corpus that every machine already has: the Python standard library's own sources.

``forge-bench convergence`` trains on text, and the GPU machines reach no network. Every Python
installation carries its standard library as ``*.py`` files (CPython 3.11: 1,790 files, 31.5 MB),
so the corpus is built where the run happens, with nothing downloaded:

* the files are every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (``site-packages``
  excluded: installed packages differ from machine to machine), read as bytes in the order of their
  paths relative to that folder, each followed by a NUL byte as a document separator;
* a file goes to the validation split when the first byte of sha256(its relative path) is below
  ``VAL_BYTE_BELOW`` (13 of 256: about 5% of the files), so the split does not depend on the
  order or number of the other files, and the same file lands in the same split on every machine;
* tokens are bytes (``BYTE_VOCAB`` = 256 ids; ``tokenize`` is the identity on the bytes), which
  needs no tokenizer training and gives every machine the same ids for the same text.

Different Python versions ship different standard libraries, so the rows record ``Corpus.digest``
(sha256 over the file names and bytes in order) and the Python version: compare runs on one digest.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

BYTE_VOCAB = 256
DOCUMENT_SEPARATOR = b"\0"
VAL_BYTE_BELOW = 13


@dataclass(frozen=True)
class Corpus:
    """The train and validation token streams (int64 byte ids) and what they were built from."""
    name: str
    root: str
    train: torch.Tensor
    val: torch.Tensor
    train_files: int
    val_files: int
    digest: str

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB


def stdlib_root() -> Path:
    """This interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """Every ``*.py`` under ``root`` outside ``site-packages``, sorted by relative path."""
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_validation_file(relative_path: str) -> bool:
    """The split rule: the first byte of sha256(relative path) below ``VAL_BYTE_BELOW``."""
    return hashlib.sha256(relative_path.encode()).digest()[0] < VAL_BYTE_BELOW


def build_corpus(root: Path | None = None, max_bytes: int | None = None) -> Corpus:
    """The byte streams of ``root`` (default: this interpreter's standard library). ``max_bytes``
    caps the bytes read (tests): files are read in order until the cap."""
    root = Path(root) if root is not None else stdlib_root()
    files = source_files(root)
    if not files:
        raise ValueError(f"no *.py files under {root}: not a Python standard library folder")
    train, val = bytearray(), bytearray()
    counts = [0, 0]
    digest = hashlib.sha256()
    read = 0
    for path in files:
        relative = path.relative_to(root).as_posix()
        data = path.read_bytes()
        digest.update(relative.encode() + b"\0" + data)
        validation = is_validation_file(relative)
        (val if validation else train).extend(data + DOCUMENT_SEPARATOR)
        counts[validation] += 1
        read += len(data)
        if max_bytes is not None and read >= max_bytes:
            break
    if not val or not train:
        raise ValueError(f"the corpus under {root} has an empty {'validation' if not val else 'training'} split "
                         f"({counts[0]} training, {counts[1]} validation files)")
    return Corpus("python-stdlib-bytes", str(root), _byte_ids(train), _byte_ids(val), counts[0], counts[1],
                  digest.hexdigest()[:16])


def _byte_ids(buffer: bytearray) -> torch.Tensor:
    """The bytes as int64 token ids (a copy: the buffer can go)."""
    return torch.frombuffer(buffer, dtype=torch.uint8).to(torch.long)


def windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """``stream[s : s + length]`` for each start, as a (len(starts), length) tensor."""
    offsets = torch.arange(length)
    return stream[starts.unsqueeze(1) + offsets]


def train_batch(corpus: Corpus, batch: int, seq: int, seed: int, step: int) -> dict[str, torch.Tensor]:
    """The training batch of ``step`` for ``seed``: ``batch`` random windows of ``seq`` bytes. The
    same (seed, step) gives the same batch on every arm and after a resume."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.train.numel() - seq, (batch,), generator=generator)
    ids = windows(corpus.train, starts, seq)
    return {"input_ids": ids, "labels": ids.clone()}


def validation_batches(corpus: Corpus, batch: int, seq: int, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` fixed batches of evenly spaced validation windows (the same for every arm and seed)."""
    total = batch * count
    if corpus.val.numel() <= seq:
        raise ValueError(f"the validation split has {corpus.val.numel()} bytes, fewer than one window of {seq}")
    starts = torch.linspace(0, corpus.val.numel() - seq - 1, total).long()
    ids = windows(corpus.val, starts, seq)
    return [{"input_ids": chunk, "labels": chunk.clone()} for chunk in ids.split(batch)]


__all__ = ["BYTE_VOCAB", "Corpus", "build_corpus", "is_validation_file", "source_files", "stdlib_root",
           "train_batch", "validation_batches", "windows"]
