"""Tiny offline models: a character tokenizer and a few-layer Llama, for the demo and the tests.

Nothing here downloads anything. The demo model in `assets/tiny-arith` is built by
`scripts/make_tiny_arith.py` with these functions; the tests build random ones in fixtures.
"""

from __future__ import annotations

import string
from collections.abc import Iterator
from itertools import islice

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
# Printable ASCII plus newline: every character is one token, so any English text encodes.
CHARACTERS = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")

# A minimal chat template (ChatML-like) so chat-formatted recipes can be tested offline.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def char_tokenizer(vocab_size: int = 0) -> PreTrainedTokenizerFast:
    """A character-level tokenizer (vocabulary of 100) that adds <s> in front, like Llama's.

    vocab_size > 100 widens the vocabulary with more single characters (CJK ideographs on), so a
    model with a real-sized vocabulary (GPT-2's 50257) samples tokens that each decode to one
    character and encode back to themselves: its answers keep their length in the next prompt.
    """
    symbols = SPECIAL_TOKENS + CHARACTERS
    symbols += tuple(islice(_more_characters(), max(0, vocab_size - len(symbols))))
    vocab = {token: i for i, token in enumerate(symbols)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _more_characters() -> Iterator[str]:
    """Printable, non-space characters from U+4E00 up (CJK ideographs first)."""
    for code in range(0x4E00, 0x110000):
        c = chr(code)
        if c.isprintable() and not c.isspace():
            yield c


def tiny_llama_config(
    hidden_size: int = 64, layers: int = 2, heads: int = 4, max_positions: int = 256
) -> LlamaConfig:
    """A few-layer Llama over the character vocabulary (special token ids match the tokenizer)."""
    return LlamaConfig(
        vocab_size=len(SPECIAL_TOKENS) + len(CHARACTERS),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
