"""ServerSettings: CLI flags and TEXTGEN_* variables feed the same fields; bad configuration fails clearly."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import pytest
from server_tools import make_pki

from serve.api.config import ConfigError, ServerSettings, load_settings
from serve.api.loading import engine_settings, scheduler_limits
from serve.bundle import load_bundle
from serve.engine.runtime import create_session
from serve.process import freeze_startup_objects
from serve.scheduling.limits import DEFAULT_SWAP_SPACE, BatchingKnobs, SchedulerLimits


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TEXTGEN_"):
            monkeypatch.delenv(name)


def test_defaults(tmp_path: Path) -> None:
    settings = load_settings(["--bundle", str(tmp_path)])
    assert settings.bundle == tmp_path
    assert (settings.port, settings.metrics_port) == (50051, 8000)
    assert settings.log_prompts is False
    assert settings.auth_token is None and not settings.tls_enabled
    # As vLLM: a request without max_new_tokens may fill its context, and nothing caps one that asks.
    assert (settings.default_max_new_tokens, settings.max_new_tokens) == (None, None)


def test_the_batching_knobs_are_defined_once_for_the_flags_and_the_scheduler(tmp_path: Path) -> None:
    for name, knob in BatchingKnobs.model_fields.items():
        same = {repr(model.model_fields[name]) for model in (ServerSettings, SchedulerLimits)}
        assert same == {repr(knob)}, name
    flags = [
        "--max-padding-ratio",
        "0.5",
        "--max-queue",
        "3",
        "--stream-interval-ms",
        "20",
        "--max-batch-size",
        "4",
        "--scheduling-policy",
        "priority",
    ]
    settings = load_settings(["--bundle", str(tmp_path), *flags])
    limits = scheduler_limits(settings)
    assert limits.model_dump(include=set(BatchingKnobs.model_fields)) == settings.model_dump(
        include=set(BatchingKnobs.model_fields)
    )
    assert (limits.max_padding_ratio, limits.max_queue, limits.max_batch_size) == (0.5, 3, 4)
    assert limits.scheduling_policy == "priority"
    assert limits.stream_interval_seconds == pytest.approx(0.02)
    with pytest.raises(ConfigError, match="max_padding_ratio"):
        load_settings(["--bundle", str(tmp_path), "--max-padding-ratio", "1.5"])


def test_flags_and_environment_map_to_the_same_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEXTGEN_BUNDLE", str(tmp_path))
    monkeypatch.setenv("TEXTGEN_PORT", "6000")
    monkeypatch.setenv("TEXTGEN_PROVIDERS", "cuda, cpu")
    monkeypatch.setenv("TEXTGEN_MAX_BATCH_SIZE", "4")
    monkeypatch.setenv("TEXTGEN_LOG_LEVEL", "debug")
    from_env = load_settings([])
    assert (from_env.port, from_env.max_batch_size, from_env.log_level) == (6000, 4, "DEBUG")
    assert from_env.providers == ["cuda", "cpu"]
    # A flag wins over its variable.
    from_flags = load_settings(
        ["--port", "7000", "--providers", "cpu", "--log-prompts", "--max-batch-size", "2"]
    )
    assert (from_flags.port, from_flags.providers, from_flags.log_prompts) == (7000, ["cpu"], True)
    assert from_flags.max_batch_size == 2


def test_swap_space_is_an_amount_of_memory_from_the_flag_or_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = ["--bundle", str(tmp_path)]
    assert load_settings(bundle).swap_space == DEFAULT_SWAP_SPACE == 2**30
    assert scheduler_limits(load_settings([*bundle, "--swap-space", "2GiB"])).swap_space == 2 * 2**30
    assert load_settings([*bundle, "--swap-space", "0"]).swap_space == 0  # never preempt
    monkeypatch.setenv("TEXTGEN_SWAP_SPACE", "768")  # a bare number: MiB, as --kv-cache-memory
    assert scheduler_limits(load_settings(bundle)).swap_space == 768 * 2**20
    with pytest.raises(ConfigError, match=r"swap_space.*not an amount of memory"):
        load_settings([*bundle, "--swap-space", "lots"])


def test_auth_token_is_secret(tmp_path: Path) -> None:
    settings = load_settings(["--bundle", str(tmp_path), "--auth-token", "s3cret"])
    assert settings.auth_token is not None and settings.auth_token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(settings)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "port: Input should be less than or equal to 65535"),
        (["--metrics-port", "-1"], "metrics_port: Input should be greater than or equal to 0"),
        (["--max-batch-size", "0"], "max_batch_size"),
        (["--grace-seconds", "-1"], "grace_seconds"),
        (["--log-level", "chatty"], "log_level"),
        (["--scheduling-policy", "sjf"], "scheduling_policy: Input should be 'fcfs' or 'priority'"),
        (
            ["--max-new-tokens", "10", "--default-max-new-tokens", "11"],
            "default_max_new_tokens (11) must be <= max_new_tokens (10)",
        ),
        (["--tls-client-ca", "{cert}"], "tls_client_ca (mTLS) needs tls_cert and tls_key"),
        (["--tls-cert", "{cert}"], "tls_cert and tls_key must be given together"),
        (["--tls-cert", "{cert}", "--tls-key", "{cert}"], "are not a matching PEM certificate chain"),
        (["--tls-key", "/nonexistent/key.pem"], "tls_key: Path does not point to a file"),
        (["--auth-token", "  "], "auth_token must not be blank"),
    ],
)
def test_invalid_configuration_names_the_setting(tmp_path: Path, argv: list[str], message: str) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("pem")
    argv = [arg.format(cert=cert) for arg in argv]
    with pytest.raises(ConfigError, match="invalid configuration") as info:
        load_settings(["--bundle", str(tmp_path), *argv])
    assert message in str(info.value)


def test_missing_bundle_is_reported() -> None:
    with pytest.raises(ConfigError, match="bundle: Field required"):
        load_settings([])


def test_unknown_flag_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load_settings(["--bundle", "x", "--no-such-flag", "1"])
    assert info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_tls_files_are_loaded_and_checked(tmp_path: Path) -> None:
    files = make_pki().write(tmp_path)
    tls = ["--tls-cert", str(files["server_cert"]), "--tls-key", str(files["server_key"])]
    settings = load_settings(["--bundle", str(tmp_path), *tls, "--tls-client-ca", str(files["ca"])])
    assert settings.tls_enabled and settings.tls_client_ca == files["ca"]
    with pytest.raises(ConfigError, match="not a matching PEM certificate chain"):
        load_settings(
            [
                "--bundle",
                str(tmp_path),
                "--tls-cert",
                str(files["server_cert"]),
                "--tls-key",
                str(files["client_key"]),
            ]
        )
    with pytest.raises(ConfigError, match="is not a PEM CA certificate"):
        load_settings(["--bundle", str(tmp_path), *tls, "--tls-client-ca", str(files["server_key"])])


def test_other_textgen_variables_are_not_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # TEXTGEN_HOME belongs to the exporter; a shared prefix must not break the server's start.
    monkeypatch.setenv("TEXTGEN_HOME", str(tmp_path))
    assert load_settings(["--bundle", str(tmp_path)]).bundle == tmp_path


class _Node:
    def __init__(self) -> None:
        self.peer: _Node = self


def test_freezing_start_up_objects_collects_garbage_first() -> None:
    kept, lost = _Node(), _Node()
    gone = weakref.ref(lost)
    del lost  # a reference cycle: only the collector can reclaim it
    try:
        frozen = freeze_startup_objects()
        assert gone() is None, "garbage was frozen instead of collected"
        # Frozen objects still die when their last reference goes (a thread of an earlier test may drop
        # some meanwhile), so the count can only have shrunk since.
        assert frozen >= gc.get_freeze_count() > 1000
        assert not any(obj is kept for obj in gc.get_objects())  # out of the collector's reach
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(
    ("flags", "allow", "stop"),
    [([], "1", "1"), (["--no-spinning"], "0", None), (["--spin-between-steps"], "1", None)],
)
def test_the_spinning_flags_reach_the_onnx_runtime_session(
    tiny_bundle: Path, flags: list[str], allow: str, stop: str | None
) -> None:
    settings = load_settings(["--bundle", str(tiny_bundle), *flags])
    bundle = load_bundle(tiny_bundle)
    assert bundle.inplace_graph is not None
    options = create_session(bundle.inplace_graph, engine_settings(settings).session).get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == allow
    if stop is None:  # ONNX Runtime's default: threads spin on after a run until they give up
        with pytest.raises(RuntimeError, match="force_spinning_stop"):
            options.get_session_config_entry("session.force_spinning_stop")
    else:
        assert options.get_session_config_entry("session.force_spinning_stop") == stop
