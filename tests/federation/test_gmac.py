"""federation/_gmac.c: AES-256-GMAC on a reusable OpenSSL context for ring frames (issue 12's
signing cost). Built by ``pip install -e .`` (setup.py); these tests fail, not skip, when it is not
built, because CI installs what it needs (OpenSSL's headers: deploy/install-system-deps.sh)."""

from __future__ import annotations

import os
import struct

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from federation._gmac import Gmac, ghash, use_clmul

from federation import ringmac

_NONCE = struct.Struct("<QI")


def _cpu_has_clmul_path() -> bool:
    flags: set[str] = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {"avx512f", "avx512bw", "avx512vl", "vpclmulqdq", "pclmulqdq"} <= flags


@pytest.fixture(autouse=True, params=["clmul", "openssl"])
def ghash_path(request):
    """Every test here runs on both GHASH implementations of the module (where the CPU has the
    VPCLMULQDQ one: else both runs take OpenSSL's)."""
    before = ghash() != "openssl"
    use_clmul(request.param == "clmul")
    yield request.param
    use_clmul(before)


def test_the_clmul_path_is_used_wherever_the_cpu_has_it(ghash_path):
    # the import default: on, unless FRACTAL_GHASH=openssl (this suite does not set it)
    expect = "vpclmulqdq-avx512" if ghash_path == "clmul" and _cpu_has_clmul_path() else "openssl"
    assert ghash() == expect
    assert os.environ.get("FRACTAL_GHASH") is None


def _reference(key: bytes, data: bytes, seq: int, epoch: int) -> bytes:
    return AESGCM(key).encrypt(_NONCE.pack(seq, epoch & 0xFFFFFFFF), b"", data)


def test_the_built_module_is_what_ring_frames_use():
    assert ringmac.gmac_backend() == "openssl-context"


def test_known_answer_gcm_spec_test_case_13():
    # McGrew & Viega, "The Galois/Counter Mode of Operation", test case 13: 256-bit zero key,
    # zero IV, no plaintext, no associated data.
    buf = bytearray(16)
    Gmac(bytes(32)).seal(buf, 0, 0, 0)
    assert buf.hex() == "530f8afbc74536b9a963b4f1c4cb738b"


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 255, 511, 512, 513, 4096, 18546, 262144 + 3])
def test_tags_equal_cryptographys_aesgcm(size):
    key = os.urandom(32)
    g = Gmac(key)
    for seq, epoch in ((0, 0), (1_800_000_000_123_456, 0xDEADBEEFCAFE), (2**64 - 1, 2**64 - 1)):
        data = os.urandom(size)
        buf = bytearray(data) + bytearray(16)
        g.seal(buf, size, seq, epoch)
        assert bytes(buf[size:]) == _reference(key, data, seq, epoch)
        # verify reads the nonce from the buffer (ringmac's footer carries it before the tag)
        framed = data + _NONCE.pack(seq, epoch & 0xFFFFFFFF) + _reference(key, data + _NONCE.pack(
            seq, epoch & 0xFFFFFFFF), seq, epoch)
        assert g.verify(framed, size + 12, size) is True
        assert g.verify(memoryview(framed), size + 12, size) is True
        assert g.verify(bytearray(framed), size + 12, size) is True


def test_verify_refuses_every_changed_byte_wrong_nonce_and_wrong_key():
    key = os.urandom(32)
    g = Gmac(key)
    body = os.urandom(300)
    nonce = _NONCE.pack(42, 7)
    framed = body + nonce + _reference(key, body + nonce, 42, 7)
    end = len(body) + 12
    assert g.verify(framed, end, len(body))
    for i in range(len(framed)):
        bad = bytearray(framed)
        bad[i] ^= 0x01
        assert not g.verify(bytes(bad), end, len(body)), i
    assert not g.verify(framed, end, 0)  # another nonce
    assert not Gmac(os.urandom(32)).verify(framed, end, len(body))


def test_one_object_serves_many_calls_and_keys_stay_apart():
    k1, k2 = os.urandom(32), os.urandom(32)
    g1, g2 = Gmac(k1), Gmac(k2)
    data = os.urandom(1000)
    for seq in range(50):  # the context is re-keyed with a new nonce per call, never re-created
        b1, b2 = bytearray(data) + bytearray(16), bytearray(data) + bytearray(16)
        g1.seal(b1, 1000, seq, 9)
        g2.seal(b2, 1000, seq, 9)
        assert bytes(b1[1000:]) == _reference(k1, data, seq, 9)
        assert bytes(b2[1000:]) == _reference(k2, data, seq, 9)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="32 bytes"):
        Gmac(bytes(16))
    with pytest.raises(TypeError):
        Gmac("k" * 32)
    g = Gmac(bytes(32))
    with pytest.raises(ValueError, match="no room"):
        g.seal(bytearray(20), 5, 0, 0)  # 5 + 16 > 20
    with pytest.raises(ValueError, match=">= 0"):
        g.seal(bytearray(20), -1, 0, 0)
    with pytest.raises(BufferError):
        g.seal(bytes(32), 0, 0, 0)  # read-only buffer: nowhere to write the tag
    with pytest.raises(OverflowError):
        g.seal(bytearray(32), 0, -1, 0)
    with pytest.raises(OverflowError):
        g.seal(bytearray(32), 0, 2**64, 0)
    with pytest.raises(ValueError, match="outside"):
        g.verify(bytes(20), 10, 0)
    with pytest.raises(ValueError, match="outside"):
        g.verify(bytes(40), 0, 30)
    with pytest.raises(TypeError, match="3 arguments"):
        g.verify(bytes(40), 0)
    with pytest.raises(ValueError, match="not initialised"):
        Gmac.__new__(Gmac).seal(bytearray(32), 0, 0, 0)


def test_fallback_backend_gives_the_same_tags():
    key = os.urandom(32)
    data = os.urandom(777)
    a, b = bytearray(data) + bytearray(16), bytearray(data) + bytearray(16)
    Gmac(key).seal(a, 777, 5, 2**40 + 3)
    ringmac._AesGcmMac(key).seal(b, 777, 5, 2**40 + 3)
    assert a == b
    framed = bytes(data) + _NONCE.pack(5, 3) + _reference(key, bytes(data) + _NONCE.pack(5, 3), 5, 3)
    assert ringmac._AesGcmMac(key).verify(framed, 789, 777) and Gmac(key).verify(framed, 789, 777)
    assert not ringmac._AesGcmMac(key).verify(framed[:-1] + b"\x00", 789, 777)


def test_every_length_around_the_block_and_group_sizes():
    # the CLMUL path hashes 512-byte groups, then single blocks, then a partial block: every
    # remainder of each, and random frames up to 70 KB
    key = os.urandom(32)
    g = Gmac(key)
    rng = __import__("random").Random(5)
    for size in [*range(0, 1100), *(rng.randrange(1100, 70_000) for _ in range(40))]:
        data = rng.randbytes(size)
        buf = bytearray(data) + bytearray(16)
        g.seal(buf, size, size, 3)
        assert bytes(buf[size:]) == _reference(key, data, size, 3), size


def test_initialising_again_takes_the_new_key():
    k1, k2 = os.urandom(32), os.urandom(32)
    g = Gmac(k1)
    g.__init__(k2)
    buf = bytearray(600) + bytearray(16)
    g.seal(buf, 600, 1, 1)
    assert bytes(buf[600:]) == _reference(k2, bytes(600), 1, 1)


def test_with_the_clmul_ghash_frames_of_every_size_take_the_module(ghash_path, monkeypatch):
    """The VPCLMULQDQ GHASH is as fast as AESGCM for large frames and has no per-call context
    copy, so ringmac then seals and opens frames of any size in the module; with OpenSSL's GHASH
    frames over ringmac._SMALL go to AESGCM (its bundled OpenSSL hashes them faster)."""
    import sys

    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from federation import framing, topics
    from federation.auth import KeyEntry, Keyring, Role, Signer, Verifier, generate_key

    ids = ["a", "b"]
    ed = {m: generate_key() for m in ids}
    dh = {m: X25519PrivateKey.generate() for m in ids}
    ring = Keyring([KeyEntry(f"{m}-k", m, Role.NODE, ed[m].public_key(), dh[m].public_key()) for m in ids])
    m = {i: ringmac.RingMac(Signer(i, f"{i}-k", ed[i]), dh[i], Verifier(ring), "sw") for i in ids}
    clmul = ghash() != "openssl"
    assert m["a"]._small == (sys.maxsize if clmul else ringmac._SMALL)
    to_b = topics.allreduce("sw", "b")
    room = ringmac.room_for("a", topics.allreduce("sw", ""))
    body = os.urandom(300_000)
    used: list[str] = []
    real = ringmac._py_open_frame

    def spy(*args, **kw):
        used.append("python")
        return real(*args, **kw)

    monkeypatch.setattr(ringmac, "_py_open_frame", spy)
    frame = framing.encode(framing.FrameKind.DATA, framing.Phase.EXCHANGE, swarm="sw", tag="t", sender="a",
                           count=len(body), total=len(body), payload=[body], crc=False, room=room)
    env = bytes(m["a"].seal_into(to_b, bytearray(frame), room))
    sender, payload = m["b"].open(to_b, env)
    assert sender == "a" and bytes(payload) == bytes(frame[:len(frame) - room])
    assert used == ([] if clmul else ["python"])
