"""A Hugging Face tokenizer class for the Kimi vocabulary, written for scripts/race-llamacpp.sh.

llama.cpp's convert_hf_to_gguf.py reads a Kimi checkpoint's vocabulary through
`AutoTokenizer.from_pretrained(dir, trust_remote_code=True)` and uses three things of the
result: `model._mergeable_ranks` (the tiktoken BPE ranks), `special_tokens` (name -> id) and
`eos_id`; it names the pre-tokenizer by hashing `encode()` of a fixed text, which must give
Kimi's ids ("kimi-k2"). This class provides exactly that over the real `tiktoken.model` with
Kimi's pre-tokenizer regex (the one kimi-host's own tokenizer implements; see
../shared/golden/tokenizer/case.json). It is not a general-purpose tokenizer: the race feeds
token ids, never text.
"""

from __future__ import annotations

import json
import os

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", **kwargs):
        ranks = load_tiktoken_bpe(vocab_file)
        with open(os.path.join(os.path.dirname(vocab_file), "special_tokens.json"), encoding="utf-8") as f:
            table = json.load(f)
        self.special_tokens = {name: int(i) for i, name in table["id_to_token"].items()}
        self.model = tiktoken.Encoding(
            name=os.path.basename(vocab_file),
            pat_str=PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.eos_id = self.special_tokens[eos_token]
        self.bos_id = self.special_tokens[bos_token]
        # Printable names for the base ids (undecodable byte pieces keep their bytes escaped).
        self._id_to_piece = {i: b.decode("utf-8", errors="backslashreplace") for b, i in ranks.items()}
        self._id_to_piece.update({i: n for n, i in self.special_tokens.items()})
        self._piece_to_id = {p: i for i, p in self._id_to_piece.items()}
        kwargs.pop("added_tokens_decoder", None)
        super().__init__(bos_token=bos_token, eos_token=eos_token, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self._piece_to_id)

    def encode(self, text, add_special_tokens=True, **kwargs):  # noqa: ARG002 - Kimi adds no BOS
        return self.model.encode(text, allowed_special="all")

    def _tokenize(self, text, **kwargs):
        return [self._id_to_piece[i] for i in self.model.encode(text, allowed_special="all")]

    def _convert_token_to_id(self, token):
        return self._piece_to_id[token]

    def _convert_id_to_token(self, index):
        return self._id_to_piece[index]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
