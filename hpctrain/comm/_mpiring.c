/* The ring all-reduce over MPI point-to-point messages, in C.
 *
 * Reduce-scatter then all-gather on a ring (each rank sends 2(N-1)/N of the data), every
 * chunk cut into segments that are received into a few cache-sized scratch slots and
 * reduced as they arrive; in the last reduce-scatter step each finished segment of this
 * rank's own chunk is sent on at once (the all-gather's first step overlaps the reduction).
 * Each chunk is reduced by its owner only, in the same order everywhere, then copied to
 * all: the result is bitwise identical on every rank.
 *
 * No MPI header is needed to build it: hpctrain.comm looks up MPI_Isend, MPI_Irecv,
 * MPI_Wait and MPI_Cancel in the MPI library mpi4py loaded and hands their addresses to bind(), and passes
 * the communicator and MPI_BYTE as mpi4py's integer handles. Handles travel as uintptr_t:
 * a pointer for Open MPI, an int for MPICH and its derivatives (passed in a register, the
 * callee reads its low half). A request is kept in 8 zeroed bytes and waited on one by one
 * (an int or a pointer fits; no array stride to know), with room for any MPI_Status; a slot
 * is zero exactly when it holds no posted request, so that after an MPI error the requests
 * still posted can be cancelled and completed before the buffers go back to Python.
 * The GIL is released for the whole ring, so the stall watchdog's thread keeps running.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "_kernels.h"

typedef int (*isend_fn)(const void *, int, uintptr_t, int, int, uintptr_t, void *);
typedef int (*irecv_fn)(void *, int, uintptr_t, int, int, uintptr_t, void *);
typedef int (*wait_fn)(void *, void *);
typedef int (*cancel_fn)(void *);

static isend_fn mpi_isend;
static irecv_fn mpi_irecv;
static wait_fn mpi_wait;
static cancel_fn mpi_cancel;

typedef struct { uint64_t slot; } Req;           /* one MPI_Request, whatever its size */
typedef struct { uint64_t words[16]; } Status;   /* larger than any MPI_Status */

#define MAX_SLOTS 16
/* Tags: a message's segment number. Between two neighbours, messages with one tag are
 * sent in the order the receiver posts for them (every reduce-scatter step, then the
 * all-gather's), and MPI does not let messages of one sender and tag overtake each other:
 * so they match, and the tags stay far below the 32767 every MPI allows. */

#define COMBINE_LOOP(T, EXPR)                                                  \
    do {                                                                       \
        T *restrict o = (T *)acc;                                              \
        const T *restrict s = (const T *)in;                                   \
        for (Py_ssize_t i = 0; i < n; i++) { T a = o[i], b = s[i]; o[i] = (EXPR); } \
    } while (0)

/* LOOP(T, the op's expression of a and b) for `op`: one switch for both combine kernels. */
#define FOR_OP(T, LOOP)                                                        \
    do {                                                                       \
        switch (op) {                                                          \
        case OP_SUM: case OP_AVG: LOOP(T, a + b); break;                       \
        case OP_PROD: LOOP(T, a * b); break;                                   \
        case OP_MIN: LOOP(T, KERNEL_MIN(a, b)); break;                         \
        case OP_MAX: LOOP(T, KERNEL_MAX(a, b)); break;                         \
        }                                                                      \
    } while (0)

#define COMBINE_TYPE(T) FOR_OP(T, COMBINE_LOOP)

/* acc[i] = acc[i] op in[i], n elements: the left neighbour's partial result is the right
 * operand, as in the Python ring (reduce_into). */
static void combine(void *acc, const void *in, Py_ssize_t n, int dtype, int op) {
    FOR_KERNEL_DTYPE(dtype, COMBINE_TYPE)
}

#define COMBINE3_LOOP(T, EXPR)                                                 \
    do {                                                                       \
        T *o = (T *)out;                                                       \
        const T *l = (const T *)left, *r = (const T *)right;                   \
        for (Py_ssize_t i = 0; i < n; i++) { T a = l[i], b = r[i]; o[i] = (EXPR); } \
    } while (0)

#define COMBINE3_TYPE(T) FOR_OP(T, COMBINE3_LOOP)

/* out[i] = left[i] op right[i], n elements; out may be left or right (element by element). */
static void combine3(void *out, const void *left, const void *right, Py_ssize_t n, int dtype, int op) {
    FOR_KERNEL_DTYPE(dtype, COMBINE3_TYPE)
}

#define DIVIDE_TYPE(T)                                                         \
    do {                                                                       \
        T *o = (T *)acc;                                                       \
        for (Py_ssize_t i = 0; i < n; i++) o[i] = (T)(o[i] / divisor);         \
    } while (0)

static void divide(void *acc, Py_ssize_t n, int dtype, long divisor) {
    FOR_KERNEL_DTYPE(dtype, DIVIDE_TYPE)
}

typedef struct {
    uintptr_t comm, byte;       /* MPI handles */
    int rank, size, left, right, item, dtype, op;
    long divisor;               /* 'avg': divide the owned chunk by this; else 0 */
    char *buf, *scratch;
    Py_ssize_t n, seg, slots;   /* elements; elements per segment; scratch slots */
} Ring;

/* Chunk c of the ring: the first n % size chunks get one element more (plan.chunk_bounds). */
static void chunk(const Ring *r, int c, Py_ssize_t *a, Py_ssize_t *b) {
    Py_ssize_t base = r->n / r->size, extra = r->n % r->size;
    *a = c * base + (c < extra ? c : extra);
    *b = *a + base + (c < extra ? 1 : 0);
}

static inline int mod(int x, int m) { return ((x % m) + m) % m; }

static int isend(const Ring *r, Py_ssize_t a, Py_ssize_t b, int tag, Req *q) {
    q->slot = 0;
    int err = mpi_isend(r->buf + a * r->item, (int)((b - a) * r->item), r->byte, r->right, tag, r->comm, q);
    if (err) q->slot = 0;  /* nothing was posted */
    return err;
}

static int irecv(const Ring *r, char *into, Py_ssize_t a, Py_ssize_t b, int tag, Req *q) {
    q->slot = 0;
    int err = mpi_irecv(into, (int)((b - a) * r->item), r->byte, r->left, tag, r->comm, q);
    if (err) q->slot = 0;
    return err;
}

/* Wait for q[0..count); each slot is zeroed once its request is complete (a failed wait
 * also ends the request: it is not waited on again). */
static int wait_all(Req *q, Py_ssize_t count) {
    Status st;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!q[i].slot) continue;
        int err = mpi_wait(&q[i], &st);
        q[i].slot = 0;
        if (err) return err;
    }
    return 0;
}

/* After an error: cancel every request still posted and wait for it, so that no receive
 * lands in (and no send reads) a buffer the caller frees or reuses. */
static void cancel_all(Req *q, Py_ssize_t count) {
    Status st;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!q[i].slot) continue;
        mpi_cancel(&q[i]);
        mpi_wait(&q[i], &st);
        q[i].slot = 0;
    }
}

#define CHECK(call) do { int err_ = (call); if (err_) return err_; } while (0)

/* One reduce-scatter step: send chunk `sc` right while receiving chunk `rc` from the left
 * into the scratch slots, reducing each segment as it arrives. With `forward`, every reduced
 * segment (averaged first, when asked) goes on to the right at once; `fwd` keeps those
 * requests for the caller. */
static int reduce_step(const Ring *r, int sc, int rc, int forward, Req *sends, Req *recvs, Req *fwd) {
    Py_ssize_t sa, sb, ra, rb;
    chunk(r, sc, &sa, &sb);
    chunk(r, rc, &ra, &rb);
    Py_ssize_t seg = r->seg, ns = (sb - sa + seg - 1) / seg, nr = (rb - ra + seg - 1) / seg;
    char *slot_at[MAX_SLOTS];
    for (Py_ssize_t k = 0; k < r->slots; k++) slot_at[k] = r->scratch + k * seg * r->item;
    for (Py_ssize_t k = 0; k < nr && k < r->slots; k++) {
        Py_ssize_t a = ra + k * seg, b = a + seg < rb ? a + seg : rb;
        CHECK(irecv(r, slot_at[k % r->slots], a, b, (int)k, &recvs[k % r->slots]));
    }
    for (Py_ssize_t k = 0; k < ns; k++) {
        Py_ssize_t a = sa + k * seg, b = a + seg < sb ? a + seg : sb;
        CHECK(isend(r, a, b, (int)k, &sends[k]));
    }
    for (Py_ssize_t k = 0; k < nr; k++) {
        Py_ssize_t a = ra + k * seg, b = a + seg < rb ? a + seg : rb;
        CHECK(wait_all(&recvs[k % r->slots], 1));
        combine(r->buf + a * r->item, slot_at[k % r->slots], b - a, r->dtype, r->op);
        Py_ssize_t next = k + r->slots;
        if (next < nr) {
            Py_ssize_t a2 = ra + next * seg, b2 = a2 + seg < rb ? a2 + seg : rb;
            CHECK(irecv(r, slot_at[next % r->slots], a2, b2, (int)next, &recvs[next % r->slots]));
        }
        if (forward) {
            if (r->divisor > 1) divide(r->buf + a * r->item, b - a, r->dtype, r->divisor);
            CHECK(isend(r, a, b, (int)k, &fwd[k]));
        }
    }
    return wait_all(sends, ns);
}

/* The whole ring. `reqs` has room for 3 * max segments per chunk + slots requests. */
static int ring(const Ring *r, Req *reqs, Py_ssize_t max_segs) {
    Req *sends = reqs, *fwd = reqs + max_segs, *gathers = reqs + 2 * max_segs, *recvs = reqs + 3 * max_segs;
    int N = r->size, me = r->rank;
    for (int s = 0; s < N - 1; s++)
        CHECK(reduce_step(r, mod(me - s, N), mod(me - s - 1, N), s == N - 2, sends, recvs, fwd));
    /* All-gather: step g receives chunk (me - g) from the left and, but for the last step,
     * passes it on (one step's sends in flight while the next arrives). Step 0's sends
     * left during the last reduce-scatter step (fwd). */
    Req *pending = fwd;
    Py_ssize_t npending, a0, b0;
    chunk(r, mod(me + 1, N), &a0, &b0);
    npending = (b0 - a0 + r->seg - 1) / r->seg;
    for (int g = 0; g < N - 1; g++) {
        Py_ssize_t ga, gb;
        chunk(r, mod(me - g, N), &ga, &gb);
        Py_ssize_t ng = (gb - ga + r->seg - 1) / r->seg;
        int pass = g < N - 2;
        Req *out = pending == fwd ? sends : fwd;   /* free: waited when it was `pending` */
        /* every segment's receive posted at once (over TCP a receive posted late costs a
         * round trip per segment), then each passed on as it completes */
        for (Py_ssize_t k = 0; k < ng; k++) {
            Py_ssize_t a = ga + k * r->seg, b = a + r->seg < gb ? a + r->seg : gb;
            CHECK(irecv(r, r->buf + a * r->item, a, b, (int)k, &gathers[k]));
        }
        for (Py_ssize_t k = 0; k < ng; k++) {
            Py_ssize_t a = ga + k * r->seg, b = a + r->seg < gb ? a + r->seg : gb;
            CHECK(wait_all(&gathers[k], 1));
            if (pass) CHECK(isend(r, a, b, (int)k, &out[k]));
        }
        if (pass) {
            CHECK(wait_all(pending, npending));
            pending = out;
            npending = ng;
        }
    }
    return wait_all(pending, npending);
}

/* allreduce(comm, byte, rank, size, buffer, scratch, dtype, op, divisor, segment_bytes)
 *   -> 0, or the MPI error code of the call that failed. */
static PyObject *allreduce(PyObject *Py_UNUSED(module), PyObject *args) {
    unsigned long long comm, byte;
    int rank, size, dtype, op;
    long divisor;
    Py_ssize_t seg_bytes;
    Py_buffer buf, scratch;
    if (!PyArg_ParseTuple(args, "KKiiw*w*iiln", &comm, &byte, &rank, &size, &buf, &scratch, &dtype, &op,
                          &divisor, &seg_bytes))
        return NULL;
    PyObject *result = NULL;
    int item = itemsize_of(dtype);
    if (!mpi_isend || !mpi_irecv || !mpi_wait || !mpi_cancel) {
        PyErr_SetString(PyExc_RuntimeError, "_mpiring.allreduce: call bind() with the MPI functions first");
    } else if (!item || op < OP_SUM || op > OP_PROD) {
        PyErr_Format(PyExc_ValueError, "_mpiring.allreduce: unsupported dtype %d / op %d", dtype, op);
    } else if (size < 1 || rank < 0 || rank >= size) {
        PyErr_Format(PyExc_ValueError, "_mpiring.allreduce: rank %d of %d", rank, size);
    } else if (buf.len % item || seg_bytes < item || seg_bytes > (1 << 30)) {
        PyErr_Format(PyExc_ValueError, "_mpiring.allreduce: %zd bytes of %d-byte items, segments of %zd bytes",
                     buf.len, item, seg_bytes);
    } else {
        Ring r = {(uintptr_t)comm, (uintptr_t)byte, rank, size, mod(rank - 1, size), mod(rank + 1, size),
                  item, dtype, op, op == OP_AVG ? divisor : 0, buf.buf, scratch.buf,
                  buf.len / item, seg_bytes / item, 0};
        Py_ssize_t max_chunk = r.n / size + (r.n % size ? 1 : 0);
        if (r.seg > max_chunk && max_chunk > 0) r.seg = max_chunk;
        r.slots = r.seg ? scratch.len / (r.seg * item) : 0;
        if (r.slots > MAX_SLOTS) r.slots = MAX_SLOTS;
        Py_ssize_t max_segs = r.seg ? (max_chunk + r.seg - 1) / r.seg : 0;
        if (size == 1 || r.n == 0) {
            result = PyLong_FromLong(0);
        } else if (r.slots < 1) {
            PyErr_Format(PyExc_ValueError, "_mpiring.allreduce: scratch of %zd bytes holds no %zd-byte segment",
                         scratch.len, r.seg * item);
        } else if (max_segs > 32767) {
            PyErr_Format(PyExc_ValueError, "_mpiring.allreduce: %zd segments per chunk (tags up to 32767): "
                         "use larger segments", max_segs);
        } else {
            Req *reqs = PyMem_RawCalloc((size_t)(3 * max_segs + r.slots), sizeof(Req));
            if (!reqs) {
                PyErr_NoMemory();
            } else {
                int err;
                Py_BEGIN_ALLOW_THREADS
                err = ring(&r, reqs, max_segs);
                if (err) cancel_all(reqs, 3 * max_segs + r.slots);
                Py_END_ALLOW_THREADS
                PyMem_RawFree(reqs);
                result = PyLong_FromLong(err);
            }
        }
    }
    PyBuffer_Release(&buf);
    PyBuffer_Release(&scratch);
    return result;
}

/* The agreement check over MPI, with a small all-reduce's data on it (hpctrain.comm.guard):
 * the same messages as the check in Python, so that ranks running either interoperate.
 *
 * The schedule (hpctrain.comm.plan.check_schedule, passed encoded: int32 [home, number of
 * extras, extras..., number of partners, partners...]): recursive doubling among the core
 * ranks; every other rank sends its part to its home and gets the result back from it at the
 * end. A rank first takes its extras' parts (across nodes a node leader its node's other
 * ranks, so that only leaders' messages cross the network), then swaps its part for the
 * result with its home or runs its steps, and last sends the result to its extras. A part is this rank's header (its first int64 the sequence number), the state
 * [mismatch flag, rank 0's decision, the part's data bytes] (three int64) and the data. A
 * part of more than `piece` bytes but at most twice that travels as two messages, its first
 * `piece` bytes (header and state included) and the rest: over TCP a message above the 64 KiB
 * eager limit waits for a rendezvous round trip before its bulk leaves; two messages of up
 * to `piece` bytes leave at once (a 64 KiB in-band all-reduce across 2 x 2 nodes took 1-15%
 * less time). A larger part goes as one message (cut into 60 KiB pieces, 128 and 256 KiB
 * parts took as long or longer: a rendezvous per message was not the only cost). The
 * receiver learns from the first message whether a second follows (the sender's data
 * bytes), so ranks in calls of different sizes still exchange whole parts and find the
 * mismatch. A rank merges each part it receives (from an extra, or from its partner at a
 * step): the flag is set when either flag is or the headers differ; the decision is the lower
 * rank's (so rank 0's in the end; an extra's never); while nothing differs the data is
 * reduced, the lower rank's part as the left operand, so both partners of a step compute the
 * same bits, which the homes then hand down. After the last step every core rank has merged
 * every rank's part: every rank learns the same verdict in the same call, with one message per
 * step per node crossing the network (the check through a coordinating rank costs two one-way
 * trips). Every checked call sends the same messages
 * whatever its kind or size (a receive takes up to a whole row), so ranks in different calls
 * never wait on a message that is not sent: they find the mismatch.
 *
 * check(comm, byte, rank, schedule, mine, theirs, dtype, op, divisor, tag, piece, where, clock, header,
 *       data, seq, decision) -> 0 agreed (data holds the result, mine's state word 1 rank 0's
 *       decision), -1 the headers differ (every rank of the call returns -1; the caller
 *       gathers the headers), or an MPI error code. The arguments that may change from call to
 *       call come last, so that Python binds the rest once.
 *   mine, theirs: rows of header + 24 + the group's largest in-band data; mine gets `header`
 *   with its first int64 set to `seq`, and the state [0, decision, data bytes]. piece: the
 *   size of a split part's first message (the same on every rank; at least header + state).
 *   data: this rank's data,
 *   reduced in place (0 bytes: a plain check). where: two int32, [the rank waited for, the
 *   stage: 0 an extra's part, k + 1 step k, steps + 1 the result from home], read by the
 *   stall watchdog's thread.
 *   clock: a double that holds the monotonic time (Python's time.monotonic) the call began
 *   while it waits, 0.0 otherwise (watchdog.ClockedWait), so the call needs no Python around
 *   it to be watched. */
#define STATE 24 /* after the header: [mismatch flag, rank 0's decision, the part's data bytes], int64 */

typedef struct {
    uintptr_t comm, byte;
    const int32_t *schedule;  /* [home, n extras, extras..., n partners, partners...] */
    int rank, dtype, op, tag;
    long divisor;
    char *mine, *theirs, *data;
    Py_ssize_t head, n, row, piece;  /* header bytes, data bytes, row bytes (largest part), first message's largest */
    volatile int32_t *where;
} Check;

/* An Isend's or Irecv's error code; its slot cleared when nothing was posted. */
static int post(int err, Req *q) {
    if (err) q->slot = 0;
    return err;
}

static Py_ssize_t smaller(Py_ssize_t a, Py_ssize_t b) { return a < b ? a : b; }

/* Whether a part of `part` bytes travels as two messages (`piece` bytes, then the rest). */
static int split(const Check *c, Py_ssize_t part) { return part > c->piece && part <= 2 * c->piece; }

/* Receive a part from `partner` into theirs (q[0], q[1]) and/or send this rank's part to it
 * (q[2], q[3]); the first message's state says whether a second follows (MPI keeps one
 * sender's messages of one tag in order). A sender's part never exceeds the row: every
 * rank's row has room for the group's in-band limit, agreed when the group was made. */
static int swap(const Check *c, int partner, int send, int recv, int stage, Req *q) {
    c->where[0] = partner;
    c->where[1] = stage;
    Py_ssize_t part = c->head + STATE + c->n, first = split(c, part) ? c->piece : part;
    if (recv) CHECK(post(mpi_irecv(c->theirs, (int)c->row, c->byte, partner, c->tag, c->comm, &q[0]), &q[0]));
    if (send) {
        CHECK(post(mpi_isend(c->mine, (int)first, c->byte, partner, c->tag, c->comm, &q[2]), &q[2]));
        if (part > first)
            CHECK(post(mpi_isend(c->mine + first, (int)(part - first), c->byte, partner, c->tag, c->comm, &q[3]),
                       &q[3]));
    }
    if (recv) {
        CHECK(wait_all(q, 1));
        int64_t bytes = ((const int64_t *)(c->theirs + c->head))[2];
        Py_ssize_t theirs = smaller(c->head + STATE + (bytes > 0 ? (Py_ssize_t)bytes : 0), c->row);
        if (split(c, theirs))
            CHECK(post(mpi_irecv(c->theirs + c->piece, (int)(theirs - c->piece), c->byte, partner, c->tag, c->comm,
                                 &q[1]), &q[1]));
    }
    return wait_all(q, 4);
}

/* Merge the part in theirs into mine, the data into `out` (mine's, or the caller's at the
 * last step); `lower`: it comes from the lower rank. Returns whether the data was merged. */
static int merge(const Check *c, int lower, char *out) {
    int64_t *mine = (int64_t *)(c->mine + c->head), *theirs = (int64_t *)(c->theirs + c->head);
    mine[0] = mine[0] | theirs[0] | (memcmp(c->mine, c->theirs, (size_t)c->head) != 0);
    if (lower) mine[1] = theirs[1];
    if (mine[0] || !c->n) return 0;
    const char *a = c->mine + c->head + STATE, *b = c->theirs + c->head + STATE;
    combine3(out, lower ? b : a, lower ? a : b, c->n / itemsize_of(c->dtype), c->dtype, c->op);
    return 1;
}

static int run_check(const Check *c, Req *q) {
    const int32_t *s = c->schedule, *extras = s + 2, *partners = s + 3 + s[1];
    int home = s[0], n_extras = s[1], steps = s[2 + n_extras];
    int64_t *state = (int64_t *)(c->mine + c->head);
    char *data = c->mine + c->head + STATE;
    for (int i = 0; i < n_extras; i++) {
        CHECK(swap(c, extras[i], 0, 1, 0, q));
        merge(c, 0, data);
    }
    if (home >= 0) {
        CHECK(swap(c, home, 1, 1, steps + 1, q));
        /* the verdict and decision; the data-bytes word stays this rank's (how its part travels) */
        memcpy(state, c->theirs + c->head, 2 * sizeof(int64_t));
        if (!state[0]) {
            memcpy(c->data, c->theirs + c->head + STATE, (size_t)c->n);
            if (n_extras) memcpy(data, c->data, (size_t)c->n);
        }
    } else {
        int in_place = 0;  /* the last merge wrote the caller's data */
        for (int k = 0; k < steps; k++) {
            int partner = partners[k], last = k == steps - 1 && !n_extras;
            CHECK(swap(c, partner, 1, 1, k + 1, q));
            in_place = merge(c, partner < c->rank, last ? c->data : data) && last;
        }
        if (!state[0]) {
            if (!in_place) memcpy(c->data, data, (size_t)c->n);
            if (c->divisor > 1 && c->n) divide(c->data, c->n / itemsize_of(c->dtype), c->dtype, c->divisor);
            if (n_extras) memcpy(data, c->data, (size_t)c->n);
        }
    }
    for (int i = 0; i < n_extras; i++)  /* the verdict, whatever it is */
        CHECK(swap(c, extras[i], 1, 0, steps + 1, q));
    return state[0] ? -1 : 0;
}

/* Whether `s` (`len` bytes) is a schedule of `size` ranks for `rank`: int32-aligned words
 * [home, n, n extras, m, m partners], every rank named in range and not `rank`. */
static int valid_schedule(const int32_t *s, Py_ssize_t len, int rank, int size) {
    Py_ssize_t words = len / (Py_ssize_t)sizeof(int32_t);
    if (len % (Py_ssize_t)sizeof(int32_t) || (uintptr_t)s % sizeof(int32_t) || words < 3) return 0;
    if (s[1] < 0 || 3 + (Py_ssize_t)s[1] > words) return 0;
    Py_ssize_t m = s[2 + s[1]];
    if (m < 0 || 3 + s[1] + m != words || (s[0] >= 0 && m)) return 0;
    if (s[0] >= size || s[0] == rank || s[0] < -1) return 0;
    for (Py_ssize_t i = 0; i < s[1]; i++)
        if (s[2 + i] < 0 || s[2 + i] >= size || s[2 + i] == rank) return 0;
    for (Py_ssize_t i = 0; i < m; i++)
        if (s[3 + s[1] + i] < 0 || s[3 + s[1] + i] >= size || s[3 + s[1] + i] == rank) return 0;
    return 1;
}

static PyObject *check(PyObject *Py_UNUSED(module), PyObject *args) {
    unsigned long long comm, byte;
    int rank, dtype, op, tag;
    long divisor;
    long long seq, decision;
    Py_ssize_t piece;
    Py_buffer schedule, mine, theirs, head, where, clock, data;
    if (!PyArg_ParseTuple(args, "KKiy*w*w*iilinw*w*y*w*LL", &comm, &byte, &rank, &schedule, &mine, &theirs, &dtype,
                          &op, &divisor, &tag, &piece, &where, &clock, &head, &data, &seq, &decision))
        return NULL;
    Py_ssize_t header = head.len;
    PyObject *result = NULL;
    int item = itemsize_of(dtype);
    if (!mpi_isend || !mpi_irecv || !mpi_wait || !mpi_cancel) {
        PyErr_SetString(PyExc_RuntimeError, "_mpiring.check: call bind() with the MPI functions first");
    } else if (!item || op < OP_SUM || op > OP_PROD || data.len % item) {
        PyErr_Format(PyExc_ValueError, "_mpiring.check: unsupported dtype %d / op %d for %zd bytes", dtype, op,
                     data.len);
    } else if (rank < 0 || !valid_schedule(schedule.buf, schedule.len, rank, 1 << 30)) {
        PyErr_Format(PyExc_ValueError, "_mpiring.check: rank %d with a schedule of %zd bytes that is not "
                     "plan.CheckSchedule.encoded()", rank, schedule.len);
    } else if (where.len < 2 * (Py_ssize_t)sizeof(int32_t) || (uintptr_t)where.buf % sizeof(int32_t)) {
        PyErr_SetString(PyExc_ValueError, "_mpiring.check: where must be two aligned, writable int32");
    } else if (clock.len < (Py_ssize_t)sizeof(double) || (uintptr_t)clock.buf % sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "_mpiring.check: clock must be an aligned, writable double");
    } else if (piece < header + STATE || piece > (1 << 30)) {
        PyErr_Format(PyExc_ValueError, "_mpiring.check: pieces of %zd bytes; they must hold header and state (%zd "
                     "bytes) and be at most 1 GiB (pass guard.CHECK_PIECE_BYTES)", piece, header + STATE);
    } else if (header < 8 || header % 8 || mine.len != theirs.len || mine.len < header + STATE + data.len ||
               (uintptr_t)mine.buf % 8 || (uintptr_t)theirs.buf % 8 || mine.len > (1 << 30)) {
        PyErr_Format(PyExc_ValueError, "_mpiring.check: rows of %zd and %zd bytes (8-aligned) for a %zd-byte "
                     "header (a multiple of 8), %d bytes of state and %zd bytes of data", mine.len, theirs.len,
                     header, STATE, data.len);
    } else {
        Check c = {(uintptr_t)comm, (uintptr_t)byte, schedule.buf, rank, dtype, op, tag, op == OP_AVG ? divisor : 0,
                   mine.buf, theirs.buf, data.buf, header, data.len, mine.len, piece, (volatile int32_t *)where.buf};
        int64_t word = (int64_t)seq, *state = (int64_t *)(c.mine + header);
        memcpy(c.mine, head.buf, (size_t)header);
        memcpy(c.mine, &word, sizeof word);
        state[0] = 0;
        state[1] = (int64_t)decision;
        state[2] = (int64_t)data.len;
        memcpy(c.mine + header + STATE, data.buf, (size_t)data.len);
        Req reqs[4] = {{0}, {0}, {0}, {0}};
        int err;
        volatile double *began = (volatile double *)clock.buf;
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        *began = (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
        Py_BEGIN_ALLOW_THREADS
        err = run_check(&c, reqs);
        if (err > 0) cancel_all(reqs, 4);
        Py_END_ALLOW_THREADS
        *began = 0.0;
        result = PyLong_FromLong(err);
    }
    PyBuffer_Release(&schedule);
    PyBuffer_Release(&mine);
    PyBuffer_Release(&theirs);
    PyBuffer_Release(&head);
    PyBuffer_Release(&where);
    PyBuffer_Release(&clock);
    PyBuffer_Release(&data);
    return result;
}

/* bind(isend_address, irecv_address, wait_address, cancel_address): the MPI library's functions. */
static PyObject *bind(PyObject *Py_UNUSED(module), PyObject *args) {
    unsigned long long s, r, w, c;
    if (!PyArg_ParseTuple(args, "KKKK", &s, &r, &w, &c)) return NULL;
    if (!s || !r || !w || !c) {
        PyErr_SetString(PyExc_ValueError, "_mpiring.bind: null function address");
        return NULL;
    }
    mpi_isend = (isend_fn)(uintptr_t)s;
    mpi_irecv = (irecv_fn)(uintptr_t)r;
    mpi_wait = (wait_fn)(uintptr_t)w;
    mpi_cancel = (cancel_fn)(uintptr_t)c;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"bind", bind, METH_VARARGS, "bind(isend_address, irecv_address, wait_address, cancel_address)"},
    {"allreduce", allreduce, METH_VARARGS,
     "allreduce(comm, byte, rank, size, buffer, scratch, dtype_code, op_code, divisor, segment_bytes) -> MPI error code"},
    {"check", check, METH_VARARGS,
     "check(comm, byte, rank, schedule, mine, theirs, dtype_code, op_code, divisor, tag, piece, where, clock, header, "
     "data, seq, decision) -> 0 agreed, -1 headers differ, or an MPI error code"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_mpiring", "Ring all-reduce over MPI point-to-point messages, in C.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__mpiring(void) { return PyModule_Create(&moduledef); }
