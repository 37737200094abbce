"""BertModel / BertForSequenceClassification against transformers on tiny random weights, sequences
packed without padding vs transformers' padded batch; the poolers against their formulas."""

import pytest
import torch
import torch.nn.functional as F
import transformers

from pagedllm.models import get_model_class
from pagedllm.models.bert import BertForSequenceClassification, BertModel
from pagedllm.models.pooler import Pooler

LENS = [5, 1, 9, 3]


def _config(**kw):
    return transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=48, max_position_embeddings=64, type_vocab_size=2,
                                   hidden_act="gelu", **kw)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, 97, (n,), generator=g) for n in LENS]
    types = [torch.cat([torch.zeros(n // 2, dtype=torch.long), torch.ones(n - n // 2, dtype=torch.long)]) for n in LENS]
    return ids, types


def _padded(seqs):
    out = torch.zeros(len(seqs), max(LENS), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return out


def _packed(ids, types):
    positions = torch.cat([torch.arange(n) for n in LENS])
    return torch.cat(ids), positions, torch.cat(types)


def _reference_hidden(ref, ids, types):
    mask = (torch.arange(max(LENS))[None] < torch.tensor(LENS)[:, None]).long()
    with torch.no_grad():
        out = ref(input_ids=_padded(ids), attention_mask=mask, token_type_ids=_padded(types))
    return out


@pytest.mark.parametrize("pooling", ["MEAN", "CLS", "LAST"])
def test_bert_model_matches_transformers(pooling):
    torch.manual_seed(0)
    config = _config(architectures=["BertModel"])
    ref = transformers.BertModel(config).eval()
    assert get_model_class(config) is BertModel
    model = BertModel(config)
    model.load_weights(ref.state_dict().items())
    ids, types = _batch()
    with torch.no_grad():
        hidden = model(*_packed(ids, types)[:2], LENS, _packed(ids, types)[2])
    ref_hidden = _reference_hidden(ref, ids, types).last_hidden_state
    start = 0
    for i, n in enumerate(LENS):
        torch.testing.assert_close(hidden[start:start + n], ref_hidden[i, :n], atol=1e-5, rtol=1e-5)
        start += n
    pooled = Pooler(pooling, normalize=True)(hidden, LENS)
    rows = [ref_hidden[i, :n] for i, n in enumerate(LENS)]
    expected = {"MEAN": [r.mean(0) for r in rows], "CLS": [r[0] for r in rows], "LAST": [r[-1] for r in rows]}[pooling]
    torch.testing.assert_close(pooled, F.normalize(torch.stack(expected), dim=1), atol=1e-5, rtol=1e-5)


def test_cross_encoder_matches_transformers():
    torch.manual_seed(1)
    config = _config(architectures=["BertForSequenceClassification"], num_labels=1)
    ref = transformers.BertForSequenceClassification(config).eval()
    assert get_model_class(config) is BertForSequenceClassification
    model = BertForSequenceClassification(config)
    model.load_weights(ref.state_dict().items())
    ids, types = _batch(seed=2)
    input_ids, positions, token_types = _packed(ids, types)
    with torch.no_grad():
        logits = model.classify(model(input_ids, positions, LENS, token_types), LENS)
    assert logits.shape == (len(LENS), 1)
    torch.testing.assert_close(logits, _reference_hidden(ref, ids, types).logits, atol=1e-5, rtol=1e-5)


def test_load_weights_names_the_problem():
    config = _config(architectures=["BertModel"])
    state = transformers.BertModel(config).state_dict()
    model = BertModel(config)
    with pytest.raises(ValueError, match="missing.*word_embeddings"):
        model.load_weights((k, v) for k, v in state.items() if "word_embeddings" not in k)
    with pytest.raises(ValueError, match="unknown weight 'encoder.extra'"):
        model.load_weights([*state.items(), ("encoder.extra", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("embeddings.word_embeddings.weight", torch.zeros(3, 3))])


def test_pooler_rejects_unknown_type():
    with pytest.raises(ValueError, match="pooling_type"):
        Pooler("MAX")
