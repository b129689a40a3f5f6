/* AES-256-GMAC for ring frames (federation/ringmac.py), without the per-call overhead.
 *
 * The same tag as cryptography's AESGCM(key).encrypt(nonce, b"", data) -- AES-GCM with an empty
 * plaintext, the whole frame as associated data -- computed by OpenSSL's EVP interface, but on
 * one cipher context per key that lives as long as the object: no context allocated, copied and
 * freed per frame, no Python objects built for the nonce or the tag, and the GIL kept (a 19 KB
 * frame takes ~1 us of GHASH; giving the GIL away and queueing for it again cost more than that
 * inside a node's busy process). Measured in a 4-node swarm's node processes (BENCHMARKS.md,
 * "Session 11"): ~13-18 us per AESGCM call there against ~3 us in a hot loop.
 *
 *   Gmac(key: 32 bytes)
 *   .seal(buf: writable buffer, end: int, seq: int, epoch: int) -> None
 *        writes the 16-byte tag over buf[:end] at buf[end:end + 16]; the nonce is the 12 bytes
 *        seq (u64 LE) || low 32 bits of epoch (u32 LE), as ringmac's envelope carries them.
 *   .verify(data: buffer, end: int, nonce_at: int) -> bool
 *        whether data[end:end + 16] is the tag of data[:end] under the nonce data[nonce_at:
 *        nonce_at + 12] (compared in constant time).
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
    if (!ready(self) || !index_arg(args[1], "end", &end))
        return NULL;
    seq = PyLong_AsUnsignedLongLong(args[2]);
    if (seq == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    epoch = PyLong_AsUnsignedLongLong(args[3]);
    if (epoch == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_WRITABLE) != 0)
        return NULL;
    if (end > buf.len - TAG_LEN) {
        PyBuffer_Release(&buf);
        PyErr_Format(PyExc_ValueError, "no room for a tag after %zd of %zd bytes", end, buf.len);
        return NULL;
    }
    for (int i = 0; i < 8; i++)
        nonce[i] = (unsigned char)(seq >> (8 * i));
    for (int i = 0; i < 4; i++)
        nonce[8 + i] = (unsigned char)(epoch >> (8 * i));
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

static struct PyModuleDef gmac_module = {
    PyModuleDef_HEAD_INIT, "federation._gmac",
    "AES-256-GMAC for ring frames on a reusable OpenSSL context (see federation/_gmac.c).", -1, NULL,
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
