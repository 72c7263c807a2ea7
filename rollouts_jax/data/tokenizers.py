"""Tokenizers behind one small interface.

Three implementations share the :class:`Tokenizer` base class:

* :class:`HFTokenizer` reads a checkpoint's ``tokenizer.json`` (through the
  ``tokenizers`` library) and ``tokenizer_config.json`` (special tokens and the
  Jinja ``chat_template``), as saved by Hugging Face ``transformers``.
* :class:`SentencePieceTokenizer` wraps a ``.model`` file; :func:`train_sentencepiece`
  trains a tiny one locally for the synthetic tasks.
* :class:`CharTokenizer` is a fully deterministic character-level tokenizer with a fixed
  vocabulary (digits, operators, letters, a few multi-character specials such as
  ``<answer>``). It gives a tiny policy the easiest possible job on countdown and
  arithmetic, and is saved to / loaded from a small json file.

Conventions common to all three:

* ``encode(text, add_bos=False)`` never appends EOS; ``add_bos`` prepends ``bos_id`` when the
  tokenizer has one (and does nothing when ``bos_id is None``).
* ``decode(ids)`` does not stop at EOS; it drops ``pad_id`` and renders every other id,
  special tokens included, as its text (so ``decode(encode(s)) == s`` for plain text).
* ``apply_chat_template(messages)`` renders the checkpoint's Jinja template; a tokenizer
  without one raises ``ValueError``.

>>> tok = CharTokenizer.default()
>>> ids = tok.encode("12+7=<answer>19</answer>")
>>> tok.decode(ids + [tok.pad_id, tok.pad_id])
'12+7=<answer>19</answer>'
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
import json
import os
import pathlib
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

PathLike = str | os.PathLike

__all__ = [
    "Tokenizer", "HFTokenizer", "SentencePieceTokenizer", "CharTokenizer",
    "train_sentencepiece", "load_tokenizer", "render_chat_template", "CHAR_CHAT_TEMPLATE",
]


def _as_id_list(ids: Any) -> list[int]:
  """Flattens a list / tuple / numpy or jax 1-D array of ids to a list of Python ints."""
  arr = np.asarray(ids)
  if arr.ndim > 1:
    raise ValueError(f"decode expects a 1-D sequence of ids, got shape {arr.shape}")
  return [int(i) for i in arr.reshape(-1)]


def _generation_tag_extension():
  """``{% generation %}...{% endgeneration %}`` (marks assistant text in some templates): the
  body is rendered as it is."""
  from jinja2 import ext, nodes

  class GenerationTag(ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
      return caller()

  return GenerationTag


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, **context: Any) -> str:
  """Renders a Hugging Face style Jinja chat template.

  Uses a sandboxed environment with ``trim_blocks`` / ``lstrip_blocks``, the
  ``loopcontrols`` extension and the ``{% generation %}`` tag, a ``raise_exception`` helper,
  a ``tojson`` filter that keeps non-ASCII text, and ``strftime_now``, which is what
  checkpoint templates expect.

  Args:
    template: the Jinja source (``chat_template`` of ``tokenizer_config.json``).
    messages: a list of ``{"role": ..., "content": ...}`` dicts.
    add_generation_prompt: end with the header of an assistant turn.
    **context: more template variables (``bos_token``, ``eos_token``, ``tools``,
      ``enable_thinking`` ...).

  Returns:
    The rendered string.

  >>> render_chat_template("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}",
  ...                      [{"role": "user", "content": "hi"}])
  '[user]hi'
  """
  import jinja2
  from jinja2 import sandbox

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=["jinja2.ext.loopcontrols", _generation_tag_extension()])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  for message in messages:
    if not isinstance(message, Mapping) or "role" not in message:
      raise ValueError(f"each chat message needs a 'role' (and usually 'content'), got {message!r}")
  compiled = env.from_string(template)
  return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                         **context)


class Tokenizer(abc.ABC):
  """The interface every tokenizer of the library implements.

  Attributes:
    vocab_size: number of ids (the embedding table needs at least this many rows).
    eos_id: end-of-sequence id (the sampler stops on it).
    pad_id: padding id (left padding of prompts, right padding of completions).
    bos_id: beginning-of-sequence id, or ``None`` when the tokenizer has none.
    chat_template: the Jinja chat template, or ``None``.
  """

  chat_template: str | None = None

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Number of ids."""

  @property
  @abc.abstractmethod
  def eos_id(self) -> int:
    """End-of-sequence id."""

  @property
  @abc.abstractmethod
  def pad_id(self) -> int:
    """Padding id."""

  @property
  @abc.abstractmethod
  def bos_id(self) -> int | None:
    """Beginning-of-sequence id, or None."""

  @abc.abstractmethod
  def _encode(self, text: str) -> list[int]:
    """Encodes text with no special tokens added."""

  @abc.abstractmethod
  def _decode(self, ids: list[int]) -> str:
    """Decodes ids (pad already removed), rendering special tokens as text."""

  @abc.abstractmethod
  def id_to_token(self, token_id: int) -> str:
    """The text of one id (its piece / token string)."""

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    """Encodes ``text`` to ids; never appends EOS.

    Args:
      text: a string.
      add_bos: prepend ``bos_id`` (if the tokenizer has one).

    Returns:
      A list of Python ints.
    """
    if not isinstance(text, str):
      raise ValueError(f"encode expects a str, got {type(text).__name__}")
    ids = self._encode(text)
    if add_bos and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
    """Decodes ids to text; drops ``pad_id``, does not stop at EOS.

    Args:
      ids: a 1-D list or array of ids.
      skip_special: also drop special tokens (EOS, BOS, a chat model's control tokens), as
        a completion is read by a reward.

    Returns:
      The text, special tokens (other than padding) rendered as their strings.
    """
    id_list = [i for i in _as_id_list(ids) if i != self.pad_id]
    for i in id_list:
      if not 0 <= i < self.vocab_size:
        raise ValueError(f"id {i} is outside the vocabulary [0, {self.vocab_size})")
    if skip_special:
      id_list = [i for i in id_list if not self.is_special(i)]
    return self._decode(id_list)

  _end_of_turn_ids: tuple[int, ...] = ()

  @property
  def end_of_turn_ids(self) -> tuple[int, ...]:
    """Every id that ends the model's turn (EOS first; a chat model's end-of-turn and
    end-of-text ids too): the sampler stops on any of them."""
    return tuple(dict.fromkeys((self.eos_id,) + tuple(self._end_of_turn_ids)))

  def is_special(self, token_id: int) -> bool:
    """Whether an id is a special (control) token, which `decode(..., skip_special=True)` drops."""
    return token_id in (self.eos_id, self.pad_id, self.bos_id)

  @property
  def special_tokens(self) -> dict[str, str | None]:
    """Text of the bos / eos / pad tokens, as chat templates see them."""
    return {
        "bos_token": None if self.bos_id is None else self.id_to_token(self.bos_id),
        "eos_token": self.id_to_token(self.eos_id),
        "pad_token": self.id_to_token(self.pad_id),
    }

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True, **context: Any) -> str:
    """Renders chat messages with the tokenizer's Jinja chat template.

    Args:
      messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
      add_generation_prompt: end with the header of an assistant turn.
      **context: extra template variables (e.g. ``enable_thinking=False`` for Qwen3).

    Returns:
      The prompt string (encode it with ``add_bos=False``: templates write their own BOS).

    Raises:
      ValueError: the tokenizer has no chat template.
    """
    if not self.chat_template:
      raise ValueError(
          f"{type(self).__name__} has no chat template: the checkpoint's tokenizer_config.json "
          "has no 'chat_template' (nor is there a chat_template.jinja); use template='plain' "
          "or pass chat_template=... when building the tokenizer")
    variables = {k: v for k, v in self.special_tokens.items() if v is not None}
    variables.update(context)
    return render_chat_template(self.chat_template, messages,
                                add_generation_prompt=add_generation_prompt, **variables)


# ---------------------------------------------------------------------------------------------
# tokenizer.json (Hugging Face)


def _token_content(value: Any) -> str | None:
  """A special token in tokenizer_config.json is a string or an AddedToken dict."""
  if value is None:
    return None
  if isinstance(value, str):
    return value
  if isinstance(value, Mapping) and "content" in value:
    return value["content"]
  raise ValueError(f"cannot read a special token from {value!r}")


def _read_json(path: pathlib.Path) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


# GGUF pre-tokenizers (tokenizer.ggml.pre): None = GPT-2's byte-level regex, "digits" = each digit
# alone then GPT-2's regex (SmolLM), else a split regex applied before byte-level mapping.
_GGUF_PRE_TOKENIZERS = {
    "default": None,
    "gpt-2": None,
    "smollm": "digits",
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+"),}
_GGUF_PRE_TOKENIZERS["llama3"] = _GGUF_PRE_TOKENIZERS["llama-v3"] = _GGUF_PRE_TOKENIZERS["llama-bpe"]


class HFTokenizer(Tokenizer):
  """A ``tokenizer.json`` tokenizer with the special tokens of ``tokenizer_config.json``.

  Args:
    tokenizer: a ``tokenizers.Tokenizer``.
    eos_token: text of the EOS token (must be in the vocabulary).
    pad_token: text of the padding token; ``None`` falls back to ``eos_token`` (the usual
      choice for checkpoints without one; ``decode`` then drops EOS too).
    bos_token: text of the BOS token, or ``None``.
    chat_template: Jinja chat template, or ``None``.

  tok = HFTokenizer.from_dir("path/to/Qwen2.5-0.5B-Instruct")
  tok.decode(tok.encode("hello world"))
  # 'hello world'
  """

  def __init__(self, tokenizer, *, eos_token: str, pad_token: str | None = None,
               bos_token: str | None = None, chat_template: str | None = None):
    self._tok = tokenizer
    self._eos_id = self._require_id(eos_token, "eos_token")
    self._pad_id = self._eos_id if pad_token is None else self._require_id(pad_token, "pad_token")
    self._bos_id = None if bos_token is None else self._require_id(bos_token, "bos_token")
    self.chat_template = chat_template

  def _require_id(self, token: str, what: str) -> int:
    token_id = self._tok.token_to_id(token)
    if token_id is None:
      raise ValueError(f"{what} {token!r} is not in the tokenizer's vocabulary")
    return int(token_id)

  @classmethod
  def from_dir(cls, path: PathLike) -> "HFTokenizer":
    """Loads ``tokenizer.json`` and ``tokenizer_config.json`` from a checkpoint folder.

    Special tokens come from ``tokenizer_config.json`` (``eos_token``, ``pad_token``,
    ``bos_token``; strings or AddedToken dicts), falling back to ``special_tokens_map.json``.
    The chat template is ``tokenizer_config.json``'s ``chat_template`` (a string, or a list
    of named templates of which ``default`` is taken) or a ``chat_template.jinja`` file.

    Args:
      path: the checkpoint folder.

    Returns:
      An :class:`HFTokenizer`.
    """
    import tokenizers

    folder = pathlib.Path(path)
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
      raise FileNotFoundError(f"no tokenizer.json in {folder}")
    config: dict = {}
    if (folder / "tokenizer_config.json").is_file():
      config = _read_json(folder / "tokenizer_config.json")
    special_map: dict = {}
    if (folder / "special_tokens_map.json").is_file():
      special_map = _read_json(folder / "special_tokens_map.json")

    def special(name):
      value = _token_content(config.get(name))
      return value if value is not None else _token_content(special_map.get(name))

    eos = special("eos_token")
    if eos is None:
      raise ValueError(f"{folder} names no eos_token in tokenizer_config.json or "
                       "special_tokens_map.json")
    bos = special("bos_token")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
      named = {t["name"]: t["template"] for t in template}
      template = named.get("default", next(iter(named.values()), None))
    if template is None and (folder / "chat_template.jinja").is_file():
      template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return cls(tokenizers.Tokenizer.from_file(str(tok_file)), eos_token=eos,
               pad_token=special("pad_token"), bos_token=bos, chat_template=template)

  @classmethod
  def from_gguf(cls, path: PathLike) -> "HFTokenizer":
    """The byte-level BPE tokenizer stored in a GGUF file's metadata (``tokenizer.ggml.*``).

    The vocabulary, merges, token types (control and user-defined tokens become added
    tokens), BOS / EOS / padding ids and ``tokenizer.chat_template`` come from the file; the
    pre-tokenizer from ``tokenizer.ggml.pre`` (``gpt-2`` / ``default``, ``smollm``, ``qwen2``,
    ``llama-bpe``). Raises ``ValueError`` naming the file for a tokenizer model other than
    ``gpt2`` (byte-level BPE), an unknown pre-tokenizer or missing fields.

    Args:
      path: the ``.gguf`` file.

    Returns:
      An :class:`HFTokenizer`.
    """
    import tokenizers  # pylint: disable=g-import-not-at-top
    from tokenizers import decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
    from rollouts_jax.models.gguf import read_gguf_metadata  # pylint: disable=g-import-not-at-top

    path = pathlib.Path(path)
    meta = read_gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
      raise ValueError(f"{path} has no tokenizer (no tokenizer.ggml.model in its metadata)")
    if kind != "gpt2":
      raise ValueError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (only 'gpt2', byte-level BPE)")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"):
      if key not in meta:
        raise ValueError(f"{path}: the tokenizer metadata has no {key}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _GGUF_PRE_TOKENIZERS:
      raise ValueError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
                       f"{', '.join(sorted(_GGUF_PRE_TOKENIZERS))}")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                     byte_fallback=False)
    tok = tokenizers.Tokenizer(bpe)
    split = _GGUF_PRE_TOKENIZERS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in (None, "digits"))
    if split is None:
      tok.pre_tokenizer = byte_level
    elif split == "digits":
      tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
      tok.pre_tokenizer = pre_tokenizers.Sequence([
          pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated", invert=False), byte_level])
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are matched whole, before BPE.
    added = [tokenizers.AddedToken(tokens[i], special=(types[i] == 3), normalized=False)
             for i in range(len(tokens)) if types[i] in (3, 4)]
    if added:
      tok.add_special_tokens([a for a in added if a.special])
      tok.add_tokens([a for a in added if not a.special])

    def name(key):
      i = meta.get(key)
      return None if i is None else tokens[int(i)]

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    out = cls(tok, eos_token=name("tokenizer.ggml.eos_token_id"), pad_token=name("tokenizer.ggml.padding_token_id"),
              bos_token=name("tokenizer.ggml.bos_token_id") if add_bos else None,
              chat_template=meta.get("tokenizer.chat_template"))
    out._end_of_turn_ids = tuple(dict.fromkeys(  # pylint: disable=protected-access
        int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                               "tokenizer.ggml.eom_token_id") if meta.get(k) is not None))
    return out

  @property
  def vocab_size(self) -> int:
    return int(self._tok.get_vocab_size(with_added_tokens=True))

  @property
  def eos_id(self) -> int:
    return self._eos_id

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  def is_special(self, token_id: int) -> bool:
    if getattr(self, "_special_ids", None) is None:
      self._special_ids = {int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
    return token_id in self._special_ids or super().is_special(token_id)

  def id_to_token(self, token_id: int) -> str:
    token = self._tok.id_to_token(int(token_id))
    if token is None:
      raise ValueError(f"id {token_id} is not in the vocabulary")
    return token

  def _encode(self, text: str) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def _decode(self, ids: list[int]) -> str:
    return self._tok.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# sentencepiece


class SentencePieceTokenizer(Tokenizer):
  """A sentencepiece ``.model`` file.

  Args:
    model_path: the ``.model`` file.
    pad_id: override the model's pad id (needed when the model was trained with
      ``pad_id=-1``); ``None`` takes the model's, or its EOS when it has none.
    chat_template: an optional Jinja chat template (sentencepiece models carry none).

  tok = train_sentencepiece(["12+7=19", "3*4=12"] * 20, 32, "/tmp/arith")
  tok.decode(tok.encode("12+7=19"))
  # '12+7=19'
  """

  def __init__(self, model_path: PathLike, *, pad_id: int | None = None,
               chat_template: str | None = None):
    import sentencepiece as spm

    path = pathlib.Path(model_path)
    if not path.is_file():
      raise FileNotFoundError(f"sentencepiece model {path} does not exist")
    self.model_path = path
    self._sp = spm.SentencePieceProcessor(model_file=str(path))
    if self._sp.eos_id() < 0:
      raise ValueError(f"sentencepiece model {path} has no EOS piece (trained with eos_id=-1)")
    if pad_id is None:
      pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self._sp.eos_id()
    if not 0 <= pad_id < self._sp.get_piece_size():
      raise ValueError(f"pad_id {pad_id} is outside the vocabulary")
    self._pad_id = int(pad_id)
    self.chat_template = chat_template

  @property
  def vocab_size(self) -> int:
    return int(self._sp.get_piece_size())

  @property
  def eos_id(self) -> int:
    return int(self._sp.eos_id())

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def bos_id(self) -> int | None:
    bos = int(self._sp.bos_id())
    return None if bos < 0 else bos

  def id_to_token(self, token_id: int) -> str:
    return self._sp.id_to_piece(int(token_id))

  def _encode(self, text: str) -> list[int]:
    return list(self._sp.encode(text, out_type=int))

  def _decode(self, ids: list[int]) -> str:
    # sentencepiece renders control pieces (bos/eos/pad) as ''; keep their text instead so
    # that all tokenizers of the library decode the same way.
    pieces, run = [], []
    for i in ids:
      if self._sp.is_control(i):
        if run:
          pieces.append(self._sp.decode(run))
          run = []
        pieces.append(self._sp.id_to_piece(i))
      else:
        run.append(i)
    if run:
      pieces.append(self._sp.decode(run))
    return "".join(pieces)


def train_sentencepiece(texts: Iterable[str], vocab_size: int, model_prefix: PathLike, *,
                        model_type: str = "bpe", character_coverage: float = 1.0,
                        byte_fallback: bool = False,
                        user_defined_symbols: Sequence[str] = ("\n", "<answer>", "</answer>"),
                        split_digits: bool = True, chat_template: str | None = None,
                        ) -> SentencePieceTokenizer:
  """Trains a small sentencepiece model locally (deterministic: one thread, no sampling).

  Ids 0-3 are ``<pad>``, ``<unk>``, ``<s>``, ``</s>``. Text is not normalized and spaces
  are kept as they are, so ``decode(encode(s)) == s`` for any text made of characters seen
  in training. ``character_coverage=1.0`` and ``split_digits`` make every digit and
  operator its own piece; ``hard_vocab_limit`` is off, so a tiny corpus gives a vocabulary
  smaller than ``vocab_size`` instead of an error.

  Args:
    texts: training texts (each may span several lines).
    vocab_size: the largest vocabulary wanted (e.g. 64-512).
    model_prefix: writes ``<model_prefix>.model`` and ``<model_prefix>.vocab``.
    model_type: ``"bpe"``, ``"unigram"``, ``"char"`` or ``"word"``.
    character_coverage: fraction of characters covered by single pieces.
    byte_fallback: encode unseen characters as UTF-8 bytes (adds 256 pieces).
    user_defined_symbols: strings that are always one piece.
    split_digits: never merge digits into multi-digit pieces.
    chat_template: stored on the returned tokenizer.

  Returns:
    The trained :class:`SentencePieceTokenizer`.

  tok = train_sentencepiece(["347+589=936"] * 10, 64, "/tmp/sp")
  [tok.id_to_token(i) for i in tok.encode("12")]
  # ['1', '2']
  """
  import sentencepiece as spm

  if vocab_size < 8:
    raise ValueError(f"vocab_size must be at least 8, got {vocab_size}")
  if model_type not in ("bpe", "unigram", "char", "word"):
    raise ValueError(f"unknown model_type {model_type!r}")
  corpus = [t for t in texts if t]
  if not corpus:
    raise ValueError("train_sentencepiece needs at least one non-empty text")
  prefix = pathlib.Path(model_prefix)
  prefix.parent.mkdir(parents=True, exist_ok=True)
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(corpus), model_prefix=str(prefix), vocab_size=vocab_size,
      model_type=model_type, character_coverage=character_coverage, byte_fallback=byte_fallback,
      user_defined_symbols=list(user_defined_symbols), split_digits=split_digits,
      add_dummy_prefix=False, remove_extra_whitespaces=False, normalization_rule_name="identity",
      pad_id=0, unk_id=1, bos_id=2, eos_id=3, hard_vocab_limit=False, num_threads=1,
      max_sentence_length=1 << 16, minloglevel=2)
  return SentencePieceTokenizer(f"{prefix}.model", chat_template=chat_template)


# ---------------------------------------------------------------------------------------------
# characters

_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
_MULTI_CHAR = ("<answer>", "</answer>", "<think>", "</think>", "<|system|>", "<|user|>",
               "<|assistant|>", "<|end|>")
_CHARS = tuple("0123456789+-*/=()<>.,:;?!#$%&'\"_^[]{}|\\~@`") + (" ", "\n") + tuple(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")

#: The chat template of :meth:`CharTokenizer.default` (its role markers are single tokens).
CHAR_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@dataclasses.dataclass(frozen=True, eq=False)
class CharTokenizer(Tokenizer):
  """A deterministic character-level tokenizer with a fixed vocabulary.

  Ids are positions in ``tokens``. Multi-character tokens (``<answer>``, chat role markers)
  are matched greedily, longest first, before single characters; any other character
  becomes ``unk``. The default vocabulary has 4 specials, 8 multi-character tokens and 96
  characters (digits, operators and punctuation, space, newline, ASCII letters): 108 ids.

  Attributes:
    tokens: the vocabulary, id ``i`` is ``tokens[i]``.
    pad_token, bos_token, eos_token, unk_token: special tokens (must be in ``tokens``).
    chat_template: optional Jinja chat template.

  >>> tok = CharTokenizer.default()
  >>> tok.encode("7+9") == [tok.token_to_id("7"), tok.token_to_id("+"), tok.token_to_id("9")]
  True
  """

  tokens: tuple[str, ...]
  pad_token: str = "<pad>"
  bos_token: str = "<bos>"
  eos_token: str = "<eos>"
  unk_token: str = "<unk>"
  chat_template: str | None = None

  def __post_init__(self):
    if len(set(self.tokens)) != len(self.tokens):
      raise ValueError("CharTokenizer tokens must be unique")
    if any(not t for t in self.tokens):
      raise ValueError("CharTokenizer tokens must be non-empty strings")
    index = {t: i for i, t in enumerate(self.tokens)}
    for what in ("pad_token", "bos_token", "eos_token", "unk_token"):
      if getattr(self, what) not in index:
        raise ValueError(f"{what} {getattr(self, what)!r} is not in the vocabulary")
    specials = {self.pad_token, self.bos_token, self.eos_token, self.unk_token}
    multi = sorted((t for t in self.tokens if len(t) > 1 and t not in specials), key=len,
                   reverse=True)
    object.__setattr__(self, "_index", index)
    object.__setattr__(self, "_multi", tuple(multi))

  @classmethod
  def default(cls, chat_template: str | None = CHAR_CHAT_TEMPLATE) -> "CharTokenizer":
    """The fixed vocabulary for the synthetic tasks (108 ids; pad 0, bos 1, eos 2, unk 3)."""
    return cls(tokens=_SPECIALS + _MULTI_CHAR + _CHARS, chat_template=chat_template)

  def save(self, path: PathLike) -> None:
    """Writes the tokenizer to a json file."""
    data = {"type": "char", "tokens": list(self.tokens), "pad_token": self.pad_token,
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            "unk_token": self.unk_token, "chat_template": self.chat_template}
    pathlib.Path(path).write_text(json.dumps(data, ensure_ascii=False, indent=1),
                                  encoding="utf-8")

  @classmethod
  def load(cls, path: PathLike) -> "CharTokenizer":
    """Reads a tokenizer written by :meth:`save`."""
    data = _read_json(pathlib.Path(path))
    if data.get("type") != "char":
      raise ValueError(f"{path} is not a CharTokenizer file (type={data.get('type')!r})")
    return cls(tokens=tuple(data["tokens"]), pad_token=data["pad_token"],
               bos_token=data["bos_token"], eos_token=data["eos_token"],
               unk_token=data["unk_token"], chat_template=data.get("chat_template"))

  def token_to_id(self, token: str) -> int:
    """The id of one token; ``ValueError`` if it is not in the vocabulary."""
    try:
      return self._index[token]
    except KeyError:
      raise ValueError(f"{token!r} is not in the vocabulary") from None

  @property
  def vocab_size(self) -> int:
    return len(self.tokens)

  @property
  def eos_id(self) -> int:
    return self._index[self.eos_token]

  @property
  def pad_id(self) -> int:
    return self._index[self.pad_token]

  @property
  def bos_id(self) -> int | None:
    return self._index[self.bos_token]

  @property
  def unk_id(self) -> int:
    return self._index[self.unk_token]

  def id_to_token(self, token_id: int) -> str:
    if not 0 <= token_id < len(self.tokens):
      raise ValueError(f"id {token_id} is outside the vocabulary [0, {len(self.tokens)})")
    return self.tokens[token_id]

  def _encode(self, text: str) -> list[int]:
    ids, pos, index, unk = [], 0, self._index, self.unk_id
    while pos < len(text):
      for token in self._multi:
        if text.startswith(token, pos):
          ids.append(index[token])
          pos += len(token)
          break
      else:
        ids.append(index.get(text[pos], unk))
        pos += 1
    return ids

  def _decode(self, ids: list[int]) -> str:
    return "".join(self.tokens[i] for i in ids)


def load_tokenizer(path: PathLike, **kwargs: Any) -> Tokenizer:
  """Loads any tokenizer of the library from a path.

  A folder with ``tokenizer.json`` or a ``.gguf`` file gives an :class:`HFTokenizer`, a ``.model`` file a
  :class:`SentencePieceTokenizer`, a json file written by :meth:`CharTokenizer.save` a
  :class:`CharTokenizer`.

  Args:
    path: the folder or file.
    **kwargs: passed to the sentencepiece constructor.

  Returns:
    A :class:`Tokenizer`.

  CharTokenizer.default().save("/tmp/char.json")
  load_tokenizer("/tmp/char.json").vocab_size
  # 108
  """
  p = pathlib.Path(path)
  if p.is_dir():
    return HFTokenizer.from_dir(p)
  if p.suffix == ".gguf":
    return HFTokenizer.from_gguf(p)
  if p.suffix == ".model":
    return SentencePieceTokenizer(p, **kwargs)
  if p.suffix == ".json" and p.is_file():
    return CharTokenizer.load(p)
  raise ValueError(f"cannot tell which tokenizer {p} is: expected a folder with tokenizer.json, "
                   "a sentencepiece .model file, or a CharTokenizer .json file")
