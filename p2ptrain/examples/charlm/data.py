"""The King James Bible as characters: vocabulary, train/validation split, batch sampler.

The text ships inside the package as ``corpus/kjv.txt.xz`` beside this module
(see ``corpus/PROVENANCE.md``); nothing is downloaded. It is 4.3 million ASCII
characters drawn from a vocabulary of 73.

Theory of operation
-------------------

*Split.* The text is cut into blocks of ``block_chars`` characters; every
``val_every``-th block goes to validation, the rest, joined in order, is the
training split. Validation thus samples every part of the book rather than only
its last pages.

*Samples.* A sample is a window of ``seq_len + 1`` characters of the training
split (inputs are its first ``seq_len`` characters, targets the last
``seq_len``). Samples are numbered 0, 1, 2, ... without end, and sample ``n`` is
a pure function of ``(seed, n)``: no state, no iteration order. Epoch ``e``
holds ``windows_per_epoch`` consecutive sample numbers; within it the windows
are non-overlapping, start at a phase in ``[0, seq_len]`` drawn for the epoch,
and come in an order drawn for the epoch. Every training character (but at
most ``2 * seq_len + 1`` at the ends) is thus seen once per epoch, at a
different alignment each time.

The draws come from a SplitMix64 hash computed with NumPy's wrapping ``uint64``
arithmetic, and the order is an ``argsort`` of hashed keys, so every peer, on
any platform or torch version, computes the same samples.

*Batches and shards.* The batch of step ``t`` with ``batch_size`` rows for
shard ``i`` of ``num_shards`` holds samples
``(t * num_shards + i) * batch_size`` up to the next ``batch_size``. So the
``num_shards`` shard batches of step ``t``, concatenated in shard order, are
exactly the single-shard batch of step ``t`` with ``num_shards * batch_size``
rows: four peers with batch ``b`` see the data that one process with batch
``4b`` sees, in the same order.
"""

from __future__ import annotations

import functools
import hashlib
import lzma
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "DATA_FILE",
    "TEXT_SHA256",
    "BatchSampler",
    "Corpus",
    "Vocab",
    "load_corpus",
    "load_text",
]

DATA_FILE = Path(__file__).resolve().parent / "corpus" / "kjv.txt.xz"
"""The compressed text shipped with the repository."""

TEXT_SHA256 = "b3f98c5e0af751ffce7487ec8207e775ca78f60449c58a381a466ad3c2b2d38a"
"""SHA-256 of the uncompressed text of :data:`DATA_FILE`."""

_U64 = np.uint64
_MASK64 = (1 << 64) - 1


def load_text(path: Path = DATA_FILE, *, sha256: str | None = TEXT_SHA256) -> str:
    """Read and decompress the shipped text.

    Args:
        path: An xz-compressed ASCII or UTF-8 text file.
        sha256: Expected SHA-256 of the uncompressed bytes; ``None`` skips the check.

    Returns:
        The text.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: The file is not valid xz or UTF-8, or its digest differs.
    """
    try:
        raw = lzma.decompress(path.read_bytes())
    except lzma.LZMAError as exc:
        raise ValueError(f"{path} is not a valid xz file") from exc
    if sha256 is not None:
        digest = hashlib.sha256(raw).hexdigest()
        if digest != sha256:
            raise ValueError(f"{path}: sha256 {digest} differs from the expected {sha256}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8") from exc


@dataclass(frozen=True)
class Vocab:
    """A character vocabulary: token ``i`` is ``chars[i]``.

    Attributes:
        chars: The characters in token order, each once; at most 256.
    """

    chars: str

    def __post_init__(self) -> None:
        if not self.chars:
            raise ValueError("a vocabulary needs at least one character")
        if len(set(self.chars)) != len(self.chars):
            raise ValueError("vocabulary characters must be distinct")
        if len(self.chars) > 256:
            raise ValueError("a vocabulary holds at most 256 characters (tokens are uint8)")

    @classmethod
    def from_text(cls, text: str) -> Vocab:
        """The characters of ``text`` in code-point order (deterministic for a given text)."""
        return cls("".join(sorted(set(text))))

    @property
    def size(self) -> int:
        """Number of tokens."""
        return len(self.chars)

    @functools.cached_property
    def _table(self) -> npt.NDArray[np.int16]:
        table = np.full(max(map(ord, self.chars)) + 1, -1, np.int16)
        table[[ord(c) for c in self.chars]] = np.arange(len(self.chars), dtype=np.int16)
        return table

    def encode(self, text: str) -> torch.Tensor:
        """Map ``text`` to a 1-D ``uint8`` tensor of token ids.

        Raises:
            ValueError: ``text`` has a character outside the vocabulary.
        """
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        table = self._table
        ids = np.full(codes.shape, -1, np.int16)
        inside = codes < table.shape[0]
        ids[inside] = table[codes[inside]]
        if (ids < 0).any():
            bad = text[int(np.flatnonzero(ids < 0)[0])]
            raise ValueError(f"character {bad!r} is not in the vocabulary")
        return torch.from_numpy(ids.astype(np.uint8))

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Map token ids back to text.

        Raises:
            ValueError: An id is outside ``[0, size)``.
        """
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if any(not 0 <= i < self.size for i in values):
            raise ValueError(f"token ids must lie in [0, {self.size})")
        return "".join(self.chars[i] for i in values)


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finaliser applied elementwise (wrapping uint64 arithmetic)."""
    z = x + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def _mix(*words: int) -> int:
    """Hash a few non-negative integers into one 64-bit value."""
    state = np.zeros(1, dtype=np.uint64)
    for word in words:
        state = _splitmix64(state ^ _U64(word & _MASK64))
    return int(state[0])


@functools.lru_cache(maxsize=8)
def _epoch_plan(seed: int, epoch: int, windows: int, window: int) -> tuple[int, torch.Tensor]:
    """The phase and window order of one epoch (cached: batches reuse the same epoch)."""
    base = _mix(seed, epoch)
    phase = base % window
    keys = _splitmix64(np.arange(windows, dtype=np.uint64) ^ _U64(base))
    order = np.argsort(keys, kind="stable")
    return phase, torch.from_numpy(order.astype(np.int64))


class BatchSampler:
    """Deterministic, shardable windows of a token sequence (see the module docstring).

    Args:
        tokens: The 1-D token sequence to sample from.
        seq_len: Model context; each sample holds ``seq_len + 1`` tokens.
        seed: Selects the phases and orders of all epochs.

    Raises:
        ValueError: ``seq_len`` or ``seed`` is out of range, or ``tokens`` is too short.
    """

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, seed: int) -> None:
        if tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D tensor")
        if seq_len < 1:
            raise ValueError("seq_len must be positive")
        if seed < 0:
            raise ValueError("seed must be non-negative")
        self._tokens = tokens
        self._window = seq_len + 1
        self._windows = tokens.numel() // self._window - 1
        if self._windows < 1:
            raise ValueError(f"{tokens.numel()} tokens are too few for seq_len {seq_len}")
        self._offsets = torch.arange(self._window)
        self.seq_len = seq_len
        self.seed = seed

    @property
    def windows_per_epoch(self) -> int:
        """Number of samples in one epoch (one pass over the tokens)."""
        return self._windows

    def starts(self, first: int, count: int) -> torch.Tensor:
        """Token offsets of samples ``first`` to ``first + count - 1`` (int64, shape ``(count,)``).

        Raises:
            ValueError: ``first`` or ``count`` is negative.
        """
        if first < 0 or count < 0:
            raise ValueError("sample numbers and counts must be non-negative")
        numbers = torch.arange(first, first + count, dtype=torch.int64)
        epochs = numbers // self._windows
        slots = numbers % self._windows
        starts = torch.empty(count, dtype=torch.int64)
        for epoch in torch.unique(epochs).tolist():
            phase, order = _epoch_plan(self.seed, epoch, self._windows, self._window)
            mask = epochs == epoch
            starts[mask] = phase + order[slots[mask]] * self._window
        return starts

    def samples(self, first: int, count: int) -> torch.Tensor:
        """Samples ``first`` to ``first + count - 1`` as an int64 tensor ``(count, seq_len + 1)``.

        Raises:
            ValueError: ``first`` or ``count`` is negative.
        """
        index = self.starts(first, count)[:, None] + self._offsets
        return self._tokens[index].long()

    def batch(
        self, step: int, batch_size: int, *, shard: int = 0, num_shards: int = 1
    ) -> torch.Tensor:
        """The batch of ``step`` for ``shard`` of ``num_shards``: ``(batch_size, seq_len + 1)``.

        Concatenating the batches of shards ``0 .. num_shards - 1`` for one step
        gives the single-shard batch of that step with ``num_shards * batch_size``
        rows.

        Raises:
            ValueError: A negative step, a non-positive size, or a shard out of range.
        """
        if step < 0:
            raise ValueError("step must be non-negative")
        if batch_size < 1 or num_shards < 1:
            raise ValueError("batch_size and num_shards must be positive")
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard must lie in [0, {num_shards})")
        return self.samples((step * num_shards + shard) * batch_size, batch_size)

    def batches(
        self, batch_size: int, *, shard: int = 0, num_shards: int = 1, start_step: int = 0
    ) -> Iterator[torch.Tensor]:
        """Endless :meth:`batch` for ``start_step``, ``start_step + 1``, ..."""
        step = start_step
        while True:
            yield self.batch(step, batch_size, shard=shard, num_shards=num_shards)
            step += 1


@dataclass(frozen=True)
class Corpus:
    """A text encoded with its vocabulary and split for training and validation.

    Attributes:
        vocab: The character vocabulary.
        train: Training tokens (1-D ``uint8``).
        val: Validation tokens (1-D ``uint8``).
    """

    vocab: Vocab
    train: torch.Tensor
    val: torch.Tensor

    def sampler(self, *, seq_len: int, seed: int) -> BatchSampler:
        """A :class:`BatchSampler` over the training split."""
        return BatchSampler(self.train, seq_len=seq_len, seed=seed)

    def validation_windows(self, count: int, *, seq_len: int) -> torch.Tensor:
        """``count`` fixed validation samples spread evenly over the split.

        Returns:
            An int64 tensor ``(count, seq_len + 1)``; the same on every call.

        Raises:
            ValueError: ``count`` is not positive or exceeds what the split holds.
        """
        window = seq_len + 1
        available = self.val.numel() // window
        if not 0 < count <= available:
            raise ValueError(f"count must lie in [1, {available}] for seq_len {seq_len}")
        stride = available // count
        starts = torch.arange(count, dtype=torch.int64) * stride * window
        return self.val[starts[:, None] + torch.arange(window)].long()


def load_corpus(
    path: Path = DATA_FILE,
    *,
    sha256: str | None = TEXT_SHA256,
    block_chars: int = 16384,
    val_every: int = 10,
) -> Corpus:
    """Load the shipped text, build its vocabulary and split it.

    Args:
        path: The xz-compressed text (the King James Bible by default).
        sha256: Expected digest of the uncompressed text, or ``None``.
        block_chars: Size of the blocks that the split deals out.
        val_every: Every ``val_every``-th block (the last of each group) is validation.

    Returns:
        The encoded, split corpus.

    Raises:
        ValueError: Bad split parameters, or the file is unreadable or corrupt.
    """
    if block_chars < 1 or val_every < 2:
        raise ValueError("block_chars must be positive and val_every at least 2")
    text = load_text(path, sha256=sha256)
    vocab = Vocab.from_text(text)
    tokens = vocab.encode(text)
    blocks = torch.arange(tokens.numel()) // block_chars
    is_val = blocks % val_every == val_every - 1
    return Corpus(vocab=vocab, train=tokens[~is_val], val=tokens[is_val])
