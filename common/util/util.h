/* kvbank — small helpers every layer uses: checked allocation, monotonic time, integer parsing. */
#ifndef KVB_UTIL_UTIL_H
#define KVB_UTIL_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "common/util/log.h"
#include "common/util/status.h"

/* Element types of weights and KV (safetensors names: F32, F16, BF16, F8_E4M3). */
typedef enum kvb_dtype {
    KVB_DTYPE_F32 = 0,
    KVB_DTYPE_F16 = 1,
    KVB_DTYPE_BF16 = 2,
    KVB_DTYPE_F8_E4M3 = 3, /* OCP FP8 E4M3 ("e4m3fn": no infinities, 0x7f/0xff NaN, largest 448); weights only */
} kvb_dtype;

/* Bytes per element; "f32"/"f16"/"bf16"/"f8_e4m3" names and their inverse (KVB_ERR_INVALID if unknown). */
size_t kvb_dtype_size(kvb_dtype dt);
const char *kvb_dtype_name(kvb_dtype dt);
kvb_status kvb_dtype_parse(const char *name, kvb_dtype *out);

/* Allocation wrappers: return KVB_ERR_NOMEM (and log the size) instead of aborting. The result is
 * owned by the caller and released with free(). kvb_calloc zeroes; sizes are checked for overflow. */
kvb_status kvb_malloc(size_t bytes, void **out);
kvb_status kvb_calloc(size_t n, size_t size, void **out);
kvb_status kvb_realloc_array(void **p, size_t n, size_t size);
/* Page-aligned (64-byte at least) allocation for SIMD/BLAS buffers; free with free(). */
kvb_status kvb_aligned_alloc(size_t bytes, void **out);
/* strdup that reports failure; caller owns the copy. */
kvb_status kvb_strdup(const char *s, char **out);
/* Tests: the calling thread's next `n` allocations through the wrappers above succeed and every one
 * after them fails with KVB_ERR_NOMEM, until kvb__alloc_fail_after(-1) (the default). */
void kvb__alloc_fail_after(int n);

/* Monotonic clock in nanoseconds / seconds (CLOCK_MONOTONIC). */
uint64_t kvb_now_ns(void);
double kvb_now_s(void);
/* Wall clock in nanoseconds since the epoch (for timestamps that leave the process). */
uint64_t kvb_wall_ns(void);
/* Nanoseconds the calling thread has spent runnable but waiting for a CPU (Linux schedstat), 0 where
 * the kernel does not say. A wall-clock interval minus its growth is the time the thread ran or slept:
 * what the interval would have taken on a machine nobody else was using. */
uint64_t kvb_thread_runq_ns(void);

/* Strict decimal parsing: the whole string must be a number in [min, max]. */
kvb_status kvb_parse_i64(const char *s, int64_t min, int64_t max, int64_t *out);
kvb_status kvb_parse_f64(const char *s, double *out);
/* Parses a comma-separated list of non-negative int32 ("1,2,3"). *out is owned by the caller. */
kvb_status kvb_parse_id_list(const char *s, int32_t **out, int *n_out);

/* Processes. kvb_proc_stat reads the state letter ('R', 'S', 'Z', ...) and the parent of `pid` from
 * /proc/PID/stat (either out-pointer may be NULL): KVB_ERR_NOT_FOUND when no such process exists,
 * KVB_ERR_IO when /proc cannot be read. kvb_pid_alive is 1 while `pid` exists and is not a zombie (a
 * dead child its parent has not reaped yet holds its pid but runs no more); a process of another user
 * counts as alive, and so does any pid when /proc cannot tell. */
kvb_status kvb_proc_stat(long pid, char *state, long *ppid);
int kvb_pid_alive(long pid);

/* Files a process is handed (a model directory's, a config): opens `path` for reading without blocking
 * (a FIFO or a device at that path would block open() or read() forever) and requires a regular file;
 * symbolic links are followed. KVB_ERR_NOT_FOUND when nothing is there (not logged), KVB_ERR_FORMAT
 * when it is not a regular file, KVB_ERR_IO otherwise (both logged with the path). Caller closes *fd. */
kvb_status kvb_open_regular(const char *path, int *fd);
/* The whole of such a file, of at most `max` bytes (KVB_ERR_FORMAT, logged, when larger),
 * NUL-terminated. Caller frees *out. */
kvb_status kvb_read_file(const char *path, size_t max, char **out, size_t *len);

/* A name from the last component of `path` (a model directory): characters outside [A-Za-z0-9_-]
 * become '_', at most `max` characters, "m" when empty. `out` holds max + 1 bytes. */
void kvb_name_from_path(const char *path, char *out, size_t max);

/* Python's repr() of a float (what json.dumps and str() write): the shortest digits that round-trip,
 * positional for decimal exponents in [-4, 16) with at least one decimal ("10000.0"), else "1e-06"
 * style; "nan", "inf", "-inf". `buf` holds at least 32 bytes. */
void kvb_fmt_py_float(double x, char *buf, size_t cap);

/* Half-precision conversions (IEEE binary16 and bfloat16) to/from float32. */
float kvb_f16_to_f32(uint16_t h);
uint16_t kvb_f32_to_f16(float f);
float kvb_bf16_to_f32(uint16_t h);
uint16_t kvb_f32_to_bf16(float f); /* round to nearest even */
/* FP8 E4M3 (e4m3fn) to float32, exact (NaN for 0x7f / 0xff). */
float kvb_e4m3_to_f32(uint8_t b);
/* float32 to the nearest E4M3 value, ties to even, as a float32 (exact in E4M3): `f` must lie in
 * [-448, 448] (callers clamp first, as the quantization schemes do). */
float kvb_e4m3_round(float f);
/* float32 in [-448, 448] to its E4M3 bits, ties to even. */
uint8_t kvb_f32_to_e4m3(float f);

#endif
