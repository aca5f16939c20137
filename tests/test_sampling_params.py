"""SamplingParams / BeamSearchParams validation: every bad value raises a ValueError naming it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvcore.sampling import BeamSearchParams, SamplingParams, TokenLogprob

BAD_SAMPLING: list[tuple[str, Any]] = [
    ("n", 0), ("n", 129), ("n", 1.5), ("n", True),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("temperature", -1.0), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", 101.0), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan),
    ("top_k", 0), ("top_k", -1), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.5),
    ("seed", 1.0), ("seed", 2**64),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", -3.0), ("frequency_penalty", math.inf),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.nan),
    ("stop", ("",)), ("stop", tuple(f"s{i}" for i in range(17))), ("stop", (3,)),
    ("stop_token_ids", (-1,)), ("stop_token_ids", ("a",)), ("stop_token_ids", "12"),
    ("ignore_eos", 1),
    ("logprobs", -1), ("logprobs", 21),
    ("include_stop_str_in_output", "yes"),
    ("skip_special_tokens", None),
]


@pytest.mark.parametrize(("name", "value"), BAD_SAMPLING)
def test_sampling_params_reject_bad_value_naming_it(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name) as err:
        SamplingParams(**{name: value})
    if not isinstance(value, tuple | str):
        assert repr(value) in str(err.value) or str(len(value)) in str(err.value)


def test_message_format() -> None:
    with pytest.raises(ValueError, match=r"temperature must be .*\[0.0, 100.0\], got -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)


@pytest.mark.parametrize("bias", [{-1: 1.0}, {"3": 1.0}, {3: 101.0}, {3: math.nan}, [(3, 1.0)]])
def test_logit_bias_rejected(bias: Any) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_valid_values_and_normalization() -> None:
    bias = {5: -100.0, 7: 2.5}
    p = SamplingParams(n=128, max_tokens=None, min_tokens=10, temperature=0.0, top_p=1e-3,
                       top_k=1, min_p=1.0, seed=-5, presence_penalty=-2.0,
                       frequency_penalty=2, repetition_penalty=1.3, logit_bias=bias,
                       stop=["a", "bc"], stop_token_ids=[1, 2], logprobs=20)
    assert p.stop == ("a", "bc") and p.stop_token_ids == (1, 2)
    bias[5] = 0.0  # the params hold their own copy
    assert p.logit_bias == {5: -100.0, 7: 2.5}
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(logprobs=0).logprobs == 0


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_k=2).greedy
    assert not SamplingParams().greedy


BAD_BEAM: list[tuple[str, Any]] = [
    ("beam_width", 0), ("beam_width", 129), ("beam_width", 2.0),
    ("max_tokens", 0), ("max_tokens", 1.5),  # None: until max_model_len, as SamplingParams
    ("length_penalty", math.nan), ("length_penalty", math.inf), ("length_penalty", "1"),
    ("early_stopping", "always"), ("early_stopping", 1), ("early_stopping", None),
    ("ignore_eos", "no"), ("stop_token_ids", (-2,)),
]


@pytest.mark.parametrize(("name", "value"), BAD_BEAM)
def test_beam_params_reject_bad_value_naming_it(name: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"beam_width": 2, "max_tokens": 8, name: value}
    with pytest.raises(ValueError, match=name):
        BeamSearchParams(**kwargs)


def test_beam_params_valid() -> None:
    for early in (True, False, "never"):
        p = BeamSearchParams(beam_width=4, max_tokens=3, length_penalty=-0.5,
                             early_stopping=early, stop_token_ids=[7])
        assert p.early_stopping == early and p.stop_token_ids == (7,)


def test_records_are_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]
    t = TokenLogprob(token_id=3, logprob=-0.5, top=((3, -0.5),))
    assert t.top[0] == (3, -0.5)
