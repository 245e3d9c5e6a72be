"""Sampling: llama.cpp's chain, reproducible from (seed, position) alone."""

import math

import pytest
import torch

from shardwire.sampling import GREEDY, SamplingParams, _candidates, sample


def logits(n=1000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_the_argmax():
    x = logits()
    assert sample(x, GREEDY, 5).token == int(x.argmax())


def test_same_seed_and_position_same_token_different_position_may_differ():
    x = logits()
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    assert sample(x, p, 10).token == sample(x.clone(), p, 10).token
    assert len({sample(x, p, i).token for i in range(50)}) > 5


def test_top_k_keeps_only_the_k_largest():
    x = logits()
    p = SamplingParams(temperature=5.0, top_k=3, top_p=1.0, min_p=0.0)
    allowed = set(torch.topk(x, 3).indices.tolist())
    assert {sample(x, SamplingParams(**{**p.to_dict(), "seed": s}), 0).token for s in range(200)} <= allowed


def test_top_p_keeps_the_smallest_nucleus():
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert sorted(_candidates(x, SamplingParams(top_k=0, top_p=0.7, min_p=0.0)).tolist()) == [0, 1]
    assert sorted(_candidates(x, SamplingParams(top_k=0, top_p=0.81, min_p=0.0)).tolist()) == [0, 1, 2]
    assert _candidates(x, SamplingParams(top_k=0, top_p=1.0, min_p=0.0)) is None


def test_top_p_over_a_large_vocabulary_matches_a_full_sort():
    x = logits(150_000, seed=3)
    for top_p in (0.3, 0.9, 0.999):
        ids = _candidates(x, SamplingParams(top_k=0, top_p=top_p, min_p=0.0))
        probs, order = torch.sort(torch.softmax(x, -1), descending=True)
        expected = int(torch.searchsorted(torch.cumsum(probs, 0), torch.tensor(top_p))) + 1
        assert len(ids) == expected and set(ids.tolist()) == set(order[:expected].tolist())


def test_min_p_drops_the_unlikely():
    x = torch.log(torch.tensor([0.6, 0.3, 0.06, 0.04]))
    assert sorted(_candidates(x, SamplingParams(top_k=0, top_p=1.0, min_p=0.2)).tolist()) == [0, 1]
    assert sorted(_candidates(x, SamplingParams(top_k=40, top_p=1.0, min_p=0.2)).tolist()) == [0, 1]


def test_repetition_penalty_and_frequency_penalty():
    x = torch.tensor([2.0, 1.9, -1.0])
    assert sample(x, GREEDY, 0, recent=[0]).token == 0  # no penalty configured
    p = SamplingParams(temperature=0.0, repeat_penalty=1.2)
    assert sample(x, p, 0, recent=[0]).token == 1
    p = SamplingParams(temperature=0.0, frequency_penalty=0.1)
    assert sample(x, p, 0, recent=[0, 0]).token == 1


def test_logprobs_are_log_softmax_of_the_raw_logits():
    x = logits()
    got = sample(x, SamplingParams(temperature=0.0, logprobs=3), 0)
    ref = torch.log_softmax(x, -1)
    assert math.isclose(got.logprob, float(ref[got.token]), rel_tol=1e-6)
    assert [t for t, _ in got.top] == torch.topk(ref, 3).indices.tolist()


@pytest.mark.parametrize(
    "bad", [dict(temperature=-1), dict(top_p=0), dict(min_p=2), dict(repeat_penalty=0), dict(logprobs=50)]
)
def test_bad_parameters_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
