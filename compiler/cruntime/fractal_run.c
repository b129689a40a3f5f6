/* fractal-run: run one function of an ahead-of-time compiled model on .npy files.
 *
 *   fractal-run --list                 one line per function: name, inputs and outputs
 *   fractal-run [--threads N] FUNC IN_DIR OUT_DIR
 *                                      read IN_DIR/0.npy .. IN_DIR/<n_in-1>.npy (the function's
 *                                      flattened inputs, in order), write OUT_DIR/0.npy ..;
 *                                      N threads run parallel loops (default: see fractal_rt.h)
 *
 * Files are NumPy .npy (format 1.0 to 3.0 read, 1.0 written): little-endian, C order, exactly
 * the dtype and shape the function was compiled for, and exactly as many data bytes as that
 * shape holds; the header dict is parsed, and anything it cannot read exactly is refused.
 * Errors: one "error: ..." line on stderr, exit status 1 (2 for bad usage), never a signal.
 */
#include "fractal_rt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int fail(const char* what, const char* detail) {
  fprintf(stderr, "error: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
  return 1;
}

static const char* descr_of(fr_dtype t) {
  if (t.lanes != 1) return NULL;
  switch (t.code) {
    case FR_DL_FLOAT: return t.bits == 32 ? "<f4" : t.bits == 64 ? "<f8" : t.bits == 16 ? "<f2" : NULL;
    case FR_DL_INT: return t.bits == 64 ? "<i8" : t.bits == 32 ? "<i4" : t.bits == 16 ? "<i2" : t.bits == 8 ? "|i1" : NULL;
    case FR_DL_UINT: return t.bits == 64 ? "<u8" : t.bits == 32 ? "<u4" : t.bits == 16 ? "<u2" : t.bits == 8 ? "|u1" : NULL;
    case FR_DL_BOOL: return t.bits == 8 ? "|b1" : NULL;
    default: return NULL;
  }
}

static void shape_str(const fr_tensor_desc* d, char* buf, size_t n) {
  size_t len = (size_t)snprintf(buf, n, "(");
  for (int32_t i = 0; i < d->ndim && len < n; ++i)
    len += (size_t)snprintf(buf + len, n - len, i ? ", %lld" : "%lld", (long long)d->shape[i]);
  if (len < n) snprintf(buf + len, n - len, ")");
}

/* ---- the .npy header: a Python dict literal, parsed (not searched) ----------------------------
 * Accepted: {'descr': STR, 'fortran_order': False|True, 'shape': (INT, ...)} with the three keys
 * exactly once each, in any order, single or double quotes, optional trailing comma, ASCII only,
 * then padding (spaces) and a newline. Anything else (a structured dtype given as a list, an
 * unknown or repeated key, an escape in a string, a dimension that overflows) is refused: the
 * runner would otherwise read bytes as a layout they do not have. */
#define NPY_MAX_HEADER 65536u /* numpy itself refuses headers over 10,000 bytes by default */

typedef struct {
  char descr[16];
  int fortran_order;
  int32_t ndim;
  int64_t shape[FR_MAX_DIMS];
} npy_header;

typedef struct {
  const char* p;
  const char* end;
  char* why;
  size_t whyn;
} npy_cursor;

static void npy_ws(npy_cursor* c) {
  while (c->p < c->end && (*c->p == ' ' || *c->p == '\t')) ++c->p;
}

static int npy_expect(npy_cursor* c, char ch) {
  npy_ws(c);
  if (c->p >= c->end || *c->p != ch) {
    snprintf(c->why, c->whyn, "expected '%c'", ch);
    return -1;
  }
  ++c->p;
  return 0;
}

/* A quoted string without escapes, of printable ASCII, shorter than n. */
static int npy_string(npy_cursor* c, char* out, size_t n) {
  npy_ws(c);
  if (c->p >= c->end || (*c->p != '\'' && *c->p != '"')) {
    snprintf(c->why, c->whyn, "expected a quoted string");
    return -1;
  }
  char q = *c->p++;
  size_t len = 0;
  while (c->p < c->end && *c->p != q) {
    unsigned char ch = (unsigned char)*c->p;
    if (ch == '\\' || ch < 0x20 || ch > 0x7e) {
      snprintf(c->why, c->whyn, "unsupported character 0x%02x in a string", ch);
      return -1;
    }
    if (len + 1 >= n) {
      snprintf(c->why, c->whyn, "string too long");
      return -1;
    }
    out[len++] = (char)ch;
    ++c->p;
  }
  if (c->p >= c->end) {
    snprintf(c->why, c->whyn, "unterminated string");
    return -1;
  }
  ++c->p;
  out[len] = 0;
  return 0;
}

static int npy_word(npy_cursor* c, const char* w) {
  size_t n = strlen(w);
  if ((size_t)(c->end - c->p) >= n && memcmp(c->p, w, n) == 0) {
    const char* after = c->p + n;
    if (after == c->end || !((*after >= 'A' && *after <= 'Z') || (*after >= 'a' && *after <= 'z') ||
                             (*after >= '0' && *after <= '9') || *after == '_')) {
      c->p = after;
      return 1;
    }
  }
  return 0;
}

/* (), (N,), (N, M), (N, M,) ...: non-negative decimal integers, at most FR_MAX_DIMS. */
static int npy_shape(npy_cursor* c, npy_header* h) {
  if (npy_expect(c, '(') != 0) { snprintf(c->why, c->whyn, "shape is not a tuple"); return -1; }
  h->ndim = 0;
  int comma = 1; /* a dimension may follow */
  for (;;) {
    npy_ws(c);
    if (c->p < c->end && *c->p == ')') {
      ++c->p;
      break;
    }
    if (!comma) { snprintf(c->why, c->whyn, "expected ',' or ')' in the shape"); return -1; }
    if (c->p >= c->end || *c->p < '0' || *c->p > '9') {
      snprintf(c->why, c->whyn, "a shape dimension is not a non-negative integer");
      return -1;
    }
    int64_t v = 0;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
      int d = *c->p++ - '0';
      if (v > (INT64_MAX - d) / 10) { snprintf(c->why, c->whyn, "a shape dimension overflows"); return -1; }
      v = v * 10 + d;
    }
    if (h->ndim >= FR_MAX_DIMS) { snprintf(c->why, c->whyn, "more than %d dimensions", FR_MAX_DIMS); return -1; }
    h->shape[h->ndim++] = v;
    npy_ws(c);
    comma = c->p < c->end && *c->p == ',';
    if (comma) ++c->p;
    else if (h->ndim == 1) { snprintf(c->why, c->whyn, "a 1-d shape needs a trailing comma: (N,)"); return -1; }
  }
  uint64_t count = 1;
  for (int32_t i = 0; i < h->ndim; ++i) {
    uint64_t d = (uint64_t)h->shape[i];
    if (d != 0 && count > (UINT64_MAX >> 4) / d) { snprintf(c->why, c->whyn, "the shape's size overflows"); return -1; }
    count *= d;
  }
  return 0;
}

/* Parse header bytes h[0..n) (without the magic and length); 0, or -1 with why set. */
static int npy_parse_header(const char* h, size_t n, npy_header* out, char* why, size_t whyn) {
  npy_cursor c = {h, h + n, why, whyn};
  int seen_descr = 0, seen_order = 0, seen_shape = 0;
  memset(out, 0, sizeof *out);
  for (size_t i = 0; i < n; ++i)
    if ((unsigned char)h[i] > 0x7e || ((unsigned char)h[i] < 0x20 && h[i] != '\n' && h[i] != '\t')) {
      snprintf(why, whyn, "non-ASCII or control byte 0x%02x in the header", (unsigned char)h[i]);
      return -1;
    }
  if (npy_expect(&c, '{') != 0) return -1;
  for (;;) {
    npy_ws(&c);
    if (c.p < c.end && *c.p == '}') { ++c.p; break; }
    char key[32];
    if (npy_string(&c, key, sizeof key) != 0) return -1;
    if (npy_expect(&c, ':') != 0) return -1;
    npy_ws(&c);
    if (strcmp(key, "descr") == 0 && !seen_descr) {
      seen_descr = 1;
      if (c.p < c.end && *c.p == '[') { snprintf(why, whyn, "structured dtypes are not supported"); return -1; }
      if (npy_string(&c, out->descr, sizeof out->descr) != 0) return -1;
    } else if (strcmp(key, "fortran_order") == 0 && !seen_order) {
      seen_order = 1;
      if (npy_word(&c, "False")) out->fortran_order = 0;
      else if (npy_word(&c, "True")) out->fortran_order = 1;
      else { snprintf(why, whyn, "fortran_order is not True or False"); return -1; }
    } else if (strcmp(key, "shape") == 0 && !seen_shape) {
      seen_shape = 1;
      if (npy_shape(&c, out) != 0) return -1;
    } else {
      snprintf(why, whyn, "%s key '%s'", (strcmp(key, "descr") == 0 || strcmp(key, "fortran_order") == 0 ||
                                          strcmp(key, "shape") == 0) ? "repeated" : "unknown", key);
      return -1;
    }
    npy_ws(&c);
    if (c.p < c.end && *c.p == ',') { ++c.p; continue; }
    if (c.p < c.end && *c.p == '}') { ++c.p; break; }
    snprintf(why, whyn, "expected ',' or '}' after '%s'", key);
    return -1;
  }
  if (!seen_descr || !seen_order || !seen_shape) {
    snprintf(why, whyn, "the header lacks '%s'", !seen_descr ? "descr" : !seen_order ? "fortran_order" : "shape");
    return -1;
  }
  while (c.p < c.end && *c.p == ' ') ++c.p;
  if (c.p >= c.end || *c.p != '\n' || c.p + 1 != c.end) {
    snprintf(why, whyn, "the header does not end in padding and a newline");
    return -1;
  }
  return 0;
}

/* Read an .npy file into a FR_ALIGN-aligned buffer after checking dtype, order, shape and size. */
static void* read_npy(const char* path, const fr_tensor_desc* d, char* err, size_t errn) {
  FILE* f = fopen(path, "rb");
  if (!f) { snprintf(err, errn, "cannot open %s", path); return NULL; }
  unsigned char pre[12];
  void* data = NULL;
  char* header = NULL;
  char why[160];
  npy_header h;
  if (fread(pre, 1, 8, f) != 8 || memcmp(pre, "\x93NUMPY", 6) != 0) {
    snprintf(err, errn, "%s is not a .npy file", path); goto out;
  }
  uint32_t hlen;
  long start;
  if (pre[7] != 0 || pre[6] < 1 || pre[6] > 3) {
    snprintf(err, errn, "%s: unsupported .npy version %d.%d", path, pre[6], pre[7]); goto out;
  }
  if (pre[6] == 1) {
    if (fread(pre + 8, 1, 2, f) != 2) { snprintf(err, errn, "%s: truncated header", path); goto out; }
    hlen = (uint32_t)pre[8] | ((uint32_t)pre[9] << 8);
    start = 10;
  } else {
    if (fread(pre + 8, 1, 4, f) != 4) { snprintf(err, errn, "%s: truncated header", path); goto out; }
    hlen = (uint32_t)pre[8] | ((uint32_t)pre[9] << 8) | ((uint32_t)pre[10] << 16) | ((uint32_t)pre[11] << 24);
    start = 12;
  }
  if (hlen > NPY_MAX_HEADER) { snprintf(err, errn, "%s: header of %u bytes is too large", path, hlen); goto out; }
  header = malloc(hlen + 1);
  if (!header || fread(header, 1, hlen, f) != hlen) { snprintf(err, errn, "%s: truncated header", path); goto out; }
  header[hlen] = 0;
  if (npy_parse_header(header, hlen, &h, why, sizeof why) != 0) {
    snprintf(err, errn, "%s: bad .npy header: %s", path, why); goto out;
  }
  const char* want = descr_of(d->dtype);
  if (!want || strcmp(h.descr, want) != 0) {
    snprintf(err, errn, "%s: dtype is not %s (the file has '%s')", path, want ? want : "?", h.descr); goto out;
  }
  if (h.fortran_order) { snprintf(err, errn, "%s: not C order (fortran_order is True)", path); goto out; }
  int ok = h.ndim == d->ndim;
  for (int32_t i = 0; ok && i < h.ndim; ++i) ok = h.shape[i] == d->shape[i];
  if (!ok) {
    char s[128];
    shape_str(d, s, sizeof s);
    snprintf(err, errn, "%s: shape differs from the compiled %s", path, s); goto out;
  }
  uint64_t nbytes = fr_desc_nbytes(d);
  struct stat st;
  if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) { snprintf(err, errn, "%s: not a regular file", path); goto out; }
  uint64_t have = (uint64_t)st.st_size, need = (uint64_t)start + hlen + nbytes;
  if (have != need) {
    snprintf(err, errn, "%s: %s data: %llu bytes where the header says %llu", path,
             have < need ? "truncated" : "trailing bytes after the", (unsigned long long)(have - (uint64_t)start - hlen),
             (unsigned long long)nbytes);
    goto out;
  }
  if (posix_memalign(&data, FR_ALIGN, nbytes ? nbytes : 1) != 0) { data = NULL; snprintf(err, errn, "out of memory"); goto out; }
  if (fread(data, 1, nbytes, f) != nbytes) {
    free(data); data = NULL; snprintf(err, errn, "%s: truncated data", path); goto out;
  }
out:
  free(header);
  fclose(f);
  return data;
}

static int write_npy(const char* path, const fr_tensor_desc* d, const void* data) {
  char s[160], header[256];
  size_t len = (size_t)snprintf(s, sizeof s, "(");
  for (int32_t i = 0; i < d->ndim && len < sizeof s; ++i)  /* Python tuple syntax: (n,) and (a, b) */
    len += (size_t)snprintf(s + len, sizeof s - len, i ? ", %lld" : "%lld", (long long)d->shape[i]);
  if (len < sizeof s) snprintf(s + len, sizeof s - len, d->ndim == 1 ? ",)" : ")");
  int n = snprintf(header, sizeof header, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }",
                   descr_of(d->dtype), s);
  int total = 10 + n + 1;
  int pad = (FR_ALIGN - total % FR_ALIGN) % FR_ALIGN;
  FILE* f = fopen(path, "wb");
  if (!f) return -1;
  unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, 0, 0};
  uint16_t hl = (uint16_t)(n + pad + 1);
  pre[8] = (unsigned char)(hl & 0xff);
  pre[9] = (unsigned char)(hl >> 8);
  fwrite(pre, 1, 10, f);
  fwrite(header, 1, (size_t)n, f);
  for (int i = 0; i < pad; ++i) fputc(' ', f);
  fputc('\n', f);
  uint64_t nbytes = fr_desc_nbytes(d);
  int ok = fwrite(data, 1, nbytes, f) == nbytes;
  return (fclose(f) == 0 && ok) ? 0 : -1;
}

static void print_sig(const fr_function* fn) {
  char s[160];
  printf("%s", fn->name);
  for (int side = 0; side < 2; ++side) {
    int32_t n = side ? fn->n_out : fn->n_in;
    const fr_tensor_desc* ds = side ? fn->outs : fn->ins;
    printf(side ? " ->" : "");
    for (int32_t i = 0; i < n; ++i) {
      shape_str(&ds[i], s, sizeof s);
      printf(" %s%s", descr_of(ds[i].dtype), s);
    }
  }
  printf("\n");
}

int main(int argc, char** argv) {
  if (argc == 2 && strcmp(argv[1], "--list") == 0) {
    printf("# model %s\n", fr_model_name());
    for (int32_t i = 0; i < fr_num_functions(); ++i) print_sig(fr_get_function(i));
    return 0;
  }
  if (argc == 6 && strcmp(argv[1], "--threads") == 0) {
    char* end;
    long n = strtol(argv[2], &end, 10);
    if (*argv[2] == 0 || *end != 0 || n < 1 || n > FR_MAX_THREADS) {
      fprintf(stderr, "error: --threads takes a count in [1, %d], got '%s'\n", FR_MAX_THREADS, argv[2]);
      return 2;
    }
    fr_set_num_threads((int)n);
    argv += 2;
    argc -= 2;
  }
  if (argc != 4) {
    fprintf(stderr, "usage: %s --list | [--threads N] FUNC IN_DIR OUT_DIR\n", argv[0]);
    return 2;
  }
  const fr_function* fn = NULL;
  for (int32_t i = 0; i < fr_num_functions(); ++i)
    if (strcmp(fr_get_function(i)->name, argv[1]) == 0) fn = fr_get_function(i);
  if (!fn) return fail("no such function", argv[1]);
  void** in = calloc((size_t)fn->n_in + 1, sizeof(void*));
  void** out = calloc((size_t)fn->n_out + 1, sizeof(void*));
  void* ws = NULL;
  char path[4096], err[512];
  int rc = 1;
  if (!in || !out) { fail("out of memory", NULL); goto done; }
  for (int32_t i = 0; i < fn->n_in; ++i) {
    snprintf(path, sizeof path, "%s/%d.npy", argv[2], (int)i);
    if (!(in[i] = read_npy(path, &fn->ins[i], err, sizeof err))) { fail("bad input", err); goto done; }
  }
  for (int32_t i = 0; i < fn->n_out; ++i) {
    uint64_t nb = fr_desc_nbytes(&fn->outs[i]);
    if (posix_memalign(&out[i], FR_ALIGN, nb ? nb : 1) != 0) { out[i] = NULL; fail("out of memory", NULL); goto done; }
  }
  if (posix_memalign(&ws, FR_ALIGN, fn->workspace ? fn->workspace : 1) != 0) { ws = NULL; fail("out of memory", NULL); goto done; }
  if (fn->fn(in, out, ws) != 0) { fail("run failed", fr_last_error()); goto done; }
  for (int32_t i = 0; i < fn->n_out; ++i) {
    snprintf(path, sizeof path, "%s/%d.npy", argv[3], (int)i);
    if (write_npy(path, &fn->outs[i], out[i]) != 0) { fail("cannot write", path); goto done; }
  }
  rc = 0;
done:
  if (in) for (int32_t i = 0; i < fn->n_in; ++i) free(in[i]);
  if (out) for (int32_t i = 0; i < fn->n_out; ++i) free(out[i]);
  free(in); free(out); free(ws);
  return rc;
}
