"""Transformer language models as plain weight dictionaries: BERT-, GPT-2-, OPT- and Llama-style.

``config`` holds the architecture (``TextModelConfig``, presets from test sizes to the Galaxy paper's shapes) and the
one weight layout every part reads; ``ops`` the building blocks (embedding, norms, attention with a KV cache, the
MLP), shared by the single-device ``reference`` forward pass and by the tensor-parallel runtime, which applies the
same ops to its shards of the same weights. ``hf`` reads published weights from a local Hugging Face style folder
into that layout (whole, by name or by row/column slice), ``tokenizer`` its tokenizer file, ``pooling`` a
sentence-transformers folder's sentence embedding.
"""
