"""The Hugging Face export's tokenizer and --check-logits: the run's GPT-2 BPE files (given to the tool, or recorded in
the checkpoint's args) land beside config.json so transformers.AutoTokenizer loads them and tokenizes as our
GPT2BPETokenizer does; --check-logits compares our model with the transformers model of the folder, both ways, and
exits 1 beyond its tolerance. Tiny models and a tokenizer trained here: nothing downloaded."""

from __future__ import annotations

import collections
import importlib.util
import json
import os

import pytest
import torch

from megatron_bmw.convert.checkpoint_files import load_full, save_release
from megatron_bmw.convert.logit_check import check_logits, max_logit_difference
from megatron_bmw.data.tokenizers import GPT2BPETokenizer, byte_to_unicode
from megatron_bmw.errors import RunError

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT = ("the quick brown fox jumps over the lazy dog. the dog sleeps; the fox runs there and then "
        "there the other fox rests. ") * 4
SAMPLE = "the lazy fox, then the other dog!"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"hf_export_{name}",
                                                  os.path.join(ROOT, "tools", "checkpoint", f"convert_hf_{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train_bpe(root, merges: int = 40) -> tuple[str, str, int]:
    """A byte-level BPE tokenizer learnt from TEXT (GPT-2's layout: 256 byte symbols, the merges, <|endoftext|>);
    returns (vocab.json, merges.txt, vocabulary size)."""
    byte_char = byte_to_unicode()
    vocab = {byte_char[b]: b for b in range(256)}
    words = collections.Counter("".join(byte_char[b] for b in w.encode()) for w in TEXT.replace(" ", " Ġ").split(" "))
    words = {tuple(w): n for w, n in words.items() if w}
    learnt = []
    for _ in range(merges):
        pairs = collections.Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        learnt.append(f"{a} {b}")
        vocab.setdefault(a + b, len(vocab))
        merged = {}
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i < len(w) - 1 and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file, merge_file = root / "gpt2-vocab.json", root / "gpt2-merges.txt"
    vocab_file.write_text(json.dumps(vocab))
    merge_file.write_text("\n".join(learnt) + "\n")  # no "#version" header, as some hand-made files have
    return str(vocab_file), str(merge_file), len(vocab)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tokenizer, and our checkpoint of a random tiny GPT-2 of its vocabulary (imported from a HF folder)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("hf_export")
    vocab_file, merge_file, vocab = _train_bpe(root)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, n_positions=32,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=vocab - 1,
                                       eos_token_id=vocab - 1)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(root / "hf")
    tool = _tool("gpt2")
    assert tool.main(["--direction", "hf-to-megatron", "--hf-dir", str(root / "hf"), "--save", str(root / "ckpt"),
                      "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "8"]) == 0
    return dict(root=root, vocab_file=vocab_file, merge_file=merge_file, vocab=vocab, ckpt=str(root / "ckpt"),
                tool=tool)


def test_export_writes_the_tokenizer_autotokenizer_loads(gpt2, tmp_path, capsys):
    out = tmp_path / "hf"
    capsys.readouterr()
    assert gpt2["tool"].main(["--direction", "megatron-to-hf", "--load", gpt2["ckpt"], "--hf-dir", str(out),
                              "--vocab-file", gpt2["vocab_file"], "--merge-file", gpt2["merge_file"]]) == 0
    said = capsys.readouterr().out
    assert "wrote the tokenizer (vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json) from " \
           "--vocab-file/--merge-file" in said
    ours = GPT2BPETokenizer(gpt2["vocab_file"], gpt2["merge_file"])
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    assert theirs(SAMPLE)["input_ids"] == ours.tokenize(SAMPLE) and len(ours.tokenize(SAMPLE)) < len(SAMPLE)
    assert theirs.decode(ours.tokenize(SAMPLE)) == SAMPLE
    assert theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == ours.eod == gpt2["vocab"] - 1
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == ours.eod and config["vocab_size"] == gpt2["vocab"]


def test_export_takes_the_tokenizer_the_args_record_or_says_it_has_none(gpt2, tmp_path, capsys):
    full, args = load_full(gpt2["ckpt"])
    recorded = dict(args, tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2["vocab_file"],
                    merge_file=gpt2["merge_file"])
    save_release(str(tmp_path / "recorded"), full, recorded, tp=1)
    capsys.readouterr()
    assert gpt2["tool"].main(["--direction", "megatron-to-hf", "--load", str(tmp_path / "recorded"), "--hf-dir",
                              str(tmp_path / "hf1")]) == 0
    assert "from the checkpoint's args" in capsys.readouterr().out
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf1"))(SAMPLE)["input_ids"] == \
        GPT2BPETokenizer(gpt2["vocab_file"], gpt2["merge_file"]).tokenize(SAMPLE)
    assert gpt2["tool"].main(["--direction", "megatron-to-hf", "--load", gpt2["ckpt"], "--hf-dir",
                              str(tmp_path / "hf2")]) == 0
    notes = [ln for ln in capsys.readouterr().out.splitlines() if "tokenizer" in ln]
    assert notes == ["note: no tokenizer files written: the checkpoint's args record no --vocab-file/--merge-file; "
                     "give them to write vocab.json and merges.txt"]
    assert not (tmp_path / "hf2" / "vocab.json").exists() and (tmp_path / "hf2" / "config.json").exists()


def test_a_tokenizer_of_another_vocabulary_is_refused(gpt2, tmp_path, capsys):
    vocab = json.loads(open(gpt2["vocab_file"]).read())
    vocab["extra"] = len(vocab)
    other = tmp_path / "vocab.json"
    other.write_text(json.dumps(vocab))
    for flags, said in ((["--vocab-file", str(other), "--merge-file", gpt2["merge_file"]],
                         f"holds {gpt2['vocab'] + 1} tokens, but the model's vocabulary is {gpt2['vocab']}"),
                        (["--vocab-file", gpt2["vocab_file"]], "--vocab-file and --merge-file go together")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            gpt2["tool"].main(["--direction", "megatron-to-hf", "--load", gpt2["ckpt"], "--hf-dir",
                               str(tmp_path / "hf"), *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1 and said in err[0], err
        assert not (tmp_path / "hf").exists()


def test_check_logits_both_ways(gpt2, tmp_path, capsys):
    """Export (tp 2 checkpoint -> HF) and import (HF -> tp 1 checkpoint) with --check-logits: our fp32 model and
    transformers' agree on a random batch; the difference is printed."""
    capsys.readouterr()
    assert gpt2["tool"].main(["--direction", "megatron-to-hf", "--load", gpt2["ckpt"], "--hf-dir",
                              str(tmp_path / "hf"), "--check-logits"]) == 0
    assert gpt2["tool"].main(["--direction", "hf-to-megatron", "--hf-dir", str(tmp_path / "hf"), "--save",
                              str(tmp_path / "back"), "--check-logits", "--make-vocab-size-divisible-by", "8"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("check-logits:")]
    assert len(lines) == 2 and all("over 2x16 random tokens (fp32, tolerance 0.001)" in ln for ln in lines), lines
    diff, shape = max_logit_difference(*load_full(gpt2["ckpt"]), str(tmp_path / "hf"))
    assert shape == (2, 16) and diff < 1e-4
    print(f"tiny GPT-2 export: max |logits ours - transformers| = {diff:.3g}")


def test_check_logits_fails_beyond_the_tolerance(gpt2, tmp_path):
    """Another model in the folder than the checkpoint's: RunError (the tool's exit 1) naming both."""
    from transformers import GPT2Config, GPT2LMHeadModel

    other = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=gpt2["vocab"], n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(RunError, match="differ by .* more than --check-logits-tolerance 0.001"):
        check_logits(gpt2["ckpt"], str(tmp_path / "other"))


def test_check_logits_of_a_bert_export(tmp_path, capsys):
    """BERT's masked-LM logits: exact (tanh) GeLU agrees; Hugging Face's erf GeLU, which our MLP approximates,
    differs beyond a tight tolerance: one line, exit 1."""
    small = dict(vocab_size=53, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=16, type_vocab_size=2)
    tool = _tool("bert")
    for act, tolerance, code in (("gelu_pytorch_tanh", "1e-3", 0), ("gelu", "1e-6", 1)):
        torch.manual_seed(0)
        model = transformers.BertForPreTraining(transformers.BertConfig(**small, hidden_act=act))
        with torch.no_grad():  # weights of a trained size, so the two GeLUs part
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        model.config.architectures = ["BertForPreTraining"]
        model.save_pretrained(tmp_path / act)
        capsys.readouterr()
        argv = ["--direction", "hf-to-megatron", "--hf-dir", str(tmp_path / act), "--save", str(tmp_path / f"c{act}"),
                "--make-vocab-size-divisible-by", "8", "--check-logits", "--check-logits-tolerance", tolerance]
        if code == 0:
            assert tool.main(argv) == 0
            assert "check-logits: max |logits ours - transformers|" in capsys.readouterr().out
        else:
            with pytest.raises(SystemExit) as exc:
                tool.main(argv)
            err = capsys.readouterr().err.strip().splitlines()
            assert exc.value.code == 1 and len(err) == 1 and "more than --check-logits-tolerance 1e-06" in err[0]


def test_check_logits_of_a_llama_import(tmp_path, capsys):
    """LlamaForCausalLM (grouped-query attention, untied) -> our checkpoint at tp 2, compared after the import."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    assert _tool("llama").main(["--direction", "hf-to-megatron", "--hf-dir", str(tmp_path / "hf"), "--save",
                                str(tmp_path / "ckpt"), "--tensor-model-parallel-size", "2",
                                "--make-vocab-size-divisible-by", "8", "--check-logits"]) == 0
    assert "check-logits: max |logits ours - transformers|" in capsys.readouterr().out
