/* What the C extensions of hpctrain.comm share: the dtype and op codes (as in
 * hpctrain.comm.buffers.DTYPE_CODES and OPS), item sizes, and one switch over the dtypes
 * that have reduction kernels (every integer width, float32, float64; not bool, float16 or
 * bfloat16, which Python reduces). */
#ifndef HPCTRAIN_COMM_KERNELS_H
#define HPCTRAIN_COMM_KERNELS_H

#include <stdint.h>

enum { DT_BOOL = 0, DT_I8, DT_U8, DT_I16, DT_U16, DT_I32, DT_U32, DT_I64, DT_U64,
       DT_F16, DT_BF16, DT_F32, DT_F64 };
enum { OP_SUM = 0, OP_AVG, OP_MIN, OP_MAX, OP_PROD };

/* min and max as numpy's minimum and maximum: a NaN in either operand gives NaN, whatever
 * the operand order (every path of an all-reduce must agree, whichever algorithm ran).
 * For integers `b != b` is false and the compiler drops it. */
#define KERNEL_MIN(a, b) (((b) < (a) || (b) != (b)) ? (b) : (a))
#define KERNEL_MAX(a, b) (((b) > (a) || (b) != (b)) ? (b) : (a))

/* Bytes per item of a dtype with kernels; 0 for the others. */
static inline int itemsize_of(int dtype) {
    switch (dtype) {
    case DT_I8: case DT_U8: return 1;
    case DT_I16: case DT_U16: return 2;
    case DT_I32: case DT_U32: case DT_F32: return 4;
    case DT_I64: case DT_U64: case DT_F64: return 8;
    default: return 0;
    }
}

/* switch (dtype) { case DT_x: BODY(c type of x); break; ... } for the dtypes with kernels;
 * other dtypes do nothing (callers check itemsize_of first). */
#define FOR_KERNEL_DTYPE(dtype, BODY)            \
    switch (dtype) {                             \
    case DT_I8: BODY(int8_t); break;             \
    case DT_U8: BODY(uint8_t); break;            \
    case DT_I16: BODY(int16_t); break;           \
    case DT_U16: BODY(uint16_t); break;          \
    case DT_I32: BODY(int32_t); break;           \
    case DT_U32: BODY(uint32_t); break;          \
    case DT_I64: BODY(int64_t); break;           \
    case DT_U64: BODY(uint64_t); break;          \
    case DT_F32: BODY(float); break;             \
    case DT_F64: BODY(double); break;            \
    default: break;                              \
    }

#endif
