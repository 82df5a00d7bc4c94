/* kvbank — the text layer's default budgets (see limits.h). */
#include "common/text/limits.h"

void kvb_text_limits_default(kvb_text_limits *out) {
    /* A prompt the size of a 128K-token context is about 0.5 MB of text: the byte budgets leave an order
     * of magnitude above real use and stop what only an attack sends. A long real conversation renders
     * in well under a million steps. */
    *out = (kvb_text_limits){
        .encode_bytes = 8u << 20,
        .decode_ids = 4u << 20,
        .render_steps = 20000000,
        .render_output = 8u << 20,
        .render_memory = 256u << 20,
    };
}
