"""Generation like the tools users know: chat templates, streaming without special tokens, prompts from files or
stdin, sampling options that imply sampling, and an interactive chat."""
import io
import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

import moeq
from moeq.cli import main
from moeq.generation import Sampling, encode

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")


@pytest.fixture(scope="module")
def chat_ckpt(tiny_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("chat") / "m"
    shutil.copytree(tiny_ckpt("qwen3_moe"), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_sampling_options_imply_sampling():
    assert Sampling().kwargs() == {"do_sample": False}
    for s in (Sampling(temperature=0.5), Sampling(top_p=0.9), Sampling(top_k=5), Sampling(sample=True)):
        assert s.kwargs()["do_sample"] is True
    assert Sampling(temperature=0.5).kwargs()["temperature"] == 0.5


def test_encode_uses_the_chat_template(chat_ckpt):
    tok = AutoTokenizer.from_pretrained(chat_ckpt)
    ids = encode(tok, "hello there")
    assert tok.decode(ids[0]) == "<s>user: hello there</s><s>assistant: "
    assert torch.equal(encode(tok, "hello there", chat=False), tok("hello there", return_tensors="pt").input_ids)


def test_generate_hides_special_tokens_and_streams(chat_ckpt, monkeypatch, capsys):
    """The streamed text never shows special tokens (a stub model emits the EOS text token)."""
    tok = AutoTokenizer.from_pretrained(chat_ckpt)
    word = tok("blue", add_special_tokens=False).input_ids

    class Stub:
        generation_config = None

        def generate(self, ids, streamer, **kw):
            new = torch.tensor([word + [tok.eos_token_id]])
            streamer.put(ids)
            for t in new[0]:
                streamer.put(t.reshape(1))
            streamer.end()
            return torch.cat([ids, new], 1)

    monkeypatch.setattr(moeq, "load", lambda *a, **k: Stub())
    assert main(["generate", str(chat_ckpt), "-p", "sky?"]) == 0
    out = capsys.readouterr().out
    assert "blue" in out and "</s>" not in out and "<s>" not in out


def test_prompts_from_file_and_stdin(chat_ckpt, tmp_path, monkeypatch, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("first prompt\n\nsecond prompt\n")
    assert main(["generate", str(chat_ckpt), "--prompt-file", str(f), "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "prompt 1/2" in err and "prompt 2/2" in err and err.count("tokens in") == 2
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    assert main(["generate", str(chat_ckpt), "-p", "-", "--no-chat", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("from stdin")


def test_temperature_alone_samples(chat_ckpt, capsys):
    runs = []
    for argv in (["--temperature", "1.5", "--seed", "1"], ["--sample", "--temperature", "1.5", "--seed", "1"], []):
        assert main(["generate", str(chat_ckpt), "-p", "x", "--max-new-tokens", "12", *argv]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1]  # --temperature alone samples exactly as --sample does
    assert runs[0] != runs[2]  # and not greedily


def test_chat_session(chat_ckpt, monkeypatch, capsys):
    lines = iter(["hello", "/reset", "again", "/exit"])
    seen = []
    import moeq.generation as gen

    real = gen.encode
    monkeypatch.setattr(gen, "encode", lambda tok, msgs, chat=True: seen.append(list(msgs)) or real(tok, msgs, chat))
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", str(chat_ckpt), "--max-new-tokens", "4", "--system", "be brief"]) == 0
    assert [m["role"] for m in seen[0]] == ["system", "user"]
    assert [m["content"] for m in seen[1]] == ["be brief", "again"]  # /reset kept only the system prompt


def test_chat_needs_a_template(tiny_ckpt, monkeypatch, capsys):
    monkeypatch.setattr("builtins.input", lambda prompt="": "/exit")
    assert main(["chat", str(tiny_ckpt("qwen3_moe"))]) == 2
    assert "no chat template" in capsys.readouterr().err
