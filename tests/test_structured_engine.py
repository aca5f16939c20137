"""Structured outputs in the engine: every output of the schema corpus validates (greedy,
seeded, n = 3, beams, under preemption, async scheduling on the fake device); regex and choice."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine_helpers import assert_pool_empty, make_engine, random_prompts, run_all
from fake_device import fake_engine
from kvcore.config import ParamError
from kvcore.engine import Engine
from kvcore.model.tokenizer import Tokenizer
from kvcore.sampling import BeamSearchParams, SamplingParams
from kvcore.sampling.constraints import Constraint, ConstraintCompiler
from structured_corpus import SCHEMAS

FORMATS = jsonschema.FormatChecker()
# A random-weight model has no reason to ever close a string or an object: a bias toward the
# closing characters makes its outputs end within a few dozen tokens. The mask alone decides
# which tokens are allowed; the bias only reorders the allowed ones (an e-mail address needs
# its "@" and ".").
CLOSERS = {'"': 9.0, "}": 6.0, "]": 6.0, ",": 3.0, "@": 5.0, ".": 4.0}


def closing_bias(tokenizer: Tokenizer) -> dict[int, float]:
    return {tokenizer.encode(c)[0]: bias for c, bias in CLOSERS.items()}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return make_engine(tiny_model_dir)


def _schema_params(schema: dict[str, Any], tokenizer: Tokenizer, **kw: Any) -> SamplingParams:
    kw.setdefault("max_tokens", 96)
    return SamplingParams(constraint=Constraint.json_schema(schema),
                          logit_bias=closing_bias(tokenizer), **kw)


def _assert_valid(schema: dict[str, Any], text: str, finish_reason: str | None) -> None:
    assert finish_reason == "stop", (text, finish_reason)
    jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0},
                                      {"temperature": 1.0, "seed": 7, "n": 3}])
def test_schema_corpus_validates(engine: Engine, sampling: dict[str, Any]) -> None:
    assert len(SCHEMAS) >= 30
    prompts = random_prompts(1, len(SCHEMAS))
    params = [_schema_params(schema, engine.tokenizer, **sampling) for _, schema in SCHEMAS]
    outputs = run_all(engine, prompts, params)
    for (name, schema), out in zip(SCHEMAS, outputs, strict=True):
        assert len(out.outputs) == sampling.get("n", 1), name
        for choice in out.outputs:
            _assert_valid(schema, choice.text, choice.finish_reason)
    assert_pool_empty(engine)


def test_schema_corpus_beams(engine: Engine) -> None:
    chosen = SCHEMAS[::4]
    for name, schema in chosen:
        params = BeamSearchParams(beam_width=3, max_tokens=48,
                                  constraint=Constraint.json_schema(schema))
        out = run_all(engine, random_prompts(2, 1), params)[0]
        assert out.outputs, name
        for beam in out.outputs:
            if beam.finish_reason == "stop" and beam.token_ids[-1] in engine.eos_token_ids:
                jsonschema.validate(json.loads(beam.text), schema, format_checker=FORMATS)
    assert_pool_empty(engine)


def test_schema_corpus_under_preemption(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_blocks=40, max_num_batched_tokens=64)
    prompts = random_prompts(3, len(SCHEMAS), low=10, high=30)
    params = [_schema_params(schema, engine.tokenizer, temperature=0.8, seed=i)
              for i, (_, schema) in enumerate(SCHEMAS)]
    outputs = run_all(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for (_, schema), out in zip(SCHEMAS, outputs, strict=True):
        _assert_valid(schema, out.outputs[0].text, out.outputs[0].finish_reason)
    assert_pool_empty(engine)


def test_async_scheduling_on_fake_device(tiny_model_dir: Path) -> None:
    """The fake device's logits depend on each row's whole history: the same outputs with async
    scheduling on and off, every one valid."""
    runs = []
    for on in (False, True):
        engine = fake_engine(tiny_model_dir, on, num_blocks=64)
        prompts = random_prompts(4, 12)
        params = [_schema_params(schema, engine.tokenizer, temperature=1.0, seed=i,
                                 ignore_eos=False) for i, (_, schema) in enumerate(SCHEMAS[:12])]
        outputs = run_all(engine, prompts, params)
        runs.append([(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs])
        for (_, schema), (text, reason) in zip(SCHEMAS[:12], runs[-1], strict=True):
            _assert_valid(schema, text, reason)
        assert_pool_empty(engine)
    assert runs[0] == runs[1]


def test_regex_and_choice(engine: Engine) -> None:
    pattern = r"[a-f]{2,5}-[0-9]{3}"
    choices = ["red", "green", "blue", "dark \"blue\""]
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, n=3,
                             constraint=Constraint("regex", pattern)) for s in range(4)]
    params += [SamplingParams(max_tokens=20, temperature=1.0, seed=s, n=3,
                              constraint=Constraint.choice(choices)) for s in range(4)]
    outputs = run_all(engine, random_prompts(5, len(params)), params)
    for out in outputs[:4]:
        for c in out.outputs:
            assert re.fullmatch(pattern, c.text) and c.finish_reason == "stop", c.text
    seen = set()
    for out in outputs[4:]:
        for c in out.outputs:
            assert c.text in choices and c.finish_reason == "stop", c.text
            seen.add(c.text)
    assert len(seen) > 1  # seeded sampling picks among the choices, not one forced answer


def test_lark_grammar(engine: Engine) -> None:
    grammar = 'start: "(" expr ")"\nexpr: NUM ("+" NUM)*\nNUM: /[1-9][0-9]?/'
    outputs = run_all(engine, random_prompts(6, 4),
                      SamplingParams(max_tokens=30, temperature=1.0, seed=3, logit_bias={
                          engine.tokenizer.encode(")")[0]: 4.0},
                          constraint=Constraint("grammar", grammar)))
    for out in outputs:
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", out.outputs[0].text)


def test_max_tokens_mid_object_ends_by_length(engine: Engine) -> None:
    schema = dict(SCHEMAS[2][1])
    out = run_all(engine, random_prompts(7, 1), SamplingParams(
        max_tokens=4, temperature=0.0, constraint=Constraint.json_schema(schema)))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 4
    assert_pool_empty(engine)


@pytest.mark.parametrize(("constraint", "message"), [
    (Constraint.json_schema({"type": "objekt"}, "response_format"), "objekt"),
    (Constraint("regex", "[0-9", "structured_outputs.regex"), "unclosed"),
    (Constraint("grammar", "start: missing_rule", "structured_outputs.grammar"), "missing_rule"),
])
def test_bad_constraint_is_a_param_error(engine: Engine, constraint: Constraint,
                                         message: str) -> None:
    with pytest.raises(ParamError) as info:
        engine.add_request("bad", [5, 6, 7], SamplingParams(constraint=constraint))
    assert info.value.param == constraint.param
    assert message in str(info.value)
    assert not engine.has_unfinished_requests()
    assert_pool_empty(engine)


def test_constraint_values_are_checked() -> None:
    with pytest.raises(ParamError, match="choice"):
        Constraint.choice([], "choice")
    with pytest.raises(ParamError, match="kind"):
        Constraint("xml", "<a/>")
    with pytest.raises(ParamError, match="constraint"):
        SamplingParams(constraint="json")  # type: ignore[arg-type]
    assert not SamplingParams(temperature=0.0,
                              constraint=Constraint("json_object")).argmax_only


def test_compile_is_bounded_and_cached(engine: Engine) -> None:
    """A grammar past llguidance's size bound is refused with its message (from the worker,
    naming the field); a compiled constraint is cached per cache salt, and the cache keeps the
    most recently used within its bytes."""
    schema = Constraint.json_schema(SCHEMAS[30][1], "response_format")
    small = ConstraintCompiler(engine.tokenizer.to_json, engine.model_config.vocab_size,
                               engine.eos_token_ids, max_grammar_size=20, num_workers=1)
    with pytest.raises(ParamError, match="response_format: .*size") as info:
        small.matcher(schema)
    assert info.value.param == "response_format"
    small.close()
    compiler = engine.constraints
    first = compiler.compile(Constraint("regex", "a+"), "t", "salt")
    assert compiler.compile(Constraint("regex", "a+"), "t", "salt") is first  # cached
    assert compiler.lookup(Constraint("regex", "a+"), "other salt") is None  # per salt
    assert first.num_bytes > 0 and compiler.cache.num_bytes >= first.num_bytes
    budget = first.num_bytes * 2 + first.num_bytes // 2  # room for two entries
    compiler.cache.__init__(budget, tenant_share=1.0)  # type: ignore[misc]
    for pattern in ("a+", "b+", "a+", "c+"):
        compiler.matcher(Constraint("regex", pattern))
    assert compiler.cache.num_bytes <= budget
    assert compiler.lookup(Constraint("regex", "b+")) is None  # least recently used: evicted
    assert compiler.lookup(Constraint("regex", "c+")) is not None


def test_constrained_rows_do_not_speculate_and_outputs_stay(tiny_model_dir: Path) -> None:
    """Speculation on: constrained rows never draft (their mask follows accepted tokens only),
    plain rows in the same batch still do, and every output equals speculation off."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
             "prompt_lookup_min": 1}
    spec = make_engine(tiny_model_dir, speculative_config=ngram)
    drafted: list[int] = []
    real = spec.scheduler.schedule

    def schedule(drafts: Any = None) -> Any:
        out = real(drafts)
        for item in out.scheduled:
            if item.num_draft_tokens:
                seq = spec.scheduler.seqs[item.seq_id]
                assert isinstance(seq.params, SamplingParams)
                assert seq.params.constraint is None, item.seq_id
                drafted.append(item.num_draft_tokens)
        return out
    spec.scheduler.schedule = schedule  # type: ignore[method-assign]
    schema = SCHEMAS[0][1]
    params = [SamplingParams(max_tokens=20, temperature=0.0, seed=1,
                             constraint=Constraint("regex", r"[a-f]{2,5}-[0-9]{3}")),
              _schema_params(schema, spec.tokenizer, temperature=0.7, seed=3),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.5, seed=9, ignore_eos=True)]
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]] * len(params)  # repetitive: drafts exist
    on = run_all(spec, prompts, params)
    off = run_all(make_engine(tiny_model_dir), prompts, params)
    assert [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in on] == \
        [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in off]
    assert re.fullmatch(r"[a-f]{2,5}-[0-9]{3}", on[0].outputs[0].text)
    _assert_valid(schema, on[1].outputs[0].text, on[1].outputs[0].finish_reason)
    assert drafted  # the plain rows did speculate
    assert_pool_empty(spec)
