/* Shared-memory flag synchronisation and small all-reduces for ranks on one node.
 *
 * Every local rank owns one region of an MPI-3 shared window (allocated by hpctrain.comm):
 *
 *   [0, 64)                      flag: uint64 sequence number, release-stored
 *   [128, 128 + 2*HDR)           two header slots (one per sequence parity)
 *   [256, 256 + 2*slot_bytes)    two data slots   (one per sequence parity)
 *
 * One exchange (collective number `seq`): write my header/data into the slots of parity
 * seq&1, release-store flag = seq, wait until every peer's flag >= seq (acquire), compare
 * headers, reduce every rank's data slot in rank order into the caller's buffer (so the
 * result is bitwise identical on every rank).
 *
 * Why two parities are enough: a rank publishes seq+1 only after it finished reading the
 * slots of seq, and a rank starts writing the slots of seq+2 only after it saw every flag
 * reach seq+1. One flag round trip per collective, no MPI barrier.
 *
 * The wait spins (pause), then yields, then sleeps; it gives up after `timeout` seconds
 * (0: never) so that the caller can report the ranks that did not arrive and abort.
 *
 * Fault-tolerant (elastic) jobs: a rank that leaves a group after a failure stores
 * FLAG_ABANDONED in its flag (abandon()), and a context given the local ranks' process ids
 * checks, while a wait is long, that the ranks it waits for still exist. Either ends the
 * wait with ST_ABANDONED: MPI's failure detection cannot interrupt a wait on shared memory.
 * The GIL is released while waiting and reducing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <sys/types.h>
#include <string.h>
#include <time.h>

#include "_kernels.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define FLAG_OFF 0
#define HDR_OFF 128
#define HDR_BYTES 64
#define DATA_OFF 256

enum { ST_OK = 0, ST_TIMEOUT = 1, ST_MISMATCH = 2, ST_ABANDONED = 3 };
#define FLAG_ABANDONED UINT64_MAX


typedef struct {
    PyObject_HEAD
    char **regions;     /* base address of every local rank's region; NULL until __init__ */
    Py_buffer *views;   /* the regions' buffers, held while the context uses them */
    int nranks;
    int rank;
    Py_ssize_t slot_bytes;
    uint64_t seq;
    long spin_limit;    /* pause-loop iterations before yielding (0 when oversubscribed) */
    pid_t *pids;        /* every local rank's process id, or NULL: no liveness checks */
    int gone;           /* the local rank a wait found abandoned or gone, else -1 */
} Ctx;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline volatile uint64_t *flag_of(Ctx *c, int q) {
    return (volatile uint64_t *)(c->regions[q] + FLAG_OFF);
}
static inline char *hdr_of(Ctx *c, int q, uint64_t seq) {
    return c->regions[q] + HDR_OFF + (seq & 1) * HDR_BYTES;
}
static inline char *data_of(Ctx *c, int q, uint64_t seq) {
    return c->regions[q] + DATA_OFF + (seq & 1) * c->slot_bytes;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A process that no longer exists (checked only in long waits: one kill(pid, 0)). */
static int is_gone(Ctx *c, int q) {
    return c->pids && c->pids[q] > 0 && kill(c->pids[q], 0) != 0 && errno == ESRCH;
}

/* Wait until every rank's flag reaches seq. Returns ST_OK, ST_TIMEOUT or ST_ABANDONED. */
static int wait_all(Ctx *c, uint64_t seq, double timeout) {
    int q = 0;
    long spins = 0;
    double start = 0.0;
    while (q < c->nranks) {
        uint64_t flag = __atomic_load_n(flag_of(c, q), __ATOMIC_ACQUIRE);
        if (flag >= seq) {
            if (flag == FLAG_ABANDONED) { c->gone = q; return ST_ABANDONED; }
            q++;
            continue;
        }
        spins++;
        if (spins < c->spin_limit) {
            cpu_relax();
            continue;
        }
        if ((spins & 255) == 0 || start == 0.0) {
            double t = now_s();
            if (start == 0.0) start = t;
            double waited = t - start;
            if (timeout > 0 && waited > timeout) return ST_TIMEOUT;
            if (waited > 0.01) {          /* a long wait: stop burning the core */
                if (is_gone(c, q)) { c->gone = q; return ST_ABANDONED; }
                struct timespec nap = {0, 50000};
                nanosleep(&nap, NULL);
                continue;
            }
        }
        sched_yield();
    }
    return ST_OK;
}

#define REDUCE_LOOP(T, EXPR)                                                   \
    do {                                                                       \
        T *restrict o = (T *)out;                                              \
        for (int q = 0; q < c->nranks; q++) {                                  \
            const T *restrict s = (const T *)data_of(c, q, seq);               \
            if (q == 0) { memcpy(o, s, n * sizeof(T)); continue; }             \
            for (Py_ssize_t i = 0; i < n; i++) { T a = o[i], b = s[i]; o[i] = (EXPR); } \
        }                                                                      \
    } while (0)

#define REDUCE_TYPE(T)                                                         \
    do {                                                                       \
        switch (op) {                                                          \
        case OP_SUM: case OP_AVG: REDUCE_LOOP(T, a + b); break;                \
        case OP_PROD: REDUCE_LOOP(T, a * b); break;                            \
        case OP_MIN: REDUCE_LOOP(T, KERNEL_MIN(a, b)); break;                     \
        case OP_MAX: REDUCE_LOOP(T, KERNEL_MAX(a, b)); break;                     \
        default: return -1;                                                    \
        }                                                                      \
        if (op == OP_AVG) {                                                    \
            T *o = (T *)out;                                                   \
            for (Py_ssize_t i = 0; i < n; i++) o[i] = (T)(o[i] / c->nranks);   \
        }                                                                      \
    } while (0)

/* out <- reduction of every rank's data slot of `seq`; n elements. -1: unsupported. */
static int reduce_slots(Ctx *c, uint64_t seq, void *out, Py_ssize_t n, int dtype, int op) {
    if (!itemsize_of(dtype)) return -1;
    FOR_KERNEL_DTYPE(dtype, REDUCE_TYPE)
    return 0;
}

/* ------------------------------------------------------------------ zero-copy slice reduction
 * reduce_to_all(dsts, srcs, count, dtype, op, divisor, nontemporal): for every element i of
 * the slice, acc = srcs[0][i] op srcs[1][i] op ... (rank order), divided by `divisor` when
 * op is avg, stored into every dsts[k][i]. One pass, block by block through an L1-sized
 * accumulator, so each source is read once and each destination written once; with
 * `nontemporal`, destinations are written with streaming stores (no read-for-ownership of
 * lines that are fully overwritten: a third less memory traffic once buffers exceed L3). */
#define BLOCK_BYTES 8192

static void store_block(char *dst, const char *src, size_t bytes, int nontemporal) {
#if defined(__SSE2__)
    if (nontemporal) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        if (head > bytes) head = bytes;
        memcpy(dst, src, head);
        size_t i = head;
        for (; i + 16 <= bytes; i += 16)
            _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
        memcpy(dst + i, src + i, bytes - i);
        return;
    }
#else
    (void)nontemporal;
#endif
    memcpy(dst, src, bytes);
}

#define SLICE_LOOP(T, EXPR)                                                            \
    do {                                                                               \
        T acc[BLOCK_BYTES / sizeof(T)];                                                \
        const Py_ssize_t B = BLOCK_BYTES / sizeof(T);                                  \
        for (Py_ssize_t start = 0; start < count; start += B) {                        \
            Py_ssize_t m = count - start < B ? count - start : B;                      \
            memcpy(acc, (const T *)srcs[0] + start, m * sizeof(T));                    \
            for (int q = 1; q < nsrc; q++) {                                           \
                const T *restrict s = (const T *)srcs[q] + start;                      \
                for (Py_ssize_t i = 0; i < m; i++) { T a = acc[i], b = s[i]; acc[i] = (EXPR); } \
            }                                                                          \
            if (op == OP_AVG && divisor > 1)                                           \
                for (Py_ssize_t i = 0; i < m; i++) acc[i] = (T)(acc[i] / divisor);     \
            for (int k = 0; k < ndst; k++)                                             \
                store_block((char *)((T *)dsts[k] + start), (const char *)acc, m * sizeof(T), nontemporal); \
        }                                                                              \
    } while (0)

#define SLICE_TYPE(T)                                                                  \
    do {                                                                               \
        switch (op) {                                                                  \
        case OP_SUM: case OP_AVG: SLICE_LOOP(T, a + b); break;                         \
        case OP_PROD: SLICE_LOOP(T, a * b); break;                                     \
        case OP_MIN: SLICE_LOOP(T, KERNEL_MIN(a, b)); break;                              \
        case OP_MAX: SLICE_LOOP(T, KERNEL_MAX(a, b)); break;                              \
        }                                                                              \
    } while (0)

static void reduce_slices(char **dsts, int ndst, char **srcs, int nsrc, Py_ssize_t count, int dtype, int op,
                          long divisor, int nontemporal) {
    FOR_KERNEL_DTYPE(dtype, SLICE_TYPE)
#if defined(__SSE2__)
    if (nontemporal) _mm_sfence();  /* streaming stores are weakly ordered: fence before any flag */
#endif
}

/* A sequence of buffers, each C-contiguous (writable when asked) and at least `need` bytes
 * long; their addresses in `*out`. 0, or -1 with an exception set (nothing held). */
typedef struct {
    Py_buffer *views;
    char **at;
    int n;
} Bufs;

static void bufs_release(Bufs *b) {
    for (int i = 0; i < b->n; i++) PyBuffer_Release(&b->views[i]);
    PyMem_Free(b->views);
    PyMem_Free(b->at);
    b->views = NULL; b->at = NULL; b->n = 0;
}

static int bufs_acquire(Bufs *b, PyObject *obj, int writable, Py_ssize_t need, const char *what) {
    b->views = NULL; b->at = NULL; b->n = 0;
    PyObject *seq = PySequence_Fast(obj, "expected a sequence of buffers");
    if (!seq) return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (len > 1 << 20) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%s: %zd buffers", what, len);
        return -1;
    }
    b->views = PyMem_Calloc(len ? len : 1, sizeof(Py_buffer));
    b->at = PyMem_Calloc(len ? len : 1, sizeof(char *));
    if (!b->views || !b->at) { Py_DECREF(seq); bufs_release(b); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < len; i++) {
        int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &b->views[i], flags) < 0) {
            Py_DECREF(seq); bufs_release(b); return -1;
        }
        b->n = (int)i + 1;
        b->at[i] = (char *)b->views[i].buf;
        if (b->views[i].len < need) {
            PyErr_Format(PyExc_ValueError, "%s: buffer %zd holds %zd bytes, %zd needed", what, i,
                         b->views[i].len, need);
            Py_DECREF(seq); bufs_release(b); return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

static int overlap(const char *a, const char *b, Py_ssize_t len) {
    return a < b + len && b < a + len;
}

static PyObject *reduce_to_all(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *dst_obj, *src_obj;
    Py_ssize_t count;
    int dtype, op, nontemporal;
    long divisor;
    if (!PyArg_ParseTuple(args, "OOniilp", &dst_obj, &src_obj, &count, &dtype, &op, &divisor, &nontemporal))
        return NULL;
    int item = itemsize_of(dtype);
    if (item == 0 || op < OP_SUM || op > OP_PROD || count < 0 || count > PY_SSIZE_T_MAX / 8) {
        PyErr_Format(PyExc_ValueError, "reduce_to_all: unsupported dtype %d / op %d / count %zd", dtype, op, count);
        return NULL;
    }
    Py_ssize_t bytes = count * item;
    Bufs dsts, srcs;
    if (bufs_acquire(&dsts, dst_obj, 1, bytes, "reduce_to_all (destinations)") < 0) return NULL;
    if (bufs_acquire(&srcs, src_obj, 0, bytes, "reduce_to_all (sources)") < 0) { bufs_release(&dsts); return NULL; }
    const char *problem = srcs.n < 1 ? "need at least one source" : NULL;
    /* A destination is written after every source of its block was read: it may be a source
     * exactly (in place), but must not overlap another destination or straddle a source. */
    for (int k = 0; k < dsts.n && !problem; k++) {
        for (int j = 0; j < dsts.n && !problem; j++)
            if (j != k && overlap(dsts.at[k], dsts.at[j], bytes)) problem = "destinations overlap";
        for (int q = 0; q < srcs.n && !problem; q++)
            if (srcs.at[q] != dsts.at[k] && overlap(dsts.at[k], srcs.at[q], bytes))
                problem = "a destination partly overlaps a source";
    }
    if (problem) {
        bufs_release(&dsts); bufs_release(&srcs);
        PyErr_Format(PyExc_ValueError, "reduce_to_all: %s", problem);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (count) reduce_slices(dsts.at, dsts.n, srcs.at, srcs.n, count, dtype, op, divisor, nontemporal);
    Py_END_ALLOW_THREADS
    bufs_release(&dsts);
    bufs_release(&srcs);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ Python type */
static void Ctx_release(Ctx *self) {
    for (int i = 0; self->views && i < self->nranks; i++) PyBuffer_Release(&self->views[i]);
    PyMem_Free(self->views);
    PyMem_Free(self->regions);
    PyMem_Free(self->pids);
    self->views = NULL;
    self->regions = NULL;
    self->pids = NULL;
    self->nranks = 0;
}

static void Ctx_dealloc(Ctx *self) {
    Ctx_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Every method needs the regions: a Ctx made without __init__ (or whose __init__ failed)
 * raises instead of reading through a NULL pointer. */
static int ready(Ctx *self) {
    if (self->regions) return 1;
    PyErr_SetString(PyExc_RuntimeError, "_shmsync.Ctx is not initialised (its __init__ did not run or failed)");
    return 0;
}

static int Ctx_init(Ctx *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"regions", "rank", "slot_bytes", "spin_limit", "pids", NULL};
    PyObject *regions, *pids = Py_None;
    int rank;
    Py_ssize_t slot_bytes;
    long spin_limit;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oinl|O", kwlist, &regions, &rank, &slot_bytes, &spin_limit,
                                     &pids))
        return -1;
    Ctx_release(self);
    if (slot_bytes < 0 || slot_bytes > (PY_SSIZE_T_MAX - DATA_OFF) / 2) {
        PyErr_Format(PyExc_ValueError, "Ctx: slot_bytes must be >= 0, got %zd", slot_bytes);
        return -1;
    }
    /* each region: flag, header slots and two data slots, all inside the buffer */
    Bufs b;
    if (bufs_acquire(&b, regions, 1, DATA_OFF + 2 * slot_bytes, "Ctx regions") < 0) return -1;
    if (b.n < 1 || rank < 0 || rank >= b.n) {
        bufs_release(&b);
        PyErr_SetString(PyExc_ValueError, "Ctx: need at least one region and 0 <= rank < len(regions)");
        return -1;
    }
    self->views = b.views;
    self->regions = b.at;
    self->nranks = b.n;
    self->rank = rank;
    self->slot_bytes = slot_bytes;
    self->spin_limit = spin_limit;
    self->gone = -1;
    self->seq = __atomic_load_n(flag_of(self, rank), __ATOMIC_ACQUIRE);
    if (pids != Py_None) {
        PyObject *seq = PySequence_Fast(pids, "pids must be a sequence of process ids");
        if (!seq) { Ctx_release(self); return -1; }
        if (PySequence_Fast_GET_SIZE(seq) != self->nranks) {
            Py_DECREF(seq);
            Ctx_release(self);
            PyErr_SetString(PyExc_ValueError, "Ctx: pids must hold one process id per region");
            return -1;
        }
        self->pids = PyMem_Calloc(self->nranks, sizeof(pid_t));
        for (int q = 0; self->pids && q < self->nranks; q++)
            self->pids[q] = (pid_t)PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, q));
        Py_DECREF(seq);
        if (!self->pids || PyErr_Occurred()) { Ctx_release(self); if (!PyErr_Occurred()) PyErr_NoMemory(); return -1; }
    }
    return 0;
}

/* The optional 64-byte agreement header: 1 acquired, 0 None, -1 error (exception set). */
static int header_acquire(PyObject *obj, Py_buffer *hdr) {
    if (obj == Py_None) return 0;
    if (PyObject_GetBuffer(obj, hdr, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (hdr->len != HDR_BYTES) {
        PyBuffer_Release(hdr);
        PyErr_Format(PyExc_ValueError, "header must be %d bytes", HDR_BYTES);
        return -1;
    }
    return 1;
}

/* exchange(header, buf, dtype, op, timeout[, header_seq]) -> status
 * header: a 64-byte buffer or None; buf: a writable C-contiguous buffer or None;
 * header_seq >= 0: the header's first word (its sequence number) is this instead, so that a
 * caller can pass one packed header per call site rather than pack one per call. */
static PyObject *Ctx_exchange(Ctx *self, PyObject *args) {
    PyObject *hdr_obj, *buf_obj;
    int dtype, op;
    double timeout;
    long long header_seq = -1;
    if (!ready(self) || !PyArg_ParseTuple(args, "OOiid|L", &hdr_obj, &buf_obj, &dtype, &op, &timeout, &header_seq))
        return NULL;
    Py_buffer hdr = {0}, buf = {0};
    int have_hdr = header_acquire(hdr_obj, &hdr), have_buf = buf_obj != Py_None;
    if (have_hdr < 0) return NULL;
    unsigned char mine[HDR_BYTES]; /* this rank's header as sent: compared with every rank's */
    if (have_hdr) {
        memcpy(mine, hdr.buf, HDR_BYTES);
        if (header_seq >= 0) {
            int64_t word = (int64_t)header_seq;
            memcpy(mine, &word, sizeof word);
        }
    }
    Py_ssize_t n = 0;
    if (have_buf) {
        if (PyObject_GetBuffer(buf_obj, &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            if (have_hdr) PyBuffer_Release(&hdr);
            return NULL;
        }
        int item = itemsize_of(dtype);
        if (item == 0 || buf.len > self->slot_bytes || buf.len % item || op < OP_SUM || op > OP_PROD) {
            if (have_hdr) PyBuffer_Release(&hdr);
            PyBuffer_Release(&buf);
            PyErr_Format(PyExc_ValueError, "exchange: unsupported dtype %d / op %d or %zd bytes > slot %zd",
                         dtype, op, buf.len, self->slot_bytes);
            return NULL;
        }
        n = buf.len / item;
    }
    int status = ST_OK;
    uint64_t seq = ++self->seq;
    Py_BEGIN_ALLOW_THREADS
    if (have_hdr) memcpy(hdr_of(self, self->rank, seq), mine, HDR_BYTES);
    if (have_buf) memcpy(data_of(self, self->rank, seq), buf.buf, buf.len);
    __atomic_store_n(flag_of(self, self->rank), seq, __ATOMIC_RELEASE);
    status = wait_all(self, seq, timeout);
    if (status == ST_OK && have_hdr) {
        for (int q = 0; q < self->nranks; q++)
            if (memcmp(hdr_of(self, q, seq), mine, HDR_BYTES) != 0) { status = ST_MISMATCH; break; }
    }
    if (status == ST_OK && have_buf && n) reduce_slots(self, seq, buf.buf, n, dtype, op);
    Py_END_ALLOW_THREADS
    if (have_hdr) PyBuffer_Release(&hdr);
    if (have_buf) PyBuffer_Release(&buf);
    return PyLong_FromLong(status);
}

/* allreduce_piped(buffers, dtype, op, divisor, header, timeout, segment_bytes) -> status
 *
 * The all-reduce of private memory larger than a data slot, pipelined through the data slots
 * in segments of at most `segment_bytes` (so the staging stays in cache). `buffers` is one
 * writable buffer or a list of them, reduced as their concatenation (gradient fusion with no
 * bucket to copy into). Per segment:
 *   1. copy the parts of the segment other ranks own into my data slot (with several
 *      buffers: the whole segment); flag A; wait for all;
 *   2. reduce the part I own from every rank's slot — my own part straight from my buffer
 *      when there is one — in rank order, into my slot (and my buffer); flag B; wait;
 *   3. copy every rank's reduced part from its slot into my buffer(s).
 * Each element is reduced by one rank only, so the result is bitwise identical everywhere.
 * Memory traffic per rank: the buffers read and written once, plus cache-resident staging.
 *
 * Segment k uses data slot parity (seq0 + 1 + k) & 1, and the segment count is even, so the
 * first segment never writes the parity the collective before this one used, and the
 * collective after this one (seq0 + 2K + 1) never writes the parity of the last segment; a
 * segment writes the parity of segment k - 2 only after every rank passed flag B of k - 1,
 * i.e. finished copying out k - 2. The header (agreement check) rides on the first flag. */
typedef struct {
    Py_buffer *views;
    Py_ssize_t *starts;  /* byte offset of each buffer in the concatenation; starts[n] = total */
    int n;
} VBuf;

/* Copy bytes [off, off + len) of the concatenation to (to_mem) or from `mem`. */
static void vcopy(const VBuf *v, Py_ssize_t off, Py_ssize_t len, char *mem, int to_mem) {
    int lo = 0, hi = v->n - 1;
    while (lo < hi) {  /* the last buffer starting at or before off */
        int mid = (lo + hi + 1) / 2;
        if (v->starts[mid] <= off) lo = mid; else hi = mid - 1;
    }
    for (int i = lo; len > 0 && i < v->n; i++) {
        Py_ssize_t in = off - v->starts[i], avail = v->starts[i + 1] - off;
        if (avail <= 0) continue;
        Py_ssize_t m = len < avail ? len : avail;
        char *p = (char *)v->views[i].buf + in;
        if (to_mem) memcpy(mem, p, m); else memcpy(p, mem, m);
        mem += m; off += m; len -= m;
    }
}

static void vbuf_release(VBuf *v) {
    for (int i = 0; i < v->n; i++) PyBuffer_Release(&v->views[i]);
    PyMem_Free(v->views);
    PyMem_Free(v->starts);
    v->views = NULL; v->starts = NULL; v->n = 0;
}

/* One buffer or a list/tuple of buffers, each writable, C-contiguous, whole items. */
static int vbuf_acquire(VBuf *v, PyObject *obj, int item) {
    int is_list = PyList_Check(obj) || PyTuple_Check(obj);
    PyObject *seq = is_list ? PySequence_Fast(obj, "buffers") : NULL;
    Py_ssize_t n = is_list ? PySequence_Fast_GET_SIZE(seq) : 1;
    v->n = 0;
    v->views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    v->starts = PyMem_Calloc(n + 1, sizeof(Py_ssize_t));
    if (!v->views || !v->starts) { Py_XDECREF(seq); vbuf_release(v); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = is_list ? PySequence_Fast_GET_ITEM(seq, i) : obj;
        if (PyObject_GetBuffer(o, &v->views[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            Py_XDECREF(seq); vbuf_release(v); return -1;
        }
        v->n = (int)i + 1;
        if (v->views[i].len % item) {
            Py_XDECREF(seq); vbuf_release(v);
            PyErr_Format(PyExc_ValueError, "allreduce_piped: buffer %zd is not a whole number of %d-byte items", i, item);
            return -1;
        }
        v->starts[i + 1] = v->starts[i] + v->views[i].len;
    }
    Py_XDECREF(seq);
    return 0;
}

static PyObject *Ctx_allreduce_piped(Ctx *self, PyObject *args) {
    PyObject *buf_obj, *hdr_obj;
    int dtype, op;
    long divisor;
    double timeout;
    Py_ssize_t seg_bytes;
    if (!ready(self) || !PyArg_ParseTuple(args, "OiilOdn", &buf_obj, &dtype, &op, &divisor, &hdr_obj, &timeout,
                                          &seg_bytes))
        return NULL;
    int item = itemsize_of(dtype);
    if (item == 0 || op < OP_SUM || op > OP_PROD) {
        PyErr_Format(PyExc_ValueError, "allreduce_piped: unsupported dtype %d / op %d", dtype, op);
        return NULL;
    }
    if (seg_bytes > self->slot_bytes) seg_bytes = self->slot_bytes;
    if (seg_bytes < item * (Py_ssize_t)self->nranks) {
        PyErr_Format(PyExc_ValueError, "allreduce_piped: segments of %zd bytes are too small (slot %zd bytes)",
                     seg_bytes, self->slot_bytes);
        return NULL;
    }
    Py_buffer hdr = {0};
    int have_hdr = header_acquire(hdr_obj, &hdr);
    if (have_hdr < 0) return NULL;
    VBuf v;
    if (vbuf_acquire(&v, buf_obj, item) < 0) {
        if (have_hdr) PyBuffer_Release(&hdr);
        return NULL;
    }
    char **srcs = PyMem_Calloc(self->nranks, sizeof(char *));
    if (!srcs) {
        vbuf_release(&v);
        if (have_hdr) PyBuffer_Release(&hdr);
        return PyErr_NoMemory();
    }
    const Py_ssize_t n = v.starts[v.n] / item;
    const int N = self->nranks, me = self->rank;
    char *single = v.n == 1 ? (char *)v.views[0].buf : NULL;  /* one buffer: my part needs no staging */
    Py_ssize_t per = seg_bytes / item;
    Py_ssize_t K = (n + per - 1) / per;
    if (K < 2) K = 2;
    if (K & 1) K++;
    per = (n + K - 1) / K;
    int status = ST_OK;
    const uint64_t seq0 = self->seq;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < K && status == ST_OK; k++) {
        Py_ssize_t lo = k * per < n ? k * per : n;
        Py_ssize_t m = (lo + per < n ? lo + per : n) - lo;
        Py_ssize_t base = m / N, rem = m % N;
        Py_ssize_t a = me * base + (me < rem ? me : rem), b = a + base + (me < rem);
        Py_ssize_t slot_off = DATA_OFF + ((seq0 + 1 + k) & 1) * self->slot_bytes;
        char *mine = self->regions[me] + slot_off;
        uint64_t A = ++self->seq;
        if (k == 0 && have_hdr) memcpy(hdr_of(self, me, A), hdr.buf, HDR_BYTES);
        if (single) {
            memcpy(mine, single + lo * item, a * item);
            memcpy(mine + b * item, single + (lo + b) * item, (m - b) * item);
        } else {
            vcopy(&v, lo * item, m * item, mine, 1);
        }
        __atomic_store_n(flag_of(self, me), A, __ATOMIC_RELEASE);
        status = wait_all(self, A, timeout);
        if (status != ST_OK) break;
        if (k == 0 && have_hdr) {
            for (int q = 0; q < N; q++)
                if (memcmp(hdr_of(self, q, A), hdr.buf, HDR_BYTES) != 0) { status = ST_MISMATCH; break; }
            if (status != ST_OK) break;
        }
        if (b > a) {
            for (int q = 0; q < N; q++)
                srcs[q] = (q == me && single ? single + lo * item : self->regions[q] + slot_off) + a * item;
            char *dsts[2] = {mine + a * item, single ? single + (lo + a) * item : NULL};
            reduce_slices(dsts, single ? 2 : 1, srcs, N, b - a, dtype, op, divisor, 0);
        }
        uint64_t B = ++self->seq;
        __atomic_store_n(flag_of(self, me), B, __ATOMIC_RELEASE);
        status = wait_all(self, B, timeout);
        if (status != ST_OK) break;
        for (int q = 0; q < N; q++) {
            if (q == me && single) continue;
            Py_ssize_t qa = q * base + (q < rem ? q : rem), qb = qa + base + (q < rem);
            if (qb <= qa) continue;
            char *from = self->regions[q] + slot_off + qa * item;
            if (single) memcpy(single + (lo + qa) * item, from, (qb - qa) * item);
            else vcopy(&v, (lo + qa) * item, (qb - qa) * item, from, 0);
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(srcs);
    vbuf_release(&v);
    if (have_hdr) PyBuffer_Release(&hdr);
    return PyLong_FromLong(status);
}

/* headers(out): copy every rank's header of the current sequence into out (nranks*64 bytes). */
static PyObject *Ctx_headers(Ctx *self, PyObject *arg) {
    if (!ready(self)) return NULL;
    Py_buffer out;
    if (PyObject_GetBuffer(arg, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (out.len != (Py_ssize_t)self->nranks * HDR_BYTES) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "headers: buffer must hold nranks * 64 bytes");
        return NULL;
    }
    for (int q = 0; q < self->nranks; q++)
        memcpy((char *)out.buf + q * HDR_BYTES, hdr_of(self, q, self->seq), HDR_BYTES);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* missing() -> list of local ranks whose flag has not reached the current sequence. */
static PyObject *Ctx_missing(Ctx *self, PyObject *Py_UNUSED(ignored)) {
    if (!ready(self)) return NULL;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int q = 0; q < self->nranks; q++) {
        if (__atomic_load_n(flag_of(self, q), __ATOMIC_ACQUIRE) < self->seq) {
            PyObject *v = PyLong_FromLong(q);
            if (!v || PyList_Append(out, v) < 0) { Py_XDECREF(v); Py_DECREF(out); return NULL; }
            Py_DECREF(v);
        }
    }
    return out;
}

/* abandon(): tell the other local ranks that this rank left the group (after a failure):
 * their waits on it end with ST_ABANDONED instead of waiting for the watchdog. */
static PyObject *Ctx_abandon(Ctx *self, PyObject *Py_UNUSED(ignored)) {
    if (!ready(self)) return NULL;
    __atomic_store_n(flag_of(self, self->rank), FLAG_ABANDONED, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *Ctx_get_gone(Ctx *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(self->gone);
}

static PyObject *Ctx_get_seq(Ctx *self, void *Py_UNUSED(closure)) {
    if (!ready(self)) return NULL;
    return PyLong_FromUnsignedLongLong(self->seq);
}

static PyMethodDef Ctx_methods[] = {
    {"exchange", (PyCFunction)Ctx_exchange, METH_VARARGS,
     "exchange(header, buf, dtype_code, op_code, timeout[, header_seq]) -> 0 ok, 1 timeout, 2 header mismatch, "
     "3 rank gone"},
    {"allreduce_piped", (PyCFunction)Ctx_allreduce_piped, METH_VARARGS,
     "allreduce_piped(buffer or [buffers], dtype_code, op_code, divisor, header, timeout, segment_bytes) -> status"},
    {"headers", (PyCFunction)Ctx_headers, METH_O, "headers(out): every rank's header of the last exchange"},
    {"missing", (PyCFunction)Ctx_missing, METH_NOARGS, "local ranks that did not reach the last exchange"},
    {"abandon", (PyCFunction)Ctx_abandon, METH_NOARGS, "mark this rank as gone from the group (waits on it end)"},
    {NULL},
};

static PyGetSetDef Ctx_getset[] = {
    {"seq", (getter)Ctx_get_seq, NULL, "number of exchanges so far", NULL},
    {"gone", (getter)Ctx_get_gone, NULL, "the local rank a wait found abandoned or gone (-1: none)", NULL},
    {NULL},
};

static PyTypeObject CtxType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpctrain.comm._shmsync.Ctx",
    .tp_basicsize = sizeof(Ctx),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Flag synchronisation and small all-reduces over a node's shared window",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ctx_init,
    .tp_dealloc = (destructor)Ctx_dealloc,
    .tp_methods = Ctx_methods,
    .tp_getset = Ctx_getset,
};

static PyMethodDef module_methods[] = {
    {"reduce_to_all", reduce_to_all, METH_VARARGS,
     "reduce_to_all(dst_buffers, src_buffers, count, dtype_code, op_code, divisor, nontemporal)"},
    {NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_shmsync", "Shared-memory flag synchronisation for hpctrain.comm", -1, module_methods,
};

PyMODINIT_FUNC PyInit__shmsync(void) {
    if (PyType_Ready(&CtxType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&CtxType);
    if (PyModule_AddObject(m, "Ctx", (PyObject *)&CtxType) < 0) { Py_DECREF(&CtxType); Py_DECREF(m); return NULL; }
    PyModule_AddIntConstant(m, "REGION_HEADER_BYTES", DATA_OFF);
    PyModule_AddIntConstant(m, "HEADER_BYTES", HDR_BYTES);
    return m;
}
