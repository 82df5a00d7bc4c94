#include "common/util/npy.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

kvb_status kvb_npy_write_f32(const char *path, const float *data, int64_t rows, int64_t cols) {
    char dict[128];
    int n = snprintf(dict, sizeof dict, "{'descr': '<f4', 'fortran_order': False, 'shape': (%lld, %lld), }",
                     (long long)rows, (long long)cols);
    /* magic(6) + version(2) + header_len(2) + dict + padding + '\n' is a multiple of 64 */
    int total = 10 + n + 1;
    int pad = (64 - total % 64) % 64;
    int hlen = n + pad + 1;
    FILE *f = fopen(path, "wb");
    if (!f) {
        KVB_LOG_E("%s: cannot write: %s", path, strerror(errno));
        return KVB_ERR_IO;
    }
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(hlen & 0xff),
                             (unsigned char)(hlen >> 8)};
    int ok = fwrite(pre, 1, sizeof pre, f) == sizeof pre && fwrite(dict, 1, (size_t)n, f) == (size_t)n;
    for (int i = 0; ok && i < pad; i++) ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF;
    size_t cnt = (size_t)(rows * cols);
    ok = ok && fwrite(data, sizeof(float), cnt, f) == cnt; /* x86-64 and arm64 are little-endian */
    if (fclose(f) != 0) ok = 0;
    if (!ok) {
        KVB_LOG_E("%s: write failed", path);
        return KVB_ERR_IO;
    }
    return KVB_OK;
}
