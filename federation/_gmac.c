/* AES-256-GMAC for ring frames (federation/ringmac.py), without the per-call overhead.
 *
 * The same tag as cryptography's AESGCM(key).encrypt(nonce, b"", data) -- AES-GCM with an empty
 * plaintext, the whole frame as associated data -- on state per key that lives as long as the
 * object: no context allocated, copied and freed per frame, no Python objects built for the nonce
 * or the tag, and the GIL kept (a 19 KB frame takes ~1-4 us: too short to be worth handing the GIL
 * to another thread and queueing for it again). Measured in a 4-node swarm's node processes
 * (docs/benchmarks-history.md, "Session 11"): ~11-18 us per AESGCM call there against ~3 us in a hot loop.
 * GHASH is computed here with VPCLMULQDQ where the CPU has AVX-512 (below; ~22 GB/s in a hot loop
 * on the CI machine's EPYC, as fast as cryptography's bundled OpenSSL for 1 MiB and 1.6-4x
 * faster per call under 64 KiB), and then ringmac sends frames of every size here; else by
 * OpenSSL's EVP GCM on one reusable context (the system's OpenSSL 3.0: ~5-8 GB/s), and frames
 * over 32 KiB go to cryptography's AESGCM instead (ringmac._SMALL). The GIL stays held even for
 * 1 MiB (~46 us): a thread that hands it over may wait for a busy one's switch interval (5 ms)
 * to get it back.
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
 *   ghash() -> str, use_clmul(flag) -> bool: which GHASH new objects use (below), and a switch
 *        (tests run every check on both).
 *
 * Thread safety: every call holds the GIL from start to end, so calls on one object never
 * overlap. Built by setup.py as federation._gmac (optional: ringmac falls back to cryptography's
 * AESGCM, bit-identical, where it is not built).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>

#define TAG_LEN 16
#define GROUP 32 /* GHASH blocks per reduction in the CLMUL path (a multiple of 4) */
#define NONCE_LEN 12
#define KEY_LEN 32

typedef struct {
    PyObject_HEAD
    EVP_CIPHER_CTX *ctx;
    EVP_CIPHER_CTX *ecb; /* AES-256 of single blocks (E_K(J0)) for the CLMUL path */
    unsigned char *powers_mem; /* 32 x GROUP bytes + alignment: K^GROUP .. K^1 and their Karatsuba halves */
    unsigned char *powers; /* powers_mem rounded up to 64 bytes */
    int fast; /* tags by the CLMUL path (set up); else OpenSSL's EVP GCM */
} Gmac;

static PyTypeObject GmacType;

/* --- GHASH with VPCLMULQDQ (x86-64 with AVX-512) -----------------------------------------------
 * The system's OpenSSL (3.0) has no VPCLMULQDQ code for GCM: on this project's CI machines it
 * hashes ~7.6 GB/s where the CPU can do several times that. This is GHASH written as POLYVAL
 * (RFC 8452, appendix A: GHASH(H, X_1..X_n) = ByteReverse(POLYVAL(mulX(ByteReverse(H)),
 * ByteReverse(X_1)..ByteReverse(X_n)))), where a product reduces with two carry-less multiplies
 * by 0xc2 << 56 and no bit reflection. 32 blocks go per step: 8 registers of 4 blocks, each
 * block multiplied by its own power of K = mulX(ByteReverse(H)) (Karatsuba: 3 carry-less
 * multiplies per block), the 32 products summed unreduced and reduced once (reduction is
 * linear); the last < 32 blocks and the lengths block likewise, in one step against the lowest
 * powers (not block by block: a 100-byte frame is one reduction). The AES blocks (H = E_K(0),
 * E_K(J0)) still come from OpenSSL. Used only where the CPU has AVX-512F/BW/VL and VPCLMULQDQ (checked once at
 * import); FRACTAL_GHASH=openssl turns it off. Tags equal OpenSSL's (tests/federation/test_gmac.py
 * compares both paths with cryptography's AESGCM, sizes 0 .. 256 KiB). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CLMUL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,vpclmulqdq,pclmul,ssse3,sse4.1")))
static int clmul_cpu = 0; /* the CPU has what the CLMUL path needs */
static int clmul_ok = 0;  /* new Gmac objects take the CLMUL path */

CLMUL_TARGET static inline __m128i pv_reduce(__m128i lo, __m128i hi) {
    const __m128i poly = _mm_set_epi64x(0, (long long)0xC200000000000000ULL);
    __m128i t = _mm_clmulepi64_si128(lo, poly, 0x00);
    lo = _mm_xor_si128(_mm_shuffle_epi32(lo, 0x4E), t);
    t = _mm_clmulepi64_si128(lo, poly, 0x00);
    lo = _mm_xor_si128(_mm_shuffle_epi32(lo, 0x4E), t);
    return _mm_xor_si128(lo, hi);
}

/* POLYVAL's dot(a, b) = a * b * x^-128 */
CLMUL_TARGET static inline __m128i pv_dot(__m128i a, __m128i b) {
    __m128i lo = _mm_clmulepi64_si128(a, b, 0x00), hi = _mm_clmulepi64_si128(a, b, 0x11);
    __m128i mid = _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x01), _mm_clmulepi64_si128(a, b, 0x10));
    lo = _mm_xor_si128(lo, _mm_slli_si128(mid, 8));
    hi = _mm_xor_si128(hi, _mm_srli_si128(mid, 8));
    return pv_reduce(lo, hi);
}

CLMUL_TARGET static inline __m128i bswap128(__m128i v) {
    return _mm_shuffle_epi8(v, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* powers[16 * (GROUP - j)] = K^j for j = GROUP .. 1, K = mulX(ByteReverse(H)), so that the 4 blocks
 * of the first 64-byte load line up with K^GROUP..K^(GROUP-3), the next with the 4 below, ...;
 * powers[16 * GROUP + 16 * (GROUP - j)] holds K^j's two halves XORed (its low 64 bits), the
 * Karatsuba middle factor. */
CLMUL_TARGET static void clmul_init(unsigned char *powers, const unsigned char h[16]) {
    __m128i v = bswap128(_mm_loadu_si128((const __m128i *)h)), k, p;
    /* mulX in POLYVAL's field: v << 1 (a 128-bit little-endian integer), reduced by
     * x^128 = x^127 + x^126 + x^121 + 1 if bit 127 falls out */
    unsigned long long lo = (unsigned long long)_mm_cvtsi128_si64(v);
    unsigned long long hi = (unsigned long long)_mm_extract_epi64(v, 1);
    unsigned long long carry = hi >> 63;
    hi = (hi << 1) | (lo >> 63);
    lo <<= 1;
    if (carry) {
        hi ^= 0xC200000000000000ULL;
        lo ^= 1ULL;
    }
    k = _mm_set_epi64x((long long)hi, (long long)lo);
    p = k;
    for (int j = 1; j <= GROUP; j++) {
        _mm_store_si128((__m128i *)(powers + 16 * (GROUP - j)), p);
        _mm_store_si128((__m128i *)(powers + 16 * GROUP + 16 * (GROUP - j)),
                        _mm_xor_si128(p, _mm_shuffle_epi32(p, 0x4E)));
        p = pv_dot(p, k);
    }
}

CLMUL_TARGET static inline __m128i fold4(__m512i v) {
    __m256i h = _mm256_xor_si256(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    return _mm_xor_si128(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* Four block products x * p, unreduced, into (lo, hi, mid) by Karatsuba: three carry-less
 * multiplies per block instead of four (the multiplier is what bounds the speed here); pk holds
 * p's halves XORed. mid is (lo_x ^ hi_x)(lo_p ^ hi_p) and needs lo and hi added back. */
CLMUL_TARGET static inline void mul4(__m512i x, __m512i p, __m512i pk, __m512i *lo, __m512i *hi, __m512i *mid) {
    *lo = _mm512_xor_si512(*lo, _mm512_clmulepi64_epi128(x, p, 0x00));
    *hi = _mm512_xor_si512(*hi, _mm512_clmulepi64_epi128(x, p, 0x11));
    *mid = _mm512_xor_si512(*mid, _mm512_clmulepi64_epi128(_mm512_xor_si512(x, _mm512_shuffle_epi32(x, 0x4E)),
                                                          pk, 0x00));
}

/* sum of the products, reduced once (reduction is linear) */
CLMUL_TARGET static inline __m128i reduce4(__m512i lo, __m512i hi, __m512i mid) {
    __m128i l = fold4(lo), h = fold4(hi), m = _mm_xor_si128(fold4(mid), _mm_xor_si128(l, h));
    return pv_reduce(_mm_xor_si128(l, _mm_slli_si128(m, 8)), _mm_xor_si128(h, _mm_srli_si128(m, 8)));
}

/* S = GHASH_H(data zero-padded || lengths block), byte-reversed (POLYVAL's order). GROUP blocks
 * per reduction; what is left (under GROUP blocks, the zero-padded last one and the lengths
 * block) goes through the same products in one more step or two. */
CLMUL_TARGET static __m128i clmul_ghash(const unsigned char *powers, const unsigned char *d, Py_ssize_t len) {
    const __m512i rev = _mm512_broadcast_i32x4(_mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const unsigned char *pks = powers + 16 * GROUP;
    __m128i y = _mm_setzero_si128();
    unsigned long long bits = (unsigned long long)len * 8;
    if (len >= 16 * GROUP) {
        __m512i p[GROUP / 4], pk[GROUP / 4];
        for (int r = 0; r < GROUP / 4; r++) {
            p[r] = _mm512_load_si512((const void *)(powers + 64 * r));
            pk[r] = _mm512_load_si512((const void *)(pks + 64 * r));
        }
        for (; len >= 16 * GROUP; len -= 16 * GROUP, d += 16 * GROUP) {
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512(), mid = _mm512_setzero_si512();
            /* the running sum y joins the first block, last: the other products need not wait for it */
            for (int r = 1; r < GROUP / 4; r++)
                mul4(_mm512_shuffle_epi8(_mm512_loadu_si512((const void *)(d + 64 * r)), rev), p[r], pk[r],
                     &lo, &hi, &mid);
            mul4(_mm512_xor_si512(_mm512_shuffle_epi8(_mm512_loadu_si512((const void *)d), rev),
                                  _mm512_zextsi128_si512(y)), p[0], pk[0], &lo, &hi, &mid);
            y = reduce4(lo, hi, mid);
        }
    }
    {
        /* the rest: n = full + partial + 1 (lengths) <= GROUP + 1 blocks, byte-reversed into t
         * behind zero blocks up to a multiple of 4 (zeros add nothing), against K^n4 .. K^1 */
        _Alignas(64) unsigned char t[16 * (GROUP + 4)];
        Py_ssize_t full = len / 16, rest = len % 16;
        int n = (int)full + (rest > 0) + 1, n4, at;
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512(), mid = _mm512_setzero_si512();
        if (n > GROUP) { /* GROUP - 1 full blocks, a partial one and the lengths: one block first */
            y = pv_dot(_mm_xor_si128(y, bswap128(_mm_loadu_si128((const __m128i *)d))),
                       _mm_load_si128((const __m128i *)(powers + 16 * (GROUP - 1))));
            d += 16;
            full -= 1;
            n -= 1;
        }
        n4 = (n + 3) & ~3;
        at = n4 - n;
        memset(t, 0, (size_t)(16 * at));
        for (Py_ssize_t i = 0; i < full; i++)
            _mm_store_si128((__m128i *)(t + 16 * (at + i)), bswap128(_mm_loadu_si128((const __m128i *)(d + 16 * i))));
        if (rest > 0) {
            unsigned char last[16] = {0};
            memcpy(last, d + 16 * full, (size_t)rest);
            _mm_store_si128((__m128i *)(t + 16 * (at + full)), bswap128(_mm_loadu_si128((const __m128i *)last)));
        }
        /* the lengths block: bit length of the associated data (BE64) || 0 (no ciphertext), reversed */
        _mm_store_si128((__m128i *)(t + 16 * (n4 - 1)), _mm_set_epi64x((long long)bits, 0));
        _mm_store_si128((__m128i *)(t + 16 * at), _mm_xor_si128(y, _mm_load_si128((const __m128i *)(t + 16 * at))));
        for (int r = 0; r < n4 / 4; r++) {
            Py_ssize_t off = 16 * (GROUP - n4) + 64 * r;
            mul4(_mm512_load_si512((const void *)(t + 64 * r)), _mm512_load_si512((const void *)(powers + off)),
                 _mm512_load_si512((const void *)(pks + off)), &lo, &hi, &mid);
        }
        OPENSSL_cleanse(t, sizeof t);
        return reduce4(lo, hi, mid);
    }
}

CLMUL_TARGET static int clmul_tag(Gmac *self, const unsigned char *nonce, const unsigned char *data,
                                  Py_ssize_t len, unsigned char *tag) {
    unsigned char j0[16], ek[16];
    int outl = 0;
    memcpy(j0, nonce, NONCE_LEN);
    j0[12] = 0;
    j0[13] = 0;
    j0[14] = 0;
    j0[15] = 1;
    if (EVP_EncryptUpdate(self->ecb, ek, &outl, j0, 16) != 1 || outl != 16)
        return 0;
    __m128i s = bswap128(clmul_ghash(self->powers, data, len));
    _mm_storeu_si128((__m128i *)tag, _mm_xor_si128(s, _mm_loadu_si128((const __m128i *)ek)));
    OPENSSL_cleanse(ek, sizeof ek);
    return 1;
}

static void clmul_detect(void) {
    const char *env = getenv("FRACTAL_GHASH");
    __builtin_cpu_init();
    clmul_cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq") &&
                __builtin_cpu_supports("pclmul");
    clmul_ok = clmul_cpu && !(env != NULL && strcmp(env, "openssl") == 0);
}
#else
static const int clmul_cpu = 0;
static int clmul_ok = 0;
static void clmul_detect(void) {}
static int clmul_tag(Gmac *self, const unsigned char *nonce, const unsigned char *data, Py_ssize_t len,
                     unsigned char *tag) {
    (void)self; (void)nonce; (void)data; (void)len; (void)tag;
    return 0;
}
static void clmul_init(unsigned char *powers, const unsigned char h[16]) { (void)powers; (void)h; }
#endif

static int gmac_tag(Gmac *self, const unsigned char *nonce, const unsigned char *data, Py_ssize_t len,
                    unsigned char *tag) {
    int outl = 0;
    unsigned char none[1];
    if (self->fast)
        return clmul_tag(self, nonce, data, len, tag);
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
    self->fast = 0;
    if (ok && clmul_ok) {
        unsigned char zero[16] = {0}, h[16];
        int outl = 0;
        if (self->ecb == NULL)
            self->ecb = EVP_CIPHER_CTX_new();
        if (self->powers_mem == NULL) {
            self->powers_mem = OPENSSL_malloc(32 * GROUP + 64);
            self->powers = self->powers_mem == NULL ? NULL
                : (unsigned char *)(((uintptr_t)self->powers_mem + 63) & ~(uintptr_t)63);
        }
        ok = self->ecb != NULL && self->powers != NULL &&
             EVP_EncryptInit_ex(self->ecb, EVP_aes_256_ecb(), NULL, key.buf, NULL) == 1 &&
             EVP_CIPHER_CTX_set_padding(self->ecb, 0) == 1 &&
             EVP_EncryptUpdate(self->ecb, h, &outl, zero, 16) == 1 && outl == 16;
        if (ok) {
            clmul_init(self->powers, h);
            self->fast = 1;
        }
        OPENSSL_cleanse(h, sizeof h);
    }
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
    if (self->ecb != NULL)
        EVP_CIPHER_CTX_free(self->ecb);
    if (self->powers_mem != NULL)
        OPENSSL_clear_free(self->powers_mem, 32 * GROUP + 64);
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

static PyObject *gmac_fast(PyObject *op, void *closure) {
    (void)closure;
    return PyBool_FromLong(((Gmac *)op)->fast);
}

static PyGetSetDef gmac_getset[] = {
    {"fast", gmac_fast, NULL, "Whether this object's tags come from the CLMUL path (else OpenSSL's GCM).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
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
    .tp_getset = gmac_getset,
};

static PyObject *ghash_impl(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyUnicode_FromString(clmul_ok ? "vpclmulqdq-avx512" : "openssl");
}

static PyObject *use_clmul(PyObject *module, PyObject *flag) {
    int on = PyObject_IsTrue(flag);
    (void)module;
    if (on < 0)
        return NULL;
    clmul_ok = on && clmul_cpu;
    return PyBool_FromLong(clmul_ok);
}

static PyMethodDef module_methods[] = {
    {"ghash", ghash_impl, METH_NOARGS,
     "ghash() -> 'vpclmulqdq-avx512' | 'openssl': how Gmac objects created now compute GHASH."},
    {"use_clmul", use_clmul, METH_O,
     "use_clmul(flag) -> bool: let Gmac objects created from now on take the CLMUL path (where the "
     "CPU has it; the import default, unless FRACTAL_GHASH=openssl) or OpenSSL's GCM; the result."},
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
    clmul_detect();
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
