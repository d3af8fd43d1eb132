"""The `nanopipe serve` flags are generated from the config fields: every flag sets one field,
every field has one flag, a command line round-trips to the same config, and a bad value is
a usage error that names the flag."""

from __future__ import annotations

import dataclasses

import pytest

from frontend.engine.config import EngineConfig
from frontend.engine.options import ConfigError, described_fields, to_argv
from frontend.engine.serve_flags import (
    DEVICE_FLAGS,
    HttpConfig,
    build_serve_parser,
    parse_serve_args,
)

CONFIGS = {"engine": EngineConfig, "http": HttpConfig}
MULTI_NODE = dict(nnodes=2, tensor_parallel_size=2, master_addr="10.0.0.8", master_port=29400,
                  cluster_key="/etc/nanopipe.key")
MULTI_NODE_FIELDS = ("nnodes", "node_rank", "master_addr", "master_port", "cluster_key")
"""The multi-host flags apply only together."""


def _flag_actions():
    parser = build_serve_parser()
    return [a for a in parser._actions if a.option_strings and a.dest not in ("help", "version")]


def test_every_flag_sets_one_field_and_every_field_has_one_flag():
    seen: dict[str, list[str]] = {}
    for action in _flag_actions():
        prefix, _, name = action.dest.partition(".")
        assert prefix in CONFIGS, f"{action.option_strings} sets no config field"
        assert name in {f.name for f in dataclasses.fields(CONFIGS[prefix])}, action.dest
        seen.setdefault(action.dest, []).extend(action.option_strings)
    for prefix, cls in CONFIGS.items():
        for f in dataclasses.fields(cls):
            assert f"{prefix}.{f.name}" in seen, f"{cls.__name__}.{f.name} has no flag"


def test_the_flags_users_know_are_still_there():
    flags = {s for a in _flag_actions() for s in a.option_strings}
    for flag in ("--model", "--tp", "--tensor-parallel-size", "--device", "--dtype",
                 "--max-model-len", "--block-size", "--max-num-seqs", "--max-num-batched-tokens",
                 "--gpu-memory-utilization", "--kv-cache-bytes", "--enforce-eager",
                 "--attention-backend", "--no-prefix-caching", "--no-overlap",
                 "--no-worker-lookahead", "--seed", "--zmq-transport", "--transport", "--zmq-host",
                 "--zmq-port", "--stdout", "--port", "--http", "--host", "--api-key",
                 "--served-model-name", "--max-request-bytes", "--log-level",
                 "--metrics-port", "--metrics-host"):
        assert flag in flags


def _other_value(f: dataclasses.Field, opt, typ):
    """A valid value of the field that is not its default."""
    if opt.choices is not None:
        return next(c for c in reversed(opt.choices) if c != f.default)
    if typ is bool:
        return not f.default
    if typ is int:
        if f.name == "block_size":
            return 4096  # a power of two
        if opt.maximum is None:
            return 4321
        return next(v for v in (int(opt.maximum) - 1, int(opt.maximum)) if v != f.default)
    if typ is float:
        return 0.5
    return "/some/model" if f.name == "model" else "10.0.0.7"


@pytest.mark.parametrize("prefix, name", [
    (p, f.name) for p, cls in CONFIGS.items() for f, _, _ in described_fields(cls)])
def test_each_field_round_trips_through_its_flag(prefix, name):
    cls = CONFIGS[prefix]
    f, opt, typ = next(d for d in described_fields(cls) if d[0].name == name)
    engine, http = EngineConfig(), HttpConfig()
    # Flags that apply only together with another one get it too.
    if prefix == "engine":
        extra = {"transport": "tcp"} if name in ("host", "port") else {}
        value = _other_value(f, opt, typ)
        if name in MULTI_NODE_FIELDS:
            extra = MULTI_NODE
            value = {"nnodes": 2, "node_rank": 1, "master_port": 29500}.get(name, value)
        if name in ("speculative", "draft_model"):  # a draft model goes with its choice
            extra = {"speculative": "draft", "draft_model": "/some/draft"}
            value = extra[name]
        if name in ("num_speculative_tokens", "ngram_size"):  # they tune the ngram proposer
            extra = {"speculative": "ngram"}
        if name in ("prefill_replicas", "decode_replicas", "kv_transfer_timeout", "kv_transfer"):
            extra = {"prefill_replicas": 1, "decode_replicas": 1}
        if name in DEVICE_FLAGS:  # read by one device only
            extra = {"device": DEVICE_FLAGS[name]}
        engine = EngineConfig(**{**extra, name: value})
    else:
        extra = {"port": 8000} if name in ("host", "api_key", "max_request_bytes") else {}
        extra = {"metrics_port": 9100} if name == "metrics_host" else extra
        http = HttpConfig(**{**extra, name: _other_value(f, opt, typ)})
    argv = to_argv(engine) + to_argv(http)
    assert argv, "a non-default value must show on the command line"
    parsed = parse_serve_args(argv)
    assert parsed.engine == engine and parsed.http == http


def test_no_flags_is_the_default_config_and_auto_is_none():
    parsed = parse_serve_args([])
    assert parsed.engine == EngineConfig() and parsed.http == HttpConfig()
    parsed = parse_serve_args(["--device", "auto", "--dtype", "auto"])
    assert parsed.engine.device is None and parsed.engine.dtype is None
    assert parse_serve_args(["/m"]).engine.model == "/m"


def test_help_shows_each_fields_own_default():
    parser = build_serve_parser()
    by_dest = {a.dest: a for a in _flag_actions()}
    for prefix, cls in CONFIGS.items():
        for f, opt, typ in described_fields(cls):
            text = by_dest[f"{prefix}.{f.name}"].help
            assert text.startswith(opt.help)
            if typ is not bool and f.default is not None:
                assert f"(default: {f.default})" in text
    assert "(default: 256)" in parser.format_help()  # max-num-seqs, as tests/front_door expect


@pytest.mark.parametrize("argv, expected", [
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be <= 1, got 1.5"),
    (["--startup-timeout-s", "0"], "--startup-timeout-s must be > 0"),
    (["--port", "0"], "--port must be in 1..65535, got 0"),
    (["--zmq-transport", "tcp", "--zmq-port", "99999"], "--zmq-port must be in 1..65535"),
    (["/m", "--model", "/n"], "either as MODEL or as --model"),
    (["--zmq-host", "0.0.0.0"], "--zmq-host applies to --zmq-transport tcp"),
    (["--no-http", "--max-request-bytes", "10"], "--max-request-bytes applies to the HTTP "
                                                 "API, which --no-http turns off"),
    (["--no-http", "--port", "8001"], "--port applies to the HTTP API"),
    (["--device", "cpu", "--enforce-eager"], "--enforce-eager applies to --device cuda"),
    (["--metrics-port", "70000"], "--metrics-port must be in 1..65535, got 70000"),
    (["--metrics-host", "::1"], "--metrics-host applies to --metrics-port"),
    (["--port", "8101", "--metrics-port", "8101"],
     "--metrics-port is the HTTP port, which serves /metrics already"),
    (["--num-speculative-tokens", "4"], "--num-speculative-tokens applies to --speculative "
                                        "ngram or draft"),
    (["--ngram-size", "5"], "--ngram-size applies to --speculative ngram"),
    (["--kv-transfer-timeout", "5"], "--kv-transfer-timeout applies to --prefill-replicas "
                                     "and --decode-replicas"),
    (["--speculative", "draft", "--draft-model", "/d", "--ngram-size", "5"],
     "--ngram-size applies to --speculative ngram"),
    (["--device", "cuda", "--block-size", "12"],
     "--block-size must be a power of two (the attention kernels tile blocks by it), got 12"),
    (["--device", "cpu", "--block-size", "3"],
     "--block-size must be a power of two (the attention kernels tile blocks by it), got 3"),
    (["--device", "cuda", "--attention-backend", "flash_attn", "--block-size", "128"],
     "--block-size must be a multiple of 256 for flash-attn, got 128"),
    (["--device", "cpu", "--attention-backend", "flash_attn"],
     "--attention-backend flash_attn needs cuda"),
])
def test_a_bad_flag_is_a_usage_error_naming_it(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_serve_args(argv)
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, expected", [
    ({"max_num_seqs": 0}, "EngineConfig.max_num_seqs must be >= 1"),
    ({"block_size": "16"}, "EngineConfig.block_size must be int, got '16'"),
    ({"enforce_eager": 1}, "EngineConfig.enforce_eager must be bool"),
    ({"device": "tpu"}, "EngineConfig.device must be one of 'auto', 'cpu', 'cuda', got 'tpu'"),
    ({"plans_ahead": "two"}, "EngineConfig.plans_ahead must be int or 'auto', got 'two'"),
    ({"attention_backend": "magic"}, "EngineConfig.attention_backend must be one of"),
    ({"kv_cache_bytes": -1}, "EngineConfig.kv_cache_bytes must be >= 1"),
    ({"device": "cuda", "block_size": 7}, "EngineConfig.block_size must be a power of two"),
    ({"seed": -1}, r"EngineConfig.seed must be in 0..9223372036854775807, got -1"),
    ({"seed": 2**64}, r"EngineConfig.seed must be in 0..9223372036854775807"),
])
def test_a_bad_keyword_argument_names_the_field(kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        EngineConfig(**kwargs)


def test_a_block_size_that_is_no_power_of_two_is_refused_on_every_device():
    """The torch references index blocks as the kernels do: a block size of 3 on the CPU was
    taken, and the first prompt longer than a block killed the worker."""
    for kwargs in (dict(device="cpu"), dict(device="cuda", attention_backend="torch"),
                   dict(device="cuda")):
        with pytest.raises(ConfigError, match="block_size must be a power of two"):
            EngineConfig(block_size=7, **kwargs)
    assert EngineConfig(device="cpu", block_size=8).block_size == 8
    assert EngineConfig(device="cuda", block_size=512, attention_backend="flash_attn")


def test_an_auto_word_means_what_it_means_on_the_command_line():
    """LLM(device="auto") is --device auto: the word stands for None, the default."""
    words = dict(device="auto", dtype="auto", plans_ahead="auto", speculative="off")
    given = EngineConfig(**words)
    assert all(getattr(given, name) is None for name in words)
    assert given == EngineConfig()


def test_llm_takes_the_engine_fields_and_refuses_others_before_starting():
    from frontend.engine.llm import LLM

    with pytest.raises(TypeError, match=r"unknown options \['max_num_seq'\].*max_num_seqs"):
        LLM("/no/model", max_num_seq=3)
    with pytest.raises(ValueError, match="EngineConfig.max_num_seqs must be >= 1"):
        LLM("/no/model", max_num_seqs=0)
