/* kvbank — writing NumPy .npy files (format version 1.0, little-endian float32, C order). */
#ifndef KVB_UTIL_NPY_H
#define KVB_UTIL_NPY_H

#include <stdint.h>

#include "common/util/util.h"

/* Writes `data` [rows][cols] as a float32 array of shape (rows, cols). */
kvb_status kvb_npy_write_f32(const char *path, const float *data, int64_t rows, int64_t cols);

#endif
