"""Data: where text and token ids come from and how they become batches, below the training machinery.

``text`` (sources → documents, the train/val split), ``sources`` (JSONL, parquet, saved datasets), ``tokens``
(pre-tokenized shards), ``encoding`` (streaming encode into the memmap cache), ``packing`` (windows, segments,
validation sets, the encoded ``Corpus``), ``mixture`` (weighted sources), ``corpora`` (a run's data from its
``DataSpec``), ``tokenizer`` and ``hf_tokenizer`` (ours and Hugging Face's), ``chat`` and ``templates`` (the chat
format and sandboxed Jinja templates), ``tasks`` (the built-in fine-tuning tasks). Import the modules themselves.
"""
