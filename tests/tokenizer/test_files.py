"""`minipaged.tokenizer.files` on its own: tokenizer files read into a `TokenizerSpec`.

BPE tokenizers trained here by the `tokenizers` library on random corpora, with random special
and added tokens and a post-processor that may put a BOS first, are saved and read back: the
vocabulary, merges, added tokens and special ids must be the ones `tokenizers` reports. Every
setting minipaged does not implement, written into a valid file, must raise `TokenizerError`
naming the file and the setting; `read_pretrained` finds the files of a folder as documented.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged.tokenizer.bpe import TokenizerError
from minipaged.tokenizer.files import read_pretrained, read_tokenizer_json

fresh_dir = settings(
    max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def train(
    corpus: list[str], specials: list[str], added: list[str], bos: bool
) -> tokenizers.Tokenizer:
    tk = tokenizers.Tokenizer(tokenizers.models.BPE())
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(corpus, trainer)
    tk.add_tokens([tokenizers.AddedToken(a, normalized=False) for a in added])
    if bos:
        tk.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{specials[0]} $A", special_tokens=[(specials[0], tk.token_to_id(specials[0]))]
        )
    return tk


words = st.text(st.sampled_from("abcdeéß 日🙂\n"), min_size=1, max_size=12)


@fresh_dir
@given(
    corpus=st.lists(words, min_size=1, max_size=6),
    specials=st.lists(st.sampled_from(["<s>", "</s>", "<pad>", "<|im_end|>"]), min_size=1,
                      max_size=4, unique=True),
    added=st.lists(st.sampled_from(["[X]", "@@", "<tool>"]), max_size=2, unique=True),
    bos=st.booleans(),
)
def test_a_trained_tokenizer_reads_back_as_tokenizers_sees_it(
    tmp_path, corpus, specials, added, bos
) -> None:
    tk = train(corpus, specials, added, bos)
    file = tmp_path / "tokenizer.json"
    tk.save(str(file))
    saved = json.loads(file.read_text())
    spec = read_tokenizer_json(file, {"eos_token": specials[-1]})
    assert spec.vocab == saved["model"]["vocab"]
    assert [" ".join(m) for m in spec.merges] == [" ".join(m) for m in saved["model"]["merges"]]
    decoder = tk.get_added_tokens_decoder()
    ours = {t.id: (t.content, t.special) for t in spec.added_tokens}
    assert ours == {i: (t.content, t.special) for i, t in decoder.items()}
    assert spec.eos_token_id == tk.token_to_id(specials[-1])
    assert spec.add_bos_token == bos
    assert spec.bos_token_id == (tk.token_to_id(specials[0]) if bos else None)
    assert spec.chat_template is None and spec.normalizer is None


@pytest.fixture
def base_json(tmp_path) -> dict:
    tk = train(["the cat sat", "a mat"], ["<s>", "</s>"], [], bos=False)
    tk.save(str(tmp_path / "tokenizer.json"))
    return json.loads((tmp_path / "tokenizer.json").read_text())


def set_in(data: dict, path: str, value: object) -> None:
    *parents, last = path.split(".")
    for key in parents:
        data = data[key]
    data[last] = value


@pytest.mark.parametrize(
    "where, value, config, setting",
    [
        ("model.type", "WordPiece", {}, "only BPE"),
        ("model.byte_fallback", True, {}, "byte_fallback=True"),
        ("model.continuing_subword_prefix", "##", {}, "continuing_subword_prefix='##'"),
        ("model.dropout", 0.1, {}, "dropout=0.1"),
        ("model.merges", ["a b c"], {}, "malformed merge 'a b c'"),
        ("added_tokens", [{"id": 0, "content": "<s>", "single_word": True}], {}, "single_word"),
        ("decoder", {"type": "WordPiece"}, {}, "decoder ['WordPiece']"),
        ("normalizer", {"type": "Lowercase"}, {}, "normalizer 'Lowercase'"),
        ("post_processor", {"type": "BertProcessing"}, {}, "post-processor 'BertProcessing'"),
        ("pre_tokenizer", {"type": "Whitespace"}, {}, "pre-tokenizer 'Whitespace'"),
        ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"},
            {"type": "ByteLevel"}]}, {}, "behavior 'Removed'"),
        ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [
            {"type": "ByteLevel"}, {"type": "Digits"}]}, {}, "ByteLevel must be the last"),
        ("model.ignore_merges", False, {"split_special_tokens": True}, "split_special_tokens"),
        ("model.ignore_merges", False, {"bos_token": "<nope>"}, "bos_token '<nope>'"),
    ],
)
def test_an_unsupported_setting_is_rejected_naming_the_file_and_setting(
    tmp_path, base_json, where, value, config, setting
) -> None:
    set_in(base_json, where, value)
    file = tmp_path / "tokenizer.json"
    file.write_text(json.dumps(base_json))
    with pytest.raises(TokenizerError) as info:
        read_tokenizer_json(file, config)
    assert str(file) in str(info.value) and setting in str(info.value)


@pytest.mark.parametrize("text, message", [("{not json", "not valid JSON"),
                                           ("[1, 2]", "expected a JSON object")])
def test_a_file_that_is_not_a_json_object_is_rejected(tmp_path, text, message) -> None:
    file = tmp_path / "tokenizer.json"
    file.write_text(text)
    with pytest.raises(TokenizerError, match=message):
        read_tokenizer_json(file)


def write_folder(folder: Path, base: dict, config: dict | None, jinja: str | None) -> Path:
    (folder / "tokenizer.json").write_text(json.dumps(base))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


@pytest.mark.parametrize("in_config", [None, "{{ 'config' }}"])
@pytest.mark.parametrize("in_file", [None, "{{ 'file' }}"])
def test_a_folders_chat_template_comes_from_its_config_before_the_jinja_file(
    tmp_path, base_json, in_config, in_file
) -> None:
    config = {"eos_token": "</s>"} | ({"chat_template": in_config} if in_config else {})
    spec = read_pretrained(write_folder(tmp_path, base_json, config, in_file))
    assert spec.chat_template == (in_config or in_file)
    assert spec.eos_token_id == base_json["model"]["vocab"]["</s>"]


def test_paths_that_hold_no_tokenizer_are_rejected(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_pretrained(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        read_pretrained(tmp_path)
    other = tmp_path / "vocab.txt"
    other.write_text("a")
    with pytest.raises(TokenizerError, match="expected a .gguf file"):
        read_pretrained(other)
