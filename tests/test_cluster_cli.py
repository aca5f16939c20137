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
    (["--replicas", "2", "--replica-resources", "{bad"], "--replica-resources must be JSON"),
    (["--replicas", "2", "--replica-resources", "[1]"], "must be a JSON object"),
    (["--replicas", "2", "--replica-resources", '{"CPU": 1}'], "'CPU' is not a custom resource"),
    (["--replicas", "2", "--replica-resources", '{"slot": 0}'], "'slot' must be a number > 0"),
    (["--replicas", "2", "--replica-resources", '{"slot": "1"}'], "'slot' must be a number > 0"),
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


def test_a_node_fits_a_replica_by_every_resource_it_asks_for() -> None:
    pytest.importorskip("ray")
    from kvcore.cluster.nodes import fits

    demand = {"CPU": 1.0, "GPU": 0.0, "kvcore_replica": 1.0}
    assert fits({"CPU": 2.0, "kvcore_replica": 1.0}, demand)
    assert not fits({"CPU": 2.0}, demand)  # no slot
    assert not fits({"CPU": 0.5, "kvcore_replica": 1.0}, demand)


def test_model_dir_problems_name_the_path(tmp_path: Path, tiny_model_dir: Path) -> None:
    pytest.importorskip("ray")
    from kvcore.cluster.nodes import model_dir_problem

    assert model_dir_problem(str(tiny_model_dir)) is None
    missing = tmp_path / "missing"
    assert model_dir_problem(str(missing)) == f"the model directory {missing} does not exist"
    assert model_dir_problem(str(tmp_path)) == f"the model directory {tmp_path} has no config.json"
