"""Raw conversation corpora -> megatron-core indexed datasets for user-side mid-training and SFT.

Flow: ``sources`` (stream records) -> ``records`` (validate, adapt formats) -> ``render`` (Qwen ChatML
template, target masks, windows) -> ``shards`` (worker processes) -> ``packing`` + ``pipeline`` (rows, indexed
datasets, mixture, manifest). Entry points: ``python -m data_prep.midtrain``, ``python -m data_prep.sft``,
``python -m data_prep.bench``; the trainer reads the output with ``megatron_mimesis.data``.
"""
