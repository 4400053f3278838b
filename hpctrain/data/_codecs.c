/* Chunk decoders for HDF5 filters, run without the GIL.
 *
 * h5py holds the GIL (and its own global lock) for the whole of H5Dread, so chunk
 * decompression through h5py is serial. hpctrain.data.codecs reads the stored chunk bytes
 * itself and undoes the filters here, in as many threads as it likes:
 *
 *   lzf_decompress_into(src, dst) -> int    LZF (h5py's filter 32000, liblzf's format)
 *   unshuffle_into(src, dst, itemsize)      inverse of HDF5's shuffle filter (2)
 *
 * and the loader's shuffled read of uncompressed rows (one copy, no staging buffer):
 *
 *   pread_rows(fd, offset, row_bytes, index, dst) -> None
 *       row r of the file range starting at offset goes to row index[r] of dst (one
 *       preadv per stretch of up to IOV_MAX rows; rows under SMALL_ROW bytes are read
 *       64 KiB at a time and copied; index[r] < 0 skips the row)
 *
 * Bytes of dst past the count lzf_decompress_into returns (and all of dst after an error)
 * are unspecified: the decoder copies in fixed-size blocks where dst has room.
 *
 * Both take buffer-protocol objects (bytes, bytearray, memoryview, numpy arrays: only their
 * bytes count), check every bound before touching memory, and release the GIL around the
 * byte work. Corrupt input is a ValueError naming what was wrong; they never read or write
 * outside the buffers they were given.
 *
 * The LZF format (written from its description, not from liblzf's code): a sequence of
 * instructions, each starting with a control byte `ctrl`:
 *   ctrl <  32: literal run: the next ctrl+1 input bytes are copied to the output;
 *   ctrl >= 32: back-reference: len = ctrl>>5 (if 7, add the next input byte), then
 *               distance = ((ctrl & 0x1f) << 8) + next input byte + 1; copy len+2 bytes
 *               from `distance` bytes back in the output (the ranges may overlap: a
 *               distance of 1 repeats the last byte).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

/* Outcome of the LZF decoder; the position fields say where it stopped. */
enum { LZF_OK = 0, LZF_TRUNC_LITERAL, LZF_TRUNC_REF, LZF_BEFORE_START,
       LZF_OUT_FULL_LITERAL, LZF_OUT_FULL_REF };

typedef struct {
    int status;
    size_t ip;      /* input position of the failing instruction's control byte */
    size_t op;      /* bytes written so far */
    size_t need;    /* length of the literal run / back-reference that failed */
    size_t dist;    /* distance of the failing back-reference */
} LzfResult;

static LzfResult lzf_decode(const uint8_t *in, size_t in_len, uint8_t *out, size_t out_len) {
    LzfResult r = {LZF_OK, 0, 0, 0, 0};
    size_t ip = 0, op = 0;
    while (ip < in_len) {
        size_t start = ip;
        unsigned ctrl = in[ip++];
        if (ctrl < 32) {
            size_t len = (size_t)ctrl + 1;
            if (len > in_len - ip) {
                r = (LzfResult){LZF_TRUNC_LITERAL, start, op, len, 0};
                return r;
            }
            if (len > out_len - op) {
                r = (LzfResult){LZF_OUT_FULL_LITERAL, start, op, len, 0};
                return r;
            }
            if (in_len - ip >= 32 && out_len - op >= 32) {
                /* Fixed-size copy (vector moves) of up to 32 bytes; the bytes past len are
                 * inside dst and are overwritten by the next instructions. */
                memcpy(out + op, in + ip, 16);
                if (len > 16) memcpy(out + op + 16, in + ip + 16, 16);
            } else {
                memcpy(out + op, in + ip, len);
            }
            ip += len;
            op += len;
        } else {
            size_t len = ctrl >> 5;
            if (len == 7) {
                if (ip >= in_len) {
                    r = (LzfResult){LZF_TRUNC_REF, start, op, 0, 0};
                    return r;
                }
                len += in[ip++];
            }
            if (ip >= in_len) {
                r = (LzfResult){LZF_TRUNC_REF, start, op, len + 2, 0};
                return r;
            }
            size_t dist = (((size_t)ctrl & 0x1f) << 8) + in[ip++] + 1;
            len += 2;
            if (dist > op) {
                r = (LzfResult){LZF_BEFORE_START, start, op, len, dist};
                return r;
            }
            if (len > out_len - op) {
                r = (LzfResult){LZF_OUT_FULL_REF, start, op, len, dist};
                return r;
            }
            uint8_t *d = out + op;
            const uint8_t *s = d - dist;
            if (dist >= 8 && out_len - op >= len + 8) {
                /* 8 bytes at a time: with dist >= 8 each 8-byte source was fully written
                 * before it is read, so this equals the byte-by-byte copy; the up to 7
                 * bytes written past len lie inside dst and are overwritten later. */
                for (size_t k = 0; k < len; k += 8) memcpy(d + k, s + k, 8);
            } else if (dist >= len) {
                memcpy(d, s, len);
            } else if (dist == 1) {
                memset(d, *s, len);
            } else {
                /* Overlapping: each copied byte may be one this reference just wrote. */
                for (size_t k = 0; k < len; k++) d[k] = s[k];
            }
            op += len;
        }
    }
    r.op = op;
    return r;
}

/* ------------------------------------------------------------------ buffers */

static int get_src(PyObject *obj, Py_buffer *view, const char *fn, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s: %s must be a C-contiguous buffer (bytes, bytearray, memoryview, "
                     "contiguous numpy array), got %.100s", fn, name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

static int get_dst(PyObject *obj, Py_buffer *view, const char *fn) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        Py_buffer probe;
        if (PyObject_GetBuffer(obj, &probe, PyBUF_SIMPLE) == 0) {
            PyBuffer_Release(&probe);
            PyErr_Format(PyExc_TypeError,
                         "%s: dst must be a writable buffer, got a read-only %.100s "
                         "(pass a bytearray or a writable C-contiguous numpy array)",
                         fn, Py_TYPE(obj)->tp_name);
        } else {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "%s: dst must be a writable C-contiguous buffer (bytearray, "
                         "contiguous numpy array), got %.100s", fn, Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    return 0;
}

static int overlap(const Py_buffer *a, const Py_buffer *b) {
    const char *pa = (const char *)a->buf, *pb = (const char *)b->buf;
    if (a->len == 0 || b->len == 0) return 0;
    return pa < pb + b->len && pb < pa + a->len;
}

/* ------------------------------------------------------------------ lzf */

static PyObject *lzf_decompress_into(PyObject *Py_UNUSED(module), PyObject *args) {
    const char *fn = "lzf_decompress_into";
    PyObject *src_obj, *dst_obj;
    if (!PyArg_ParseTuple(args, "OO:lzf_decompress_into", &src_obj, &dst_obj)) return NULL;
    Py_buffer src, dst;
    if (get_src(src_obj, &src, fn, "src") < 0) return NULL;
    if (get_dst(dst_obj, &dst, fn) < 0) { PyBuffer_Release(&src); return NULL; }
    if (overlap(&src, &dst)) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        PyErr_Format(PyExc_ValueError, "%s: src and dst overlap in memory; decode into a separate buffer", fn);
        return NULL;
    }
    LzfResult r;
    Py_BEGIN_ALLOW_THREADS
    r = lzf_decode((const uint8_t *)src.buf, (size_t)src.len, (uint8_t *)dst.buf, (size_t)dst.len);
    Py_END_ALLOW_THREADS
    Py_ssize_t in_len = src.len, out_len = dst.len;
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    switch (r.status) {
    case LZF_OK:
        return PyLong_FromSize_t(r.op);
    case LZF_TRUNC_REF:
        PyErr_Format(PyExc_ValueError,
                     "lzf: truncated input: the back-reference at input byte %zu needs more bytes "
                     "than the %zd of the input", r.ip, in_len);
        return NULL;
    case LZF_TRUNC_LITERAL:
        PyErr_Format(PyExc_ValueError,
                     "lzf: truncated input: the literal run of %zu bytes at input byte %zu runs past "
                     "the end of the input (%zd bytes)", r.need, r.ip, in_len);
        return NULL;
    case LZF_BEFORE_START:
        PyErr_Format(PyExc_ValueError,
                     "lzf: corrupt input: the back-reference at input byte %zu points %zu bytes back "
                     "but only %zu bytes were decoded (before the start of the output)",
                     r.ip, r.dist, r.op);
        return NULL;
    case LZF_OUT_FULL_LITERAL:
    case LZF_OUT_FULL_REF:
        PyErr_Format(PyExc_ValueError,
                     "lzf: output too small: the %s of %zu bytes at input byte %zu would write past "
                     "the end of the %zd-byte output (%zu bytes already decoded; corrupt input or "
                     "wrong output size)",
                     r.status == LZF_OUT_FULL_LITERAL ? "literal run" : "back-reference",
                     r.need, r.ip, out_len, r.op);
        return NULL;
    }
    PyErr_SetString(PyExc_SystemError, "lzf: unknown decoder status");
    return NULL;
}

/* ------------------------------------------------------------------ unshuffle */

/* Byte b of element i is at src[b*n + i]; writes go sequentially through dst. */
#define UNSHUFFLE_FIXED(S)                                                       \
    static void unshuffle_##S(const uint8_t *src, uint8_t *dst, size_t n) {      \
        for (size_t i = 0; i < n; i++) {                                         \
            uint8_t *d = dst + i * (S);                                          \
            for (size_t b = 0; b < (S); b++) d[b] = src[b * n + i];              \
        }                                                                        \
    }
UNSHUFFLE_FIXED(2)
UNSHUFFLE_FIXED(4)
UNSHUFFLE_FIXED(8)

static void unshuffle_any(const uint8_t *src, uint8_t *dst, size_t n, size_t s) {
    /* Blocks of elements, one byte plane at a time within a block: each block's output
     * (BLOCK * s bytes) stays in L1 while its s planes are scattered into it. */
    enum { BLOCK = 256 };
    for (size_t i0 = 0; i0 < n; i0 += BLOCK) {
        size_t m = n - i0 < BLOCK ? n - i0 : BLOCK;
        uint8_t *block = dst + i0 * s;
        for (size_t b = 0; b < s; b++) {
            const uint8_t *p = src + b * n + i0;
            uint8_t *d = block + b;
            for (size_t i = 0; i < m; i++) d[i * s] = p[i];
        }
    }
}

static void unshuffle(const uint8_t *src, uint8_t *dst, size_t nbytes, size_t s) {
    size_t n = nbytes / s;
    if (s <= 1 || n <= 1) {  /* the shuffle filter leaves such buffers as they are */
        memcpy(dst, src, nbytes);
        return;
    }
    switch (s) {
    case 2: unshuffle_2(src, dst, n); break;
    case 4: unshuffle_4(src, dst, n); break;
    case 8: unshuffle_8(src, dst, n); break;
    default: unshuffle_any(src, dst, n, s); break;
    }
    size_t done = n * s;  /* leftover bytes (nbytes % s) are stored unchanged at the end */
    if (done < nbytes) memcpy(dst + done, src + done, nbytes - done);
}

static PyObject *unshuffle_into(PyObject *Py_UNUSED(module), PyObject *args) {
    const char *fn = "unshuffle_into";
    PyObject *src_obj, *dst_obj;
    Py_ssize_t itemsize;
    if (!PyArg_ParseTuple(args, "OOn:unshuffle_into", &src_obj, &dst_obj, &itemsize)) return NULL;
    if (itemsize < 1) {
        PyErr_Format(PyExc_ValueError, "%s: itemsize must be >= 1, got %zd", fn, itemsize);
        return NULL;
    }
    Py_buffer src, dst;
    if (get_src(src_obj, &src, fn, "src") < 0) return NULL;
    if (get_dst(dst_obj, &dst, fn) < 0) { PyBuffer_Release(&src); return NULL; }
    if (src.len != dst.len) {
        PyErr_Format(PyExc_ValueError, "%s: dst has %zd bytes but src has %zd; they must be equal",
                     fn, dst.len, src.len);
    } else if (overlap(&src, &dst)) {
        PyErr_Format(PyExc_ValueError, "%s: src and dst overlap in memory; unshuffle into a separate buffer", fn);
    } else {
        Py_BEGIN_ALLOW_THREADS
        unshuffle((const uint8_t *)src.buf, (uint8_t *)dst.buf, (size_t)src.len, (size_t)itemsize);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ pread_rows */

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif
#define ROWS_IOV (IOV_MAX < 1024 ? IOV_MAX : 1024)

/* Read rows [0, n) of the file range at `offset` into dst rows index[r] (skipping rows with
 * index < 0), merging rows that are consecutive in both file and dst into one iovec. Returns
 * 0, or -1 with errno set (0 = the file ended early), *failed_row = first row not read. */
static int scatter_rows(int fd, int64_t offset, size_t row_bytes, const int64_t *index, size_t n,
                        uint8_t *dst, size_t *failed_row) {
    struct iovec iov[ROWS_IOV];
    size_t r = 0;
    while (r < n) {
        while (r < n && index[r] < 0) r++;  /* skipped rows: not read at all */
        if (r == n) break;
        size_t first = r, cnt = 0, total = 0;
        while (r < n && index[r] >= 0) {
            uint8_t *at = dst + (size_t)index[r] * row_bytes;
            if (cnt && (uint8_t *)iov[cnt - 1].iov_base + iov[cnt - 1].iov_len == at) {
                iov[cnt - 1].iov_len += row_bytes;
            } else {
                if (cnt == ROWS_IOV) break;
                iov[cnt].iov_base = at;
                iov[cnt].iov_len = row_bytes;
                cnt++;
            }
            total += row_bytes;
            r++;
        }
        /* iov covers file rows [first, r): read them, resuming after short reads */
        off_t pos = (off_t)(offset + (int64_t)(first * row_bytes));
        size_t k = 0;
        while (total > 0) {
            ssize_t got = preadv(fd, iov + k, (int)(cnt - k), pos);
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) {
                if (got == 0) errno = 0;
                *failed_row = first;
                return -1;
            }
            pos += got;
            total -= (size_t)got;
            while (got > 0 && k < cnt) {
                if ((size_t)got >= iov[k].iov_len) {
                    got -= (ssize_t)iov[k].iov_len;
                    k++;
                } else {
                    iov[k].iov_base = (uint8_t *)iov[k].iov_base + got;
                    iov[k].iov_len -= (size_t)got;
                    got = 0;
                }
            }
        }
    }
    return 0;
}

/* Rows narrower than this are read a stretch at a time into a buffer and copied to their
 * places: the kernel's cost per iovec (~50 ns) is more than copying such a row, and an
 * 8-byte label per iovec made the label key cost as much as the 1 KiB feature rows. */
#define SMALL_ROW 256
#define STAGE_BYTES (64 * 1024)

/* pread exactly len bytes at pos (resuming after short reads). 0, or -1 with errno set
 * (0 = the file ended early). */
static int pread_full(int fd, uint8_t *buf, size_t len, off_t pos) {
    while (len > 0) {
        ssize_t got = pread(fd, buf, len, pos);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            if (got == 0) errno = 0;
            return -1;
        }
        buf += got;
        pos += got;
        len -= (size_t)got;
    }
    return 0;
}

/* scatter_rows for small rows: the same contract, through a STAGE_BYTES buffer. */
static int stage_rows(int fd, int64_t offset, size_t row_bytes, const int64_t *index, size_t n,
                      uint8_t *dst, size_t *failed_row) {
    size_t per = STAGE_BYTES / row_bytes;
    uint8_t *buf = malloc(per * row_bytes);
    if (!buf) {
        errno = ENOMEM;
        *failed_row = 0;
        return -1;
    }
    size_t r = 0;
    while (r < n) {
        while (r < n && index[r] < 0) r++;  /* skipped rows: not read at all */
        if (r == n) break;
        size_t end = r + per < n ? r + per : n;
        while (index[end - 1] < 0) end--;  /* stops at r, whose index is >= 0 */
        off_t pos = (off_t)(offset + (int64_t)(r * row_bytes));
        if (pread_full(fd, buf, (end - r) * row_bytes, pos) < 0) {
            int err = errno;
            free(buf);
            errno = err;
            *failed_row = r;
            return -1;
        }
        for (size_t q = r; q < end; q++) {
            if (index[q] >= 0) memcpy(dst + (size_t)index[q] * row_bytes, buf + (q - r) * row_bytes, row_bytes);
        }
        r = end;
    }
    free(buf);
    return 0;
}

static PyObject *pread_rows(PyObject *Py_UNUSED(module), PyObject *args) {
    const char *fn = "pread_rows";
    int fd;
    long long offset;
    Py_ssize_t row_bytes;
    PyObject *index_obj, *dst_obj;
    if (!PyArg_ParseTuple(args, "iLnOO:pread_rows", &fd, &offset, &row_bytes, &index_obj, &dst_obj)) return NULL;
    if (row_bytes < 1 || offset < 0) {
        PyErr_Format(PyExc_ValueError, "%s: row_bytes must be >= 1 and offset >= 0 (got %zd, %lld)",
                     fn, row_bytes, offset);
        return NULL;
    }
    Py_buffer index, dst;
    if (get_src(index_obj, &index, fn, "index") < 0) return NULL;
    if (get_dst(dst_obj, &dst, fn) < 0) { PyBuffer_Release(&index); return NULL; }
    size_t n = (size_t)index.len / sizeof(int64_t);
    size_t dst_rows = (size_t)dst.len / (size_t)row_bytes;
    const int64_t *idx = (const int64_t *)index.buf;
    int bad = 0;
    if (index.len % (Py_ssize_t)sizeof(int64_t) || ((uintptr_t)index.buf % sizeof(int64_t))) {
        PyErr_Format(PyExc_ValueError, "%s: index must be an aligned int64 array", fn);
        bad = 1;
    }
    for (size_t r = 0; !bad && r < n; r++) {
        if (idx[r] >= (int64_t)dst_rows) {
            PyErr_Format(PyExc_ValueError, "%s: index[%zu] = %lld is past the %zu rows of dst",
                         fn, r, (long long)idx[r], dst_rows);
            bad = 1;
        }
    }
    int rc = 0, err = 0;
    size_t failed = 0;
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        if ((size_t)row_bytes < SMALL_ROW) {
            rc = stage_rows(fd, (int64_t)offset, (size_t)row_bytes, idx, n, (uint8_t *)dst.buf, &failed);
        } else {
            rc = scatter_rows(fd, (int64_t)offset, (size_t)row_bytes, idx, n, (uint8_t *)dst.buf, &failed);
        }
        err = errno;
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&index);
    PyBuffer_Release(&dst);
    if (bad) return NULL;
    if (rc < 0) {
        if (err == 0) {
            PyErr_Format(PyExc_OSError, "file ended while reading row %zu of the %zu rows at byte %lld",
                         failed, n, offset);
        } else {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
        }
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ module */

static PyMethodDef module_methods[] = {
    {"lzf_decompress_into", lzf_decompress_into, METH_VARARGS,
     "lzf_decompress_into(src, dst) -> int\n\n"
     "Decode the LZF stream in src into dst; return the number of bytes written.\n"
     "ValueError on corrupt or truncated input or a too small dst. Releases the GIL."},
    {"unshuffle_into", unshuffle_into, METH_VARARGS,
     "unshuffle_into(src, dst, itemsize) -> None\n\n"
     "Undo HDF5's shuffle filter: byte b of element i is read from src[b*n + i],\n"
     "n = len(src) // itemsize; the len(src) % itemsize trailing bytes are copied as they are.\n"
     "len(dst) must equal len(src). Releases the GIL."},
    {"pread_rows", pread_rows, METH_VARARGS,
     "pread_rows(fd, offset, row_bytes, index, dst) -> None\n\n"
     "Read len(index) rows of row_bytes bytes from fd at offset; row r goes to row index[r]\n"
     "of dst (int64 index; negative = skip the row). One preadv per stretch of up to IOV_MAX\n"
     "rows, rows consecutive in file and dst merged. OSError when the file ends early.\n"
     "Releases the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_codecs",
    "HDF5 chunk decoders (LZF, unshuffle) that run without the GIL, for hpctrain.data.codecs",
    -1, module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__codecs(void) {
    return PyModule_Create(&moduledef);
}
