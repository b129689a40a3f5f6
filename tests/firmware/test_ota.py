"""Over the air, first part: the fleet's image catalogue (verified on upload) and a node-side
download that resumes with a range request after the connection is cut, then stages the image."""

from __future__ import annotations

import json
import socket
import threading
from urllib.parse import urlparse

import pytest

from firmware.ota import download
from tests.firmware.conftest import cli
from tests.fleet.conftest import TOKEN, broker, make_fleet  # noqa: F401 - fixtures

pytestmark = pytest.mark.mosquitto


@pytest.fixture
def image_fleet(make_fleet, tmp_path, fw_keys):  # noqa: F811
    return make_fleet(images_dir=str(tmp_path / "catalogue"), image_keys=[f"{fw_keys['k1']}.pub"])


def test_catalogue_verifies_uploads(image_fleet, fw_image, tmp_path):
    good = fw_image("1.0.0").read_bytes()
    r = image_fleet.post("/api/images", content=good)
    assert r.status_code == 201, r.text
    entry = r.json()
    assert (entry["version"], entry["artifact"], entry["size"]) == ("1.0.0", "digits-mlp", len(good))
    bad = bytearray(good)
    bad[-1] ^= 1
    for body, word in (
        (bytes(bad), "sha256"),
        (good[:-10], "truncated"),
        (b"hello", "not a fractal device image"),
        (fw_image("1.0.0", key="k2").read_bytes(), "trusted key"),
    ):
        r = image_fleet.post("/api/images", content=body)
        assert r.status_code == 400 and word in r.json()["error"], r.text
    assert [e["id"] for e in image_fleet.get("/api/images").json()["images"]] == [entry["id"]]
    assert (
        image_fleet.client.post(
            "/api/images", content=good, headers={"Authorization": "Bearer x"}
        ).status_code
        == 401
    )
    assert image_fleet.get("/api/images/nope").status_code == 404
    assert list((tmp_path / "catalogue").glob(".upload-*")) == []


class CuttingProxy:
    """TCP proxy that closes the FIRST connection after ``cut`` response-body bytes (a dropped link)."""

    def __init__(self, upstream: str | None, cut: int) -> None:
        self.up: tuple = ()
        if upstream is not None:
            self.forward_to(upstream)
        self.cut = cut
        self.body_bytes: list[int] = []  # response-body bytes relayed, per connection
        self.relays: list[threading.Thread] = []  # one per connection accepted
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def forward_to(self, upstream: str) -> None:
        u = urlparse(upstream)
        self.up = (u.hostname, u.port)

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            k = len(self.body_bytes)
            self.body_bytes.append(0)
            relay = threading.Thread(target=self._relay, args=(client, k), daemon=True)
            self.relays.append(relay)
            relay.start()

    def _relay(self, client: socket.socket, k: int) -> None:
        cut_this = k == 0
        with client, socket.create_connection(self.up) as up:
            req = b""
            while b"\r\n\r\n" not in req:
                req += client.recv(65536)
            up.sendall(req.replace(b"Connection: keep-alive", b"Connection: close"))
            head, body_started = b"", False
            while data := up.recv(65536):
                if not body_started:
                    head += data
                    if b"\r\n\r\n" not in head:
                        continue
                    hdr, data = head.split(b"\r\n\r\n", 1)
                    client.sendall(hdr + b"\r\n\r\n")
                    body_started = True
                if cut_this and self.body_bytes[k] + len(data) >= self.cut:
                    client.sendall(data[: self.cut - self.body_bytes[k]])
                    self.body_bytes[k] = self.cut
                    return  # drop the connection mid-body
                client.sendall(data)
                self.body_bytes[k] += len(data)

    def settled(self, timeout: float = 60.0) -> list[int]:
        """``body_bytes`` once every connection accepted so far has been relayed to its end. A relay
        counts a chunk after it sent it on: the client can hold the whole body (and its download
        return) before the relay thread added the last chunk."""
        for relay in list(self.relays):
            relay.join(timeout)
            assert not relay.is_alive(), "a relayed connection did not end"
        return self.body_bytes

    def close(self) -> None:
        self.sock.close()


def test_download_resumes_after_a_cut_and_stages_into_the_inactive_slot(
    image_fleet, fw_image, fw_keys, tmp_path
):
    img = fw_image("2.0.0")
    entry = image_fleet.post("/api/images", content=img.read_bytes()).json()
    size = entry["size"]
    proxy = CuttingProxy(image_fleet.url, cut=size // 3)
    try:
        url = f"{proxy.url}/api/images/{entry['id']}"
        stats = download(url, tmp_path / "got.img", token=TOKEN)
        assert (tmp_path / "got.img").read_bytes() == img.read_bytes()
        assert stats.requests == 2 and stats.resumed == 1
        assert stats.bytes_received == size  # nothing fetched twice
        assert proxy.settled() == [size // 3, size - size // 3]

        device = tmp_path / "dev"
        assert (
            cli(
                "image", "flash", fw_image("1.0.0"), "--device", device, "--pubkey", f"{fw_keys['k1']}.pub"
            ).returncode
            == 0
        )
        r = cli(
            "image",
            "stage",
            f"{image_fleet.url}/api/images/{entry['id']}",
            "--device",
            device,
            "--token",
            TOKEN,
        )
        assert r.returncode == 0 and "flashed version 2.0.0 into slot b" in r.stdout, r.stderr
        st = json.loads(cli("image", "status", "--device", device, "--json").stdout)
        assert st["active"] == "b" and st["slots"]["b"]["verified"] is True
        assert not list((device / "data" / "downloads").iterdir())
    finally:
        proxy.close()
