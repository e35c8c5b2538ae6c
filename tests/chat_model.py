"""Chat model folders of our own for the tests: a small byte-level BPE tokenizer trained here with a chat template
(three templates in the shapes chat models publish), and a tiny random Qwen2 decoder beside it."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import torch

from edgeswarm.values.chat import ChatMessage

# Three templates of our own, in the shapes chat models publish: ChatML (Qwen's), headers with a BOS (Llama 3's),
# and one that writes each message as JSON (what tool-calling templates do with arguments).
CHATML = (
    "{%- for message in messages %}\n"
    "{%- if loop.first and message.role != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}\n"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}\n"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HEADERS = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('only system, user and assistant turns') }}{% endif %}\n"
    "<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content | trim }}<|eot_id|>\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
AS_JSON = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}{% if add_generation_prompt %}>>> {% endif %}"
SPECIAL = ["<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|endoftext|>"]
CONVERSATION = [ChatMessage(role="system", content="Answer briefly."),
                ChatMessage(role="user", content="  What is the capital of Österreich? "),
                ChatMessage(role="assistant", content="Vienna."),
                ChatMessage(role="user", content="And of Schweiz, \"in quotes\" & <tags>?")]


def folder_with(root: Path, name: str, template: str, *, in_file: bool = False) -> Path:
    """A tokenizer folder (a small byte-level BPE trained here, the special tokens above) whose chat template is
    ``template``: in ``tokenizer_config.json`` or, with ``in_file``, in ``chat_template.jinja``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = root / name
    folder.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m.content for m in CONVERSATION] * 20 + ["You are a helpful assistant."] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|im_end|>" if template is CHATML else "<|eot_id|>", "pad_token": "<|endoftext|>"}
    if in_file:
        (folder / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def chat_model_folder(root: Path, transformers: ModuleType, seed: int = 0) -> Path:
    """A ChatML tokenizer folder (``folder_with``) holding a tiny random Qwen2 decoder of its vocabulary, whose end
    of sequence is ``<|im_end|>``."""
    from tokenizers import Tokenizer

    folder = folder_with(root, "qwen-chat", CHATML)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg = transformers.Qwen2Config(
        vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=112, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=tok.token_to_id("<|begin_of_text|>"), eos_token_id=tok.token_to_id("<|im_end|>"))
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise if p.dim() == 1 else 0.3 * noise)
    model.save_pretrained(str(folder))
    return folder
