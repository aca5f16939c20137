"""`kvcore serve --replicas`: bad cluster options are one-line CLI errors before Ray starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcore.cli import main


@pytest.mark.parametrize(("flags", "message"), [
    (["--replicas", "0"], "replicas must be an integer >= 1"),
    (["--replicas", "2", "--min-replicas", "3"], "min_replicas <= replicas"),
    (["--replicas", "2", "--max-replicas", "1"], "replicas <= max_replicas"),
    (["--replicas", "2", "--cpus-per-replica", "0"], "cpus_per_replica must be > 0"),
    (["--replicas", "2", "--router-load-margin", "-1"], "load_margin must be"),
])
def test_bad_cluster_options_fail_fast(tiny_model_dir: Path, flags: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray.serve")
    # the server's JSON logging setup is process-wide: keep it out of the test process
    monkeypatch.setattr("kvcore.cli.serve.configure_logging", lambda: None)
    assert main(["serve", str(tiny_model_dir), "--device", "cpu", *flags]) == 2
    assert message in capsys.readouterr().err


def test_unknown_router_is_an_argparse_error(tiny_model_dir: Path) -> None:
    with pytest.raises(SystemExit):
        main(["serve", str(tiny_model_dir), "--replicas", "2", "--router", "random"])
