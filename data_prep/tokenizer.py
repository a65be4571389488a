"""Tokenizers: a Hugging Face tokenizer directory, a sentencepiece model, or a small BPE trained offline.

The renderer needs only ``encode_batch`` (texts -> token id lists, no special tokens added) and the ids of the
chat special tokens of Qwen's ChatML template. With a HF tokenizer, special-token text inside the data is encoded as plain text, so
a user typing "<|im_end|>" cannot end a turn; a sentencepiece model cannot do that (its user-defined symbols always
match) and encodes every segment with its own dummy prefix. ``load_encoder`` picks the kind by path. ``TokenizerInfo`` records what went into a dataset (path and content hash) for
the manifest, so a dataset can always be traced back to the exact tokenizer.

The offline BPE exists because no model hub is reachable here: the embedded demo and the tests train one on
the corpus itself, with the Qwen2/3 pre-tokenizer split so that rendering behaves as with the real tokenizer.
"""

import hashlib
import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK = "<think>"
END_THINK = "</think>"
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK, END_THINK)

# Qwen2/Qwen3 pre-tokenizer split (from their tokenizer.json), applied before byte-level BPE.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records about the tokenizer a dataset was made with."""

    path: str
    sha256: str
    vocab_size: int
    trained_here: bool


class TextEncoder:
    """A tokenizers.Tokenizer plus the chat special-token ids; picklable by path for worker processes."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        tokenizer_file = self.directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{self.directory}: no tokenizer.json (a Hugging Face fast tokenizer directory)")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.tokenizer.encode_special_tokens = True
        missing = [t for t in SPECIAL_TOKENS if self.tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"{self.directory}: tokenizer lacks the chat special tokens {missing}")
        self.special = {t: self.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def __reduce__(self):
        return TextEncoder, (self.directory,)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def info(self, trained_here: bool) -> TokenizerInfo:
        return TokenizerInfo(
            str(self.directory.resolve()), tokenizer_sha256(self.directory), self.vocab_size, trained_here
        )


class SentencePieceEncoder:
    """A sentencepiece ``.model`` whose pieces include the chat special tokens (as user-defined symbols)."""

    def __init__(self, model_file: str | Path):
        try:
            import sentencepiece
        except ImportError:
            raise ImportError(
                f"{model_file}: reading a sentencepiece model needs `pip install sentencepiece`"
            ) from None
        self.directory = Path(model_file)
        self.processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        unknown = self.processor.unk_id()
        self.special = {t: self.processor.piece_to_id(t) for t in SPECIAL_TOKENS}
        missing = [t for t, i in self.special.items() if i == unknown]
        if missing:
            raise ValueError(f"{model_file}: sentencepiece model lacks the chat special tokens {missing}")
        self.vocab_size = self.processor.get_piece_size()

    def __reduce__(self):
        return SentencePieceEncoder, (self.directory,)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.processor.encode(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self.processor.decode(list(ids))

    def info(self, trained_here: bool) -> TokenizerInfo:
        return TokenizerInfo(
            str(self.directory.resolve()), tokenizer_sha256(self.directory), self.vocab_size, trained_here
        )


def load_encoder(path: str | Path) -> TextEncoder | SentencePieceEncoder:
    """A ``.model`` file is a sentencepiece model; anything else a HF tokenizer directory."""
    return SentencePieceEncoder(path) if Path(path).suffix == ".model" else TextEncoder(path)


# what defines a HF tokenizer; the rest of a model directory (its weights above all) is not the tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "tokenizer.model")


def copy_tokenizer(source: str | Path, dest: str | Path) -> list[str]:
    """Copy the tokenizer at ``source`` (a sentencepiece file, or the tokenizer files of a directory) into the
    directory ``dest``; the names copied. Runs name a model's own directory as their tokenizer, and a copy of all of
    it would carry the weights too (~16 GB for 8B parameters in bf16, in every checkpoint)."""
    source, dest = Path(source), Path(dest)
    if source.is_file():
        found, source = [source.name], source.parent
    else:
        found = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if not found:
        raise FileNotFoundError(f"{source}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...)")
    dest.mkdir(parents=True, exist_ok=True)
    for name in found:
        shutil.copy2(source / name, dest / name)
    return found


def tokenizer_sha256(path: Path) -> str:
    """Hash of the files that define the tokenization (not of their location)."""
    path = Path(path)
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    directory = path
    digest = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = Path(directory) / name
        if path.is_file():
            digest.update(name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def train_bpe(texts: Iterable[str], vocab_size: int, directory: str | Path) -> Path:
    """Train a byte-level BPE with the ChatML special tokens and save it as a HF tokenizer directory.

    ``vocab_size`` includes the special tokens; the directory loads offline with
    ``transformers.AutoTokenizer.from_pretrained``.
    """
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, THINK, END_THINK],
        model_max_length=262144,
    ).save_pretrained(str(directory))
    _drop_machine_specific_fields(directory / "tokenizer_config.json")
    return directory


def _drop_machine_specific_fields(config_path: Path) -> None:
    """Keep tokenizer_config.json identical across machines so its hash identifies the tokenizer."""
    config = json.loads(config_path.read_text())
    config.pop("name_or_path", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
