/* fractal-run: run one function of an ahead-of-time compiled model on .npy files.
 *
 *   fractal-run --list                 one line per function: name, inputs and outputs
 *   fractal-run FUNC IN_DIR OUT_DIR    read IN_DIR/0.npy .. IN_DIR/<n_in-1>.npy (the function's
 *                                      flattened inputs, in order), write OUT_DIR/0.npy ..
 *
 * Files are NumPy .npy (format 1.0 to 3.0 read, 1.0 written): little-endian, C order, exactly
 * the dtype and shape the function was compiled for. Errors: one "error: ..." line on stderr,
 * exit status 1 (2 for bad usage).
 */
#include "fractal_rt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* Read an .npy file into a FR_ALIGN-aligned buffer after checking dtype, order and shape. */
static void* read_npy(const char* path, const fr_tensor_desc* d, char* err, size_t errn) {
  FILE* f = fopen(path, "rb");
  if (!f) { snprintf(err, errn, "cannot open %s", path); return NULL; }
  unsigned char pre[12];
  void* data = NULL;
  char* header = NULL;
  if (fread(pre, 1, 8, f) != 8 || memcmp(pre, "\x93NUMPY", 6) != 0) {
    snprintf(err, errn, "%s is not a .npy file", path); goto out;
  }
  uint32_t hlen;
  if (pre[6] == 1) {
    if (fread(pre + 8, 1, 2, f) != 2) { snprintf(err, errn, "%s: truncated header", path); goto out; }
    hlen = (uint32_t)pre[8] | ((uint32_t)pre[9] << 8);
  } else if (pre[6] == 2 || pre[6] == 3) {
    if (fread(pre + 8, 1, 4, f) != 4) { snprintf(err, errn, "%s: truncated header", path); goto out; }
    hlen = (uint32_t)pre[8] | ((uint32_t)pre[9] << 8) | ((uint32_t)pre[10] << 16) | ((uint32_t)pre[11] << 24);
  } else {
    snprintf(err, errn, "%s: unsupported .npy version %d", path, pre[6]); goto out;
  }
  if (hlen > (1u << 20)) { snprintf(err, errn, "%s: header too large", path); goto out; }
  header = malloc(hlen + 1);
  if (!header || fread(header, 1, hlen, f) != hlen) { snprintf(err, errn, "%s: truncated header", path); goto out; }
  header[hlen] = 0;
  const char* want = descr_of(d->dtype);
  char pat[32];
  snprintf(pat, sizeof pat, "'%s'", want ? want : "?");
  if (!want || !strstr(header, pat)) {
    snprintf(err, errn, "%s: dtype is not %s (header %s)", path, want ? want : "?", header); goto out;
  }
  if (!strstr(header, "'fortran_order': False")) {
    snprintf(err, errn, "%s: not C order", path); goto out;
  }
  const char* sp = strstr(header, "'shape':");
  if (!sp) { snprintf(err, errn, "%s: no shape in header", path); goto out; }
  sp = strchr(sp, '(');
  int64_t shape[FR_MAX_DIMS + 1];
  int32_t nd = 0;
  if (!sp) { snprintf(err, errn, "%s: bad shape in header", path); goto out; }
  ++sp;
  for (;;) {
    while (*sp == ' ' || *sp == ',') ++sp;
    if (*sp == ')') break;
    char* end;
    long long v = strtoll(sp, &end, 10);
    if (end == sp || nd > FR_MAX_DIMS || v < 0) { snprintf(err, errn, "%s: bad shape in header", path); goto out; }
    shape[nd++] = v;
    sp = end;
  }
  int ok = nd == d->ndim;
  for (int32_t i = 0; ok && i < nd; ++i) ok = shape[i] == d->shape[i];
  if (!ok) {
    char s[128];
    shape_str(d, s, sizeof s);
    snprintf(err, errn, "%s: shape differs from the compiled %s", path, s); goto out;
  }
  uint64_t nbytes = fr_desc_nbytes(d);
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
  if (argc != 4) {
    fprintf(stderr, "usage: %s --list | FUNC IN_DIR OUT_DIR\n", argv[0]);
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
