/* kvbank — the text layer's default budgets (see limits.h). */
#include "common/text/limits.h"

void kvb_text_limits_default(kvb_text_limits *out) {
    /* A prompt the size of a 128K-token context is about 0.5 MB of text: the budgets leave an order of
     * magnitude above real use and stop what only an attack sends. */
    *out = (kvb_text_limits){
        .encode_bytes = 8u << 20,
        .decode_ids = 4u << 20,
    };
}
