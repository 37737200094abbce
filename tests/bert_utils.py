"""Tiny random-weight BERT folders (embedder and cross-encoder) with a word-level BERT tokenizer,
and transformers' pooled reference embeddings, for the pooling runner's tests."""

import pytest
import torch
import torch.nn.functional as F
import transformers

WORDS = "the a cat dog sat on mat big small red blue runs fast slowly house tree".split()
TEXTS = ["the cat sat on the mat", "dog", "a big red house and a small blue tree", "runs fast"]


def _tokenizer(folder):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizerFast(str(folder / "vocab.txt"), do_lower_case=True)
    tok.save_pretrained(folder)
    return tok


def _save(model, folder):
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return _tokenizer(folder)


def _config(**kw):
    return transformers.BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=48, max_position_embeddings=40, **kw)


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    torch.manual_seed(0)
    ref = transformers.BertModel(_config(architectures=["BertModel"])).eval()
    folder = tmp_path_factory.mktemp("bert")
    return ref, _save(ref, folder), folder


@pytest.fixture(scope="module")
def cross_folder(tmp_path_factory):
    torch.manual_seed(1)
    ref = transformers.BertForSequenceClassification(
        _config(architectures=["BertForSequenceClassification"], num_labels=1)).eval()
    folder = tmp_path_factory.mktemp("cross")
    return ref, _save(ref, folder), folder


def reference_embeddings(ref, tok, texts, pooling="CLS", normalize=True):
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = ref(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    pooled = hidden[:, 0] if pooling == "CLS" else (hidden * mask).sum(1) / mask.sum(1)
    return F.normalize(pooled, dim=1) if normalize else pooled
