"""Decoding over a KV cache computes what the training forward computes, and speculation
changes nothing in greedy output."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from wanka.config.schema import ModelConfig
from wanka.infer.cache import PAD_DOC, KVCache
from wanka.infer.generate import Generator
from wanka.infer.sampling import Sampling
from wanka.models.transformer import Transformer

# Untied output: with tied embeddings a random model mostly repeats its input token, and
# nothing would be tested.
CFG = ModelConfig(index_topk=16, max_seq_len=512, mtp_depth=1, tie_embeddings=False)


def constant_model() -> Transformer:
    """Logits that ignore the input (always token 7), main model and MTP alike: every draft is
    kept."""
    cfg = dataclasses.replace(CFG, n_layers=2)
    model = _model(cfg, seed=5)
    with torch.no_grad():
        bias = torch.zeros(256)
        bias[7] = 50.0
        model.norm.weight.zero_()
        model.mtp[0].norm.weight.zero_()
        model.output = torch.nn.Linear(cfg.dim, 256)
        model.output.weight.zero_()
        model.output.bias.copy_(bias)
    return model


def _model(cfg: ModelConfig = CFG, seed: int = 0, sharp: float = 1.0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    with torch.no_grad():  # a random model is nearly uniform: sharpen it so choices matter
        model.tok_embeddings.weight.mul_(sharp)
    return model.eval()


def _full_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    B, L = tokens.shape
    cache = KVCache(len(model.layers), B, tokens.device)
    pos = torch.arange(L).expand(B, L)
    docs = cache.set_docs(0, torch.zeros(B, L, dtype=torch.long))
    with torch.no_grad():
        return model.decode(tokens, pos, cache, 0, docs)[0]


@pytest.mark.parametrize("L", [12, 40])  # within k = 16 (dense) and past it (sparse)
def test_cached_logits_equal_the_training_forward(L):
    """The LM loss the training forward reports is the cross-entropy of the decode logits,
    and one token at a time over the cache gives the same logits as the whole prompt."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, L + 1), generator=g)
    inp, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(L).expand(2, L)
    with torch.no_grad():
        parts = model(inp, pos, torch.zeros_like(inp), labels)
    full = _full_logits(model, inp)
    ce = F.cross_entropy(full.reshape(-1, 256), labels.reshape(-1), reduction="sum")
    assert float(ce) == pytest.approx(float(parts.lm_sum), rel=1e-5)

    cache = KVCache(len(model.layers), 2, torch.device("cpu"), capacity=4)  # grows on the way
    steps = []
    with torch.no_grad():
        for t in range(L):
            docs = cache.set_docs(t, torch.zeros(2, 1, dtype=torch.long))
            steps.append(model.decode(inp[:, t : t + 1], pos[:, t : t + 1], cache, t, docs)[0])
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


def test_left_padding_does_not_change_a_row():
    """A short prompt batched with a long one (left-padded) decodes as it does alone."""
    model = _model(seed=3)
    long_p, short_p = list(range(30, 70)), [5, 6, 7, 8, 9]
    alone = Generator(model).generate([short_p], 30)[0]
    both = Generator(model).generate([long_p, short_p], 30)
    assert both[1] == alone and len(set(alone)) > 3


@pytest.mark.parametrize("speculate", [1, 2, 3])
def test_greedy_speculation_is_token_for_token_plain_greedy(speculate):
    """Prompts of different lengths, batch 3, generation crossing k (dense -> sparse): the
    accepted drafts, rejected tails, cache shifts and recursive MTP steps must not change a
    single token of greedy output."""
    model = _model(seed=2, sharp=4.0)
    prompts = [[1, 2, 3], list(range(40, 60)), [200] * 9]
    plain = Generator(model).generate(prompts, 40)
    gen = Generator(model, speculate=speculate)
    spec = gen.generate(prompts, 40)
    assert spec == plain
    assert all(len(r) == 40 and len(set(r)) > 3 for r in spec)
    s = gen.stats
    assert s.rounds > 0 and sum(s.drafted) == s.rounds * speculate


V_ORACLE = 64


def _successor(t: int) -> int:
    """The oracle model's next token: +1 within each half of the vocabulary."""
    half = V_ORACLE // 2
    return (t + 1) % half + (t // half) * half


def _oracle(max_seq_len: int = 512) -> Transformer:
    """The main model says _successor(t) after t (whatever came before); its MTP head drafts
    right after tokens of the lower half and wrong after the upper half, so a row of lower
    tokens keeps every draft while a row of upper tokens keeps none: rows move differently."""
    cfg = ModelConfig(vocab_size=V_ORACLE, n_layers=2, index_topk=8, max_seq_len=max_seq_len,
                      tie_embeddings=False, mtp_depth=1)  # fmt: skip
    model = _model(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        emb = torch.randn(V_ORACLE, cfg.dim, generator=g)  # dominates the residual stream
        model.tok_embeddings.weight.copy_(emb)
        before = {_successor(t): t for t in range(V_ORACLE)}
        unit = emb / emb.norm(dim=-1, keepdim=True)
        model.output.weight.copy_(4 * unit[[before[j] for j in range(V_ORACLE)]])
        half = V_ORACLE // 2
        # MTP: the next token's embedding x -> the embedding of x (lower half: its successor is
        # then drafted, right) or of x + 5 (upper half: a wrong draft).
        target = [x if x < half else half + (x - half + 5) % half for x in range(V_ORACLE)]
        normed = model.mtp[0].embed_norm(emb)
        m = normed[target].T @ torch.linalg.pinv(normed.T)
        model.mtp[0].proj.weight.zero_()
        model.mtp[0].proj.weight[:, cfg.dim :].copy_(m)
    return model


def _expected(prompt: list[int], n: int) -> list[int]:
    out, t = [], prompt[-1]
    for _ in range(n):
        t = _successor(t)
        out.append(t)
    return out


def test_rows_that_keep_different_numbers_of_drafts_stay_correct():
    """One row keeps every draft, one none, one finishes early (EOS): the cache moves rows
    right every round, and every row must still read only its own history."""
    model = _oracle()
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44, 45], [5, 6]]
    want = [_expected(p, 30) for p in prompts]
    assert Generator(model).generate(prompts, 30) == want  # the oracle works
    gen = Generator(model, speculate=3)
    assert gen.generate(prompts, 30) == want
    rate = gen.stats.acceptance_rate
    assert all(0.2 < r < 0.8 for r in rate), rate  # mixed: rows moved relative to each other
    eos = _expected(prompts[2], 4)[-1]
    out = Generator(model, speculate=3, eos=eos).generate(prompts, 30)
    assert out[2] == _expected(prompts[2], 4)


def test_a_finished_row_does_not_run_past_the_position_table():
    """A row that has finished stops moving; the others may use every position up to
    max_seq_len (here: 4 prompt + 56 new + 3 drafts = 63 < 64)."""
    model = _oracle(max_seq_len=64)
    prompts = [[0, 1, 2, 3], [40, 41]]
    eos = _expected(prompts[0], 1)[0]
    out = Generator(model, speculate=3, eos=eos).generate(prompts, 56)
    assert out[0] == [eos] and out[1] == _expected(prompts[1], 56)


def test_speculation_with_a_perfect_draft_accepts_everything():
    """When MTP drafts exactly what the model would say (here: a model whose MTP module is
    made to copy the main model on a repetitive prompt is hard; instead check the bookkeeping
    on the trained-like case of a constant prediction): every draft is accepted and each
    verify forward yields N + 1 tokens."""
    model = constant_model()
    gen = Generator(model, speculate=3)
    out = gen.generate([[1, 2, 3]], 17)[0]
    assert out == [7] * 17
    assert gen.stats.acceptance_rate == [1.0, 1.0, 1.0]
    assert gen.stats.mean_acceptance_length == 4.0


def test_eos_stops_a_row_and_max_tokens_cap():
    model = _model(seed=2, sharp=4.0)
    plain = Generator(model).generate([[1, 2, 3]], 30)[0]
    eos = plain[5]
    first = plain.index(eos)
    for spec in (0, 2):
        out = Generator(model, speculate=spec, eos=eos).generate([[1, 2, 3], [9, 9]], 30)
        assert out[0] == plain[: first + 1]
        assert len(out[1]) <= 30


def test_cache_keep_moves_short_rows_right():
    cache = KVCache(1, 2, torch.device("cpu"), capacity=8)
    k = torch.arange(2 * 5 * 1.0).view(2, 5, 1)
    cache.set_docs(0, torch.zeros(2, 5, dtype=torch.long))
    cache.layers[0].write(0, k, k, None)
    cache.keep(4, [0, 1])  # row 0 keeps slots 0-3; row 1 keeps 0-2, moved to 1-3
    kk = cache.layers[0].tensors[0]
    assert kk[0, :4, 0].tolist() == [0, 1, 2, 3]
    assert kk[1, 1:4, 0].tolist() == [5, 6, 7]
    assert cache.docs[1, :4].tolist() == [PAD_DOC, 0, 0, 0]
    assert cache.docs[:, 4:].eq(PAD_DOC).all()


def test_bad_requests_fail_in_one_line():
    model = _model()
    with pytest.raises(ValueError, match="max_seq_len"):
        Generator(model).generate([[1] * 500], 100)
    with pytest.raises(ValueError, match="at least one token"):
        Generator(model).generate([[]], 4)
    with pytest.raises(ValueError, match="mtp_depth = 0"):
        Generator(_model(dataclasses.replace(CFG, mtp_depth=0)), speculate=2)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=0.0)


def test_cpu_sparse_attention_decode_path_reads_only_selected_rows():
    """Inference with fewer selections than keys takes the gather path of the CPU backend:
    same result as the reference, empty slots ignored, and a non-finite key that no query
    selected changes nothing (one that is selected poisons only its own query)."""
    from wanka.ops.sparse_attention import cpu, reference

    g = torch.Generator().manual_seed(0)
    B, Lq, H, D, Lk, K = 2, 3, 4, 16, 200, 8
    q, k, v = (torch.randn(B, Lq, H, D, generator=g), torch.randn(B, Lk, D, generator=g),
               torch.randn(B, Lk, D, generator=g))  # fmt: skip
    idx = torch.randint(0, Lk - 1, (B, Lq, K), generator=g)
    idx[0, 1, 3:] = -1  # empty slots
    want = reference.sparse_attention(q, k, v, idx, 0.25)
    with torch.no_grad():
        got = cpu.sparse_attention(q, k, v, idx, 0.25)
    assert torch.allclose(got, want, atol=1e-5)
    k[1, Lk - 1] = float("nan")  # never selected (indices < Lk - 1)
    with torch.no_grad():
        assert torch.equal(cpu.sparse_attention(q, k, v, idx, 0.25), got)
        idx[1, 2, 0] = Lk - 1
        poisoned = cpu.sparse_attention(q, k, v, idx, 0.25)
    assert poisoned[1, 2].isnan().all() and not poisoned[1, :2].isnan().any()
    assert not poisoned[0].isnan().any()


@pytest.mark.parametrize("attention", ["mqa", "mla"])
@pytest.mark.parametrize("L", [12, 40])  # dense, and sparse with the main model's indices
def test_mtp_outputs_from_a_later_slot_equal_the_full_pass(attention, L):
    """mtp_decode(q_from=j) writes every slot's keys but computes outputs only from slot j
    on: those outputs and the whole cache equal the pass that computes every slot's."""
    cfg = dataclasses.replace(CFG, attention=attention)
    model = _model(cfg, seed=5)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 256, (2, L), generator=g)
    after = torch.randint(0, 256, (2, L), generator=g)
    pos = torch.arange(L).expand(2, L)
    outs, caches = [], []
    for q_from in (0, L - 3):
        cache = KVCache(len(model.layers) + 1, 2, torch.device("cpu"))
        docs = cache.set_docs(0, torch.zeros(2, L, dtype=torch.long))
        with torch.no_grad():
            _, hidden, indices = model.decode(tokens, pos, cache, 0, docs)
            outs.append(model.mtp_decode(1, hidden, after, pos, cache, 0, docs, indices, q_from))
        caches.append([t for t in cache.layers[-1].tensors if t is not None])
    (full_logits, full_h), (tail_logits, tail_h) = outs
    assert tail_logits.shape[1] == 3 and tail_h.shape[1] == 3
    torch.testing.assert_close(tail_logits, full_logits[:, -3:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail_h, full_h[:, -3:], rtol=1e-5, atol=1e-5)
    for a, b in zip(*caches, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("P", [12, 40])  # the main model dense, and sparse (base indices)
def test_mtp_entries_of_rows_with_different_last_slots(P):
    """Generator._mtp_entries computes outputs only from the earliest row's last slot on; each
    row's draft logits, hidden state and main-model selection must be those of a pass that
    computes every slot."""
    model = _model(seed=7)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (P,), generator=g).tolist(),
               torch.randint(0, 256, (P - 5,), generator=g).tolist()]  # fmt: skip
    after = torch.randint(0, 256, (2, P), generator=g)
    last = torch.tensor([P - 1, P - 4])  # row 1 keeps fewer slots
    got, want = [], []
    for q_from_all in (False, True):
        gen = Generator(model, speculate=2)
        gen.max_new = 8
        with torch.no_grad():
            cache, _, _, hidden, indices = gen._prefill(prompts, n_mtp=1)
            positions = gen._prompt_positions
            if q_from_all:
                docs = cache.docs[:, :P]
                logits, h = model.mtp_decode(1, hidden, after, positions, cache, 0, docs, indices)
                rows = torch.arange(2)
                base = indices[rows, last][:, None] if indices is not None else None
                want = [logits[rows, last][:, None], h[rows, last][:, None], base]
            else:
                got = list(gen._mtp_entries(cache, 0, hidden, after, positions, indices, last))
    assert (got[2] is None) == (want[2] is None) == (P <= CFG.index_topk)
    for a, b in zip(got, want, strict=True):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["mqa", "mla"])
# Dense; sparse past k = 16, where t = 13 .. 15 still see all their keys (n_t <= k) and the
# decoder's steps run dense while the training rows are sparse.
@pytest.mark.parametrize("L, ts", [(12, [3, 7]), (40, [13, 14, 15, 20, 33])])
def test_trained_recursive_drafts_are_the_decoders_draft_steps(monkeypatch, attention, L, ts):
    """`wanka draft`'s training-time test (Transformer._recursive_drafts) must compute, at every
    position t at once, exactly the distributions the decoder's draft steps 1..3 give after a
    prompt ending at t when the drafts are the text's own next tokens: same inputs, positions,
    cache contents (first-pass keys up to t, earlier steps' keys) and sparse selection."""
    cfg = dataclasses.replace(CFG, attention=attention)
    model = _model(cfg, seed=5)
    with torch.no_grad():  # sharp attention scores, so that positions and key sets matter
        for w in model.mtp[0].block.attention.parameters():
            w.mul_(4.0 if w.dim() == 2 else 1.0)
    tokens = torch.randint(0, 256, (1, L), generator=torch.Generator().manual_seed(2))
    labels = F.pad(tokens[:, 1:], (0, 1), value=-100)
    seen = []  # the MTP head's inputs: the first pass, then steps 2 and 3
    hook = model.mtp[0].norm.register_forward_hook(lambda _m, _i, out: seen.append(out))
    with torch.no_grad():
        parts = model(tokens, torch.arange(L)[None], torch.zeros_like(tokens), labels,
                      mtp_self=True, draft_steps=3)  # fmt: skip
    hook.remove()
    assert len(seen) == 3 and len(parts.draft_kl) == 2
    assert [int(c) for _, c in parts.draft_kl] == [L - 3, L - 4]  # t + s + 1 still in the row
    trained = [torch.softmax(model._logits(x), -1) for x in seen]

    import wanka.infer.generate as generate

    for t in ts:
        forced = iter([int(tokens[0, t + 2]), int(tokens[0, t + 3]), 0])
        monkeypatch.setattr(generate, "draw", lambda q, gen, it=forced: torch.tensor([next(it)]))
        gen = Generator(model, Sampling(1.0), speculate=3)
        gen.max_new = 8
        with torch.no_grad():
            cache, pos, _, hidden, indices = gen._prefill([tokens[0, : t + 1].tolist()], n_mtp=1)
            first = gen._mtp_entries(cache, 0, hidden, tokens[:, 1 : t + 2],
                                     gen._prompt_positions, indices, torch.tensor([t]))  # fmt: skip
            _, probs = gen._draft(cache, t + 1, pos, first)
        for j in range(3):
            torch.testing.assert_close(probs[0, j], trained[j][0, t], rtol=1e-5, atol=1e-6)


def test_rows_shorter_than_the_draft_steps_score_nothing_and_keep_the_graph():
    """draft_steps past the row length: those steps count 0 positions, no shape error, and
    their (zero) loss still reaches the MTP block (every FSDP rank runs the same backward)."""
    model = _model(seed=1)
    tokens = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(0))
    labels = F.pad(tokens[:, 1:], (0, 1), value=-100)
    parts = model.train()(tokens, torch.arange(3).expand(2, 3), torch.zeros_like(tokens),
                          labels, mtp_self=True, draft_steps=5)  # fmt: skip
    assert [int(c) for _, c in parts.draft_kl] == [0, 0, 0, 0]
    assert int(parts.mtp_count) == 2 * 1  # t = 0 only: the label at t + 1 = 1 exists
    total = parts.mtp_sum + sum(x for x, _ in parts.draft_kl)
    assert all(x.requires_grad for x, _ in parts.draft_kl)
    total.backward()
    assert model.mtp[0].proj.weight.grad is not None


def test_ids_the_tokenizer_cannot_decode_are_never_chosen():
    """A model whose vocab_size was rounded up past its tokenizer's (training suggests it)
    chose ids the tokenizer cannot decode: `wanka generate` crashed mid-stream (byte
    tokenizer) or dropped them silently (HF). With the tokenizer's size given, greedy,
    sampled and speculative decoding keep below it."""
    model = constant_model()
    with torch.no_grad():
        model.output.bias.zero_()
        model.output.bias[200] = 50.0  # the model's favourite: past a 128-token tokenizer
        model.output.bias[:128] = torch.linspace(0, 5, 128)
    prompt = [[1, 2, 3]]
    assert Generator(model).generate(prompt, 4)[0] == [200] * 4  # what it would choose
    for sampling, speculate in ((Sampling(), 0), (Sampling(0.9, 0.95), 0), (Sampling(), 2),
                                (Sampling(1.2), 2)):  # fmt: skip
        out = Generator(model, sampling, speculate, seed=3, vocab=128).generate(prompt, 6)[0]
        assert out and max(out) < 128, (sampling, speculate, out)


def test_a_temperature_or_top_p_below_float32_range_is_greedy_not_a_crash():
    """--temperature 1e-300 and --top-p 1e-300 are 0 in fp32: 0/0 at the argmax, or every
    token cut; torch.multinomial then raised "probability tensor contains inf, nan"."""
    from wanka.infer.sampling import probabilities

    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    greedy = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    for s in (Sampling(1e-300), Sampling(1e-40), Sampling(1.0, 1e-300), Sampling(0.7, 1e-300)):
        assert torch.equal(probabilities(logits, s), greedy), s
