/* AES-256-GMAC for ring frames (federation/ringmac.py), without the per-call overhead.
 *
 * The same tag as cryptography's AESGCM(key).encrypt(nonce, b"", data) -- AES-GCM with an empty
 * plaintext, the whole frame as associated data -- computed by OpenSSL's EVP interface, but on
 * one cipher context per key that lives as long as the object: no context allocated, copied and
 * freed per frame, no Python objects built for the nonce or the tag, and the GIL kept (a 19 KB
 * frame takes ~2.5 us of GHASH with the system's OpenSSL: too short to be worth handing the GIL
 * to another thread and queueing for it again). Measured in a 4-node swarm's node processes
 * (BENCHMARKS.md, "Session 11"): ~11-18 us per AESGCM call there against ~3 us in a hot loop.
 * Frames over 32 KiB do not come here (ringmac._SMALL): cryptography's bundled OpenSSL hashes
 * ~2.5x faster per byte, which outweighs its per-call cost for large frames.
 *
 *   Gmac(key: 32 bytes)
 *   .seal(buf: writable buffer, end: int, seq: int, epoch: int) -> None
 *        writes the 16-byte tag over buf[:end] at buf[end:end + 16]; the nonce is the 12 bytes
 *        seq (u64 LE) || low 32 bits of epoch (u32 LE), as ringmac's envelope carries them.
 *   .verify(data: buffer, end: int, nonce_at: int) -> bool
 *        whether data[end:end + 16] is the tag of data[:end] under the nonce data[nonce_at:
 *        nonce_at + 12] (compared in constant time).
 *
 * Two helpers do the rest of ringmac's per-frame work in one call each (in a busy node process
 * the Python they replace cost several times its hot-loop time, more than the MAC itself):
 *
 *   seal_frame(mac, buf, body, room, ids, slen, seq, epoch) -> None
 *        fills buf[body:] (``room`` bytes): zero pad, ids (sender + topic), the footer and the tag
 *        (ringmac's version-3 trailer); len(buf) must be body + room.
 *   open_frame(table, data: bytes, topic: str) -> (sender, seq, epoch, body) | None
 *        the fast path of RingMac.open: parses the trailer, finds (topic, sender, sender_bytes,
 *        mac, ...) under the ids in ``table`` (a dict), checks topic, lengths, version, the tag and the
 *        sender the frame's header names. None: anything else (unknown ids, bad tag, malformed,
 *        another named sender), for ringmac's Python path to judge, count and name. Replay and
 *        freshness stay in Python (federation/auth.py's Verifier.admit).
 *
 * Thread safety: every call holds the GIL from start to end, so calls on one object never
 * overlap. Built by setup.py as federation._gmac (optional: ringmac falls back to cryptography's
 * AESGCM, bit-identical, where it is not built).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>

#define TAG_LEN 16
#define NONCE_LEN 12
#define KEY_LEN 32

typedef struct {
    PyObject_HEAD
    EVP_CIPHER_CTX *ctx;
} Gmac;

static PyTypeObject GmacType;

static int gmac_tag(Gmac *self, const unsigned char *nonce, const unsigned char *data, Py_ssize_t len,
                    unsigned char *tag) {
    int outl = 0;
    unsigned char none[1];
    if (EVP_EncryptInit_ex(self->ctx, NULL, NULL, NULL, nonce) != 1)
        return 0;
    while (len > 0) { /* EVP takes int lengths */
        int chunk = len > (1 << 30) ? (1 << 30) : (int)len;
        if (EVP_EncryptUpdate(self->ctx, NULL, &outl, data, chunk) != 1)
            return 0;
        data += chunk;
        len -= chunk;
    }
    if (EVP_EncryptFinal_ex(self->ctx, none, &outl) != 1)
        return 0;
    return EVP_CIPHER_CTX_ctrl(self->ctx, EVP_CTRL_GCM_GET_TAG, TAG_LEN, tag) == 1;
}

static int gmac_init(PyObject *op, PyObject *args, PyObject *kwds) {
    Gmac *self = (Gmac *)op;
    Py_buffer key;
    int ok;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "Gmac() takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "y*:Gmac", &key))
        return -1;
    if (key.len != KEY_LEN) {
        PyBuffer_Release(&key);
        PyErr_Format(PyExc_ValueError, "Gmac key must be %d bytes, not %zd", KEY_LEN, key.len);
        return -1;
    }
    if (self->ctx == NULL)
        self->ctx = EVP_CIPHER_CTX_new();
    ok = self->ctx != NULL && EVP_EncryptInit_ex(self->ctx, EVP_aes_256_gcm(), NULL, key.buf, NULL) == 1;
    PyBuffer_Release(&key);
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL could not set up AES-256-GCM");
        return -1;
    }
    return 0;
}

static void gmac_dealloc(PyObject *op) {
    Gmac *self = (Gmac *)op;
    if (self->ctx != NULL)
        EVP_CIPHER_CTX_free(self->ctx); /* clears the key schedule */
    Py_TYPE(op)->tp_free(op);
}

static int index_arg(PyObject *arg, const char *what, Py_ssize_t *out) {
    *out = PyLong_AsSsize_t(arg);
    if (*out == -1 && PyErr_Occurred())
        return 0;
    if (*out < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 0", what);
        return 0;
    }
    return 1;
}

static int ready(Gmac *self) {
    if (self->ctx == NULL) {
        PyErr_SetString(PyExc_ValueError, "Gmac object not initialised");
        return 0;
    }
    return 1;
}

static void put_le(unsigned char *p, unsigned long long v, int n) {
    for (int i = 0; i < n; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static unsigned long long get_le(const unsigned char *p, int n) {
    unsigned long long v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static int u64_arg(PyObject *arg, unsigned long long *out) {
    *out = PyLong_AsUnsignedLongLong(arg);
    return !(*out == (unsigned long long)-1 && PyErr_Occurred());
}

static PyObject *gmac_seal(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    Gmac *self = (Gmac *)op;
    Py_buffer buf;
    Py_ssize_t end;
    unsigned long long seq, epoch;
    unsigned char nonce[NONCE_LEN];
    int ok;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "seal(buf, end, seq, epoch) takes 4 arguments");
        return NULL;
    }
    if (!ready(self) || !index_arg(args[1], "end", &end) || !u64_arg(args[2], &seq) || !u64_arg(args[3], &epoch))
        return NULL;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_WRITABLE) != 0)
        return NULL;
    if (end > buf.len - TAG_LEN) {
        PyBuffer_Release(&buf);
        PyErr_Format(PyExc_ValueError, "no room for a tag after %zd of %zd bytes", end, buf.len);
        return NULL;
    }
    put_le(nonce, seq, 8);
    put_le(nonce + 8, epoch, 4); /* low 32 bits */
    ok = gmac_tag(self, nonce, buf.buf, end, (unsigned char *)buf.buf + end);
    PyBuffer_Release(&buf);
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL failed to compute a GMAC");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *gmac_verify(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    Gmac *self = (Gmac *)op;
    Py_buffer data;
    Py_ssize_t end, nonce_at;
    unsigned char tag[TAG_LEN];
    int ok;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "verify(data, end, nonce_at) takes 3 arguments");
        return NULL;
    }
    if (!ready(self) || !index_arg(args[1], "end", &end) || !index_arg(args[2], "nonce_at", &nonce_at))
        return NULL;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) != 0)
        return NULL;
    if (end > data.len - TAG_LEN || nonce_at > data.len - NONCE_LEN) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "tag or nonce outside the %zd-byte buffer", data.len);
        return NULL;
    }
    ok = gmac_tag(self, (const unsigned char *)data.buf + nonce_at, data.buf, end, tag);
    if (ok)
        ok = CRYPTO_memcmp(tag, (const unsigned char *)data.buf + end, TAG_LEN) == 0 ? 1 : 2;
    PyBuffer_Release(&data);
    OPENSSL_cleanse(tag, sizeof tag);
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL failed to compute a GMAC");
        return NULL;
    }
    return PyBool_FromLong(ok == 1);
}

/* ringmac's version-3 trailer (federation/ringmac.py): [pad][ids = sender + topic][footer][tag],
 * footer = seq u64, epoch u64, sender_len u8, topic_len u16, pad_len u16, version u8, "FM". */
#define FOOT_LEN 24
#define TAIL_LEN (FOOT_LEN + TAG_LEN)
#define RING_VERSION 3
/* federation/framing.py: a frame starts with "FE"; bytes 44, 45, 46 are the swarm, tag and
 * sender id lengths; the ids follow the 47-byte header in that order. */
#define FRAME_HEADER 47

static PyObject *seal_frame(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf, ids;
    Py_ssize_t body, room, slen, pad;
    unsigned long long seq, epoch;
    unsigned char *p;
    int ok;
    (void)module;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "seal_frame(mac, buf, body, room, ids, slen, seq, epoch) takes 8 arguments");
        return NULL;
    }
    if (!PyObject_TypeCheck(args[0], &GmacType)) {
        PyErr_SetString(PyExc_TypeError, "seal_frame: mac must be a Gmac");
        return NULL;
    }
    if (!ready((Gmac *)args[0]) || !index_arg(args[2], "body", &body) || !index_arg(args[3], "room", &room) ||
        !index_arg(args[5], "slen", &slen) || !u64_arg(args[6], &seq) || !u64_arg(args[7], &epoch))
        return NULL;
    if (PyObject_GetBuffer(args[4], &ids, PyBUF_SIMPLE) != 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &buf, PyBUF_WRITABLE) != 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    pad = room - ids.len - TAIL_LEN;
    if (slen > 0xFF || slen > ids.len || ids.len - slen > 0xFFFF || pad < 0 || pad > 0xFFFF ||
        body > buf.len || buf.len - body != room) {
        PyBuffer_Release(&buf);
        PyBuffer_Release(&ids);
        PyErr_SetString(PyExc_ValueError, "seal_frame: lengths do not add up");
        return NULL;
    }
    p = (unsigned char *)buf.buf + body;
    memset(p, 0, (size_t)pad);
    p += pad;
    memcpy(p, ids.buf, (size_t)ids.len);
    p += ids.len;
    put_le(p, seq, 8);
    put_le(p + 8, epoch, 8);
    p[16] = (unsigned char)slen;
    put_le(p + 17, (unsigned long long)(ids.len - slen), 2);
    put_le(p + 19, (unsigned long long)pad, 2);
    p[21] = RING_VERSION;
    p[22] = 'F';
    p[23] = 'M';
    /* nonce = the footer's first 12 bytes: seq, low half of epoch */
    ok = gmac_tag((Gmac *)args[0], p, buf.buf, buf.len - TAG_LEN, (unsigned char *)buf.buf + buf.len - TAG_LEN);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&ids);
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL failed to compute a GMAC");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *open_entry(PyObject *entry, const unsigned char *d, Py_ssize_t n, const unsigned char *foot,
                            Py_ssize_t body, PyObject *topic);

/* Returns a new reference to (sender, seq, epoch, body), Py_None for "not the fast path", or NULL
 * with an exception set (only for a caller's mistake or out-of-memory, never for the data). */
static PyObject *open_frame(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *table, *data, *topic, *key, *entry, *result;
    const unsigned char *d, *foot;
    Py_ssize_t n, slen, tlen, pad, ids_at, body;
    (void)module;
    if (nargs != 3 || !PyDict_Check(args[0]) || !PyBytes_Check(args[1]) || !PyUnicode_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "open_frame(table: dict, data: bytes, topic: str)");
        return NULL;
    }
    table = args[0];
    data = args[1];
    topic = args[2];
    d = (const unsigned char *)PyBytes_AS_STRING(data);
    n = PyBytes_GET_SIZE(data);
    if (n < TAIL_LEN || (n >= 2 && d[0] == 'F' && d[1] == 'S')) /* too short, or ed25519's envelope */
        Py_RETURN_NONE;
    foot = d + n - TAIL_LEN;
    if (foot[22] != 'F' || foot[23] != 'M' || foot[21] != RING_VERSION)
        Py_RETURN_NONE;
    slen = foot[16];
    tlen = (Py_ssize_t)get_le(foot + 17, 2);
    pad = (Py_ssize_t)get_le(foot + 19, 2);
    ids_at = (n - TAIL_LEN) - slen - tlen;
    body = ids_at - pad;
    if (ids_at < 0 || body < 0)
        Py_RETURN_NONE;
    key = PyBytes_FromStringAndSize((const char *)d + ids_at, slen + tlen);
    if (key == NULL)
        return NULL;
    entry = PyDict_GetItemWithError(table, key); /* borrowed: held below */
    Py_DECREF(key);
    if (entry == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(entry);
    result = open_entry(entry, d, n, foot, body, topic);
    Py_DECREF(entry);
    return result;
}

static PyObject *open_entry(PyObject *entry, const unsigned char *d, Py_ssize_t n, const unsigned char *foot,
                            Py_ssize_t body, PyObject *topic) {
    PyObject *sender_b;
    Py_ssize_t slen = foot[16], start, end;
    unsigned char tag[TAG_LEN];
    int same;
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) < 4 || !PyObject_TypeCheck(PyTuple_GET_ITEM(entry, 3), &GmacType) ||
        !PyBytes_Check(PyTuple_GET_ITEM(entry, 2))) {
        PyErr_SetString(PyExc_TypeError, "open_frame: table values must be (topic, sender, sender_bytes, Gmac, ...)");
        return NULL;
    }
    same = PyUnicode_Compare(PyTuple_GET_ITEM(entry, 0), topic);
    if (same == -1 && PyErr_Occurred())
        return NULL;
    sender_b = PyTuple_GET_ITEM(entry, 2);
    if (same != 0 || PyBytes_GET_SIZE(sender_b) != slen || !ready((Gmac *)PyTuple_GET_ITEM(entry, 3)))
        Py_RETURN_NONE;
    if (!gmac_tag((Gmac *)PyTuple_GET_ITEM(entry, 3), foot, d, n - TAG_LEN, tag)) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL failed to compute a GMAC");
        return NULL;
    }
    same = CRYPTO_memcmp(tag, d + n - TAG_LEN, TAG_LEN) == 0;
    OPENSSL_cleanse(tag, sizeof tag);
    if (!same)
        Py_RETURN_NONE;
    /* A ring frame must name the sender the MAC proves (framing.header_sender). */
    if (body >= FRAME_HEADER && d[0] == 'F' && d[1] == 'E') {
        start = FRAME_HEADER + d[44] + d[45];
        end = start + d[46];
        if (end <= body &&
            (end - start != slen || memcmp(d + start, PyBytes_AS_STRING(sender_b), (size_t)slen) != 0))
            Py_RETURN_NONE;
    }
    return Py_BuildValue("(OKKn)", PyTuple_GET_ITEM(entry, 1), get_le(foot, 8), get_le(foot + 8, 8), body);
}

static PyMethodDef gmac_methods[] = {
    {"seal", (PyCFunction)(void (*)(void))gmac_seal, METH_FASTCALL,
     "seal(buf, end, seq, epoch): write the tag of buf[:end] at buf[end:end + 16]."},
    {"verify", (PyCFunction)(void (*)(void))gmac_verify, METH_FASTCALL,
     "verify(data, end, nonce_at) -> bool: data[end:end + 16] is the tag of data[:end]."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GmacType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "federation._gmac.Gmac",
    .tp_basicsize = sizeof(Gmac),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "AES-256-GMAC on one reusable OpenSSL context (see the module's docstring).",
    .tp_new = PyType_GenericNew,
    .tp_init = gmac_init,
    .tp_dealloc = gmac_dealloc,
    .tp_methods = gmac_methods,
};

static PyMethodDef module_methods[] = {
    {"seal_frame", (PyCFunction)(void (*)(void))seal_frame, METH_FASTCALL,
     "seal_frame(mac, buf, body, room, ids, slen, seq, epoch): write ringmac's trailer and tag."},
    {"open_frame", (PyCFunction)(void (*)(void))open_frame, METH_FASTCALL,
     "open_frame(table, data, topic) -> (sender, seq, epoch, body) | None: ringmac's fast path."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef gmac_module = {
    PyModuleDef_HEAD_INIT, "federation._gmac",
    "AES-256-GMAC for ring frames on a reusable OpenSSL context (see federation/_gmac.c).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__gmac(void) {
    PyObject *m;
    if (PyType_Ready(&GmacType) < 0)
        return NULL;
    m = PyModule_Create(&gmac_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&GmacType);
    if (PyModule_AddObject(m, "Gmac", (PyObject *)&GmacType) < 0) {
        Py_DECREF(&GmacType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "OPENSSL_VERSION", OpenSSL_version(OPENSSL_VERSION)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
