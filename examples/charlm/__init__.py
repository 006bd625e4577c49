"""A character-level transformer language model on the King James Bible.

The model that p2ptrain's collaborative demo trains. Public API:

* :func:`~examples.charlm.data.load_corpus` -> :class:`~examples.charlm.data.Corpus`
  (vocabulary, train and validation tokens), :meth:`Corpus.sampler` ->
  :class:`~examples.charlm.data.BatchSampler`, whose ``batch(step, batch_size,
  shard=i, num_shards=n)`` is a pure function of its arguments;
* :class:`~examples.charlm.model.ModelConfig`, :func:`~examples.charlm.model.make_model`,
  :func:`~examples.charlm.model.loss`, :func:`~examples.charlm.model.evaluate`,
  :func:`~examples.charlm.model.make_optimizer`, :func:`~examples.charlm.model.generate`.

See ``README.md`` beside this file.
"""

from __future__ import annotations

from examples.charlm.data import BatchSampler, Corpus, Vocab, load_corpus
from examples.charlm.model import (
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
