"""Tokenizers: round trips, special ids, chat templates, sentencepiece determinism."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts_jax.data import arithmetic, tokenizers
from rollouts_jax.data.tokenizers import (CharTokenizer, HFTokenizer, SentencePieceTokenizer,
                                          load_tokenizer, train_sentencepiece)

# A Qwen2-style ChatML template (system turn added when missing).
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CORPUS = [
    "What is 347 + 589? The answer is 936.",
    "Natalia sold clips to 48 of her friends in April.",
    "You are helpful. Think step by step, then answer.",
    "user assistant system hello world",
] * 20


def _make_hf_folder(folder, *, template=CHATML, eos_as_dict=False, template_as_list=False,
                    template_file=False):
  """A tiny byte-level BPE tokenizer.json + tokenizer_config.json, trained here."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(CORPUS, trainer)
  folder.mkdir(parents=True, exist_ok=True)
  tok.save(str(folder / "tokenizer.json"))
  eos = {"content": "<|im_end|>", "special": True} if eos_as_dict else "<|im_end|>"
  config = {"eos_token": eos, "pad_token": "<|endoftext|>", "bos_token": None,
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512}
  if template is not None and not template_file:
    config["chat_template"] = ([{"name": "default", "template": template},
                                {"name": "tool_use", "template": "unused"}]
                               if template_as_list else template)
  if template is not None and template_file:
    (folder / "chat_template.jinja").write_text(template)
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  return folder


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  return _make_hf_folder(tmp_path_factory.mktemp("hf") / "tok")


# --- CharTokenizer -----------------------------------------------------------------------------


def test_char_special_ids_and_vocab():
  tok = CharTokenizer.default()
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
  assert tok.vocab_size == len(tok.tokens) == len(set(tok.tokens))
  # every digit and operator is its own single-character token
  for ch in "0123456789+-*/=()":
    assert tok.encode(ch) == [tok.token_to_id(ch)]
  assert tok.encode("<answer>") == [tok.token_to_id("<answer>")]


def test_char_encode_is_greedy_on_multichar_tokens():
  tok = CharTokenizer.default()
  ids = tok.encode("<answer>9</answer>")
  assert [tok.id_to_token(i) for i in ids] == ["<answer>", "9", "</answer>"]
  # a lone '<' is still a character
  assert [tok.id_to_token(i) for i in tok.encode("<a")] == ["<", "a"]


def test_char_round_trip_on_worked_solutions():
  tok = CharTokenizer.default()
  for ex in arithmetic.generate_arithmetic(3, "train", 20, digits=4, ops="+*"):
    text = ex["question"] + "\n" + ex["solution"]
    ids = tok.encode(text)
    assert tok.unk_id not in ids
    assert tok.decode(ids) == text


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("0123456789+-*/=() \nabcXYZ<>/answer")),
               max_size=60))
def test_char_round_trip_property(text):
  tok = CharTokenizer.default()
  assert tok.decode(tok.encode(text)) == text


def test_char_bos_pad_eos_and_unknown():
  tok = CharTokenizer.default()
  ids = tok.encode("1+1", add_bos=True)
  assert ids[0] == tok.bos_id and len(ids) == 4
  # decode drops pad anywhere, keeps eos (it does not stop there)
  assert tok.decode([tok.pad_id] + tok.encode("12") + [tok.eos_id] + tok.encode("3") +
                    [tok.pad_id]) == "12<eos>3"
  assert tok.decode(np.array(tok.encode("7*8"), dtype=np.int32)) == "7*8"
  assert tok.encode("é") == [tok.unk_id]
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([tok.vocab_size])
  with pytest.raises(ValueError, match="1-D"):
    tok.decode([[1, 2]])


def test_char_save_load(tmp_path):
  tok = CharTokenizer.default()
  path = tmp_path / "char.json"
  tok.save(path)
  loaded = load_tokenizer(path)
  assert isinstance(loaded, CharTokenizer)
  assert loaded.tokens == tok.tokens and loaded.chat_template == tok.chat_template
  text = "What is 12 * 34?\n<answer>408</answer>"
  assert loaded.encode(text) == tok.encode(text)


def test_char_chat_template():
  tok = CharTokenizer.default()
  text = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 2?"}])
  assert text == "<|user|>What is 1 + 2?<|end|>\n<|assistant|>"
  ids = tok.encode(text)
  assert tok.token_to_id("<|assistant|>") == ids[-1]
  no_template = CharTokenizer.default(chat_template=None)
  with pytest.raises(ValueError, match="no chat template"):
    no_template.apply_chat_template([{"role": "user", "content": "x"}])


def test_char_rejects_bad_vocab():
  with pytest.raises(ValueError, match="unique"):
    CharTokenizer(tokens=("<pad>", "<bos>", "<eos>", "<unk>", "a", "a"))
  with pytest.raises(ValueError, match="eos_token"):
    CharTokenizer(tokens=("<pad>", "<bos>", "<unk>", "a"))


def test_render_chat_template_features():
  render = tokenizers.render_chat_template
  messages = [{"role": "user", "content": "ü"}, {"role": "assistant", "content": "ok"}]
  tpl = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
         "{{ m.content }}{% endgeneration %}{% else %}{{ m.content | tojson }}{% endif %}"
         "{% endfor %}")
  assert render(tpl, messages) == '"ü"ok'
  with pytest.raises(Exception, match="only user"):
    render("{{ raise_exception('only user roles') }}", messages)
  with pytest.raises(ValueError, match="role"):
    render("x", [{"content": "no role"}])
  # trim_blocks: the newline after a block tag is dropped
  assert render("{% if true %}\na{% endif %}", messages) == "a"


# --- tokenizer.json ---------------------------------------------------------------------------


def test_hf_special_ids_and_round_trip(hf_dir):
  import tokenizers as hf_tokenizers

  raw = hf_tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
  tok = HFTokenizer.from_dir(hf_dir)
  assert tok.eos_id == raw.token_to_id("<|im_end|>")
  assert tok.pad_id == raw.token_to_id("<|endoftext|>")
  assert tok.bos_id is None
  assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
  for text in ["What is 347 + 589?", "  two  spaces\nnew line", "unseen wörds: ü ß 42"]:
    ids = tok.encode(text)
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True) == ids  # no BOS in this checkpoint
  ids = tok.encode("hello") + [tok.eos_id, tok.pad_id, tok.pad_id]
  assert tok.decode(ids) == "hello<|im_end|>"


def test_hf_chat_template_matches_hand_written(hf_dir):
  tok = HFTokenizer.from_dir(hf_dir)
  messages = [{"role": "user", "content": "What is 2 + 2?"}]
  expected = ("<|im_start|>system\nYou are helpful.<|im_end|>\n"
              "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
  assert tok.apply_chat_template(messages) == expected
  assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected[
      :-len("<|im_start|>assistant\n")]
  # the special tokens of the template encode to single ids
  ids = tok.encode(expected)
  assert ids.count(tok.eos_id) == 2


def test_hf_chat_template_matches_transformers(hf_dir):
  transformers = pytest.importorskip("transformers")
  ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
  tok = HFTokenizer.from_dir(hf_dir)
  conversations = [
      [{"role": "user", "content": "Hi there"}],
      [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
       {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
  ]
  for messages in conversations:
    for gen in (True, False):
      expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
      assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected
  text = "What is 347 + 589?"
  assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
  assert tok.eos_id == ref.eos_token_id and tok.pad_id == ref.pad_token_id


@pytest.mark.parametrize("variant", ["eos_as_dict", "template_as_list", "template_file"])
def test_hf_config_variants(tmp_path, variant):
  folder = _make_hf_folder(tmp_path / variant, **{variant: True})
  tok = HFTokenizer.from_dir(folder)
  assert tok.id_to_token(tok.eos_id) == "<|im_end|>"
  assert tok.apply_chat_template([{"role": "user", "content": "x"}]).endswith(
      "<|im_start|>assistant\n")


def test_hf_without_template_or_files(tmp_path):
  tok = HFTokenizer.from_dir(_make_hf_folder(tmp_path / "plain", template=None))
  with pytest.raises(ValueError, match="no chat template"):
    tok.apply_chat_template([{"role": "user", "content": "x"}])
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    HFTokenizer.from_dir(tmp_path / "missing")
  cfg_path = tmp_path / "plain" / "tokenizer_config.json"
  cfg = json.loads(cfg_path.read_text())
  cfg["eos_token"] = "<|not_there|>"
  cfg_path.write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
    HFTokenizer.from_dir(tmp_path / "plain")


# --- sentencepiece ------------------------------------------------------------------------------


def _sp_corpus():
  return [ex["question"] + "\n" + ex["solution"]
          for ex in arithmetic.generate_arithmetic(0, "train", 200, digits=3, ops="+*")]


def test_sentencepiece_training_is_deterministic(tmp_path):
  corpus = _sp_corpus()
  a = train_sentencepiece(corpus, 96, tmp_path / "a" / "sp")
  b = train_sentencepiece(corpus, 96, tmp_path / "b" / "sp")
  pieces = lambda t: [(t.id_to_token(i), t._sp.get_score(i)) for i in range(t.vocab_size)]
  assert a.vocab_size == b.vocab_size <= 96
  assert pieces(a) == pieces(b)
  text = corpus[5]
  assert a.encode(text) == b.encode(text)


def test_sentencepiece_pieces_ids_and_round_trip(tmp_path):
  corpus = _sp_corpus()
  tok = train_sentencepiece(corpus, 96, tmp_path / "sp")
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
  assert [tok.id_to_token(i) for i in tok.encode("9081")] == ["9", "0", "8", "1"]
  assert [tok.id_to_token(i) for i in tok.encode("<answer>")] == ["<answer>"]
  for text in corpus[:20] + ["  What  is\n\n1 + 1?"]:
    assert tok.decode(tok.encode(text)) == text
  ids = [tok.pad_id] + tok.encode("12", add_bos=True) + [tok.eos_id, tok.pad_id]
  assert ids[1] == tok.bos_id
  assert tok.decode(ids) == "<s>12</s>"
  reloaded = load_tokenizer(tmp_path / "sp.model")
  assert isinstance(reloaded, SentencePieceTokenizer)
  assert reloaded.encode(corpus[0]) == tok.encode(corpus[0])
  with pytest.raises(ValueError, match="no chat template"):
    tok.apply_chat_template([{"role": "user", "content": "x"}])
  templated = SentencePieceTokenizer(tmp_path / "sp.model",
                                     chat_template=tokenizers.CHAR_CHAT_TEMPLATE)
  assert templated.apply_chat_template([{"role": "user", "content": "1"}]) == (
      "<|user|>1<|end|>\n<|assistant|>")


def test_sentencepiece_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="vocab_size"):
    train_sentencepiece(["abc"], 4, tmp_path / "x")
  with pytest.raises(ValueError, match="non-empty"):
    train_sentencepiece(["", ""], 64, tmp_path / "x")
  with pytest.raises(FileNotFoundError):
    SentencePieceTokenizer(tmp_path / "none.model")


def test_interface_is_shared(tmp_path, hf_dir):
  toks = [CharTokenizer.default(), HFTokenizer.from_dir(hf_dir),
          train_sentencepiece(_sp_corpus(), 96, tmp_path / "sp")]
  text = "What is 12 + 34?"
  for tok in toks:
    assert isinstance(tok, tokenizers.Tokenizer)
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids + [tok.pad_id] * 3) == text
    assert tok.eos_id != tok.pad_id
  with pytest.raises(ValueError, match="cannot tell"):
    load_tokenizer(tmp_path / "thing.txt")
