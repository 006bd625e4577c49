"""A character-level transformer language model on the King James Bible.

The model that p2ptrain's collaborative demo trains. Public API:

* :func:`~.data.load_corpus` -> :class:`~.data.Corpus` (vocabulary, train
  and validation tokens), :meth:`Corpus.sampler` -> :class:`~.data.BatchSampler`,
  whose ``batch(step, batch_size, shard=i, num_shards=n)`` is a pure function
  of its arguments;
* :class:`~.model.ModelConfig`, :func:`~.model.make_model`, :func:`~.model.loss`,
  :func:`~.model.evaluate`, :func:`~.model.make_optimizer`, :func:`~.model.generate`.

See ``README.md`` beside this file.
"""

from __future__ import annotations

from p2ptrain.examples.charlm.data import BatchSampler, Corpus, Vocab, load_corpus
from p2ptrain.examples.charlm.model import (
    CharTransformer,
    ModelConfig,
    evaluate,
    generate,
    loss,
    make_model,
    make_optimizer,
)

__all__ = [
    "BatchSampler",
    "CharTransformer",
    "Corpus",
    "ModelConfig",
    "Vocab",
    "evaluate",
    "generate",
    "load_corpus",
    "loss",
    "make_model",
    "make_optimizer",
]
