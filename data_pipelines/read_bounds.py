"""The defaults of what the data stream reads at most (docs/safety.md lists each bound): a shard member, a
caption, an image's pixels and its decoded bytes. A DataComp sample is a <=512 px JPEG (~40 KB), a caption of a
few hundred bytes and a small JSON, far below each of them; they exist for the shards that are not."""

MAX_MEMBER_BYTES = 64 << 20       # any tar member (data.max_member_bytes)
# A caption of 8 KB is ~2,000 tokens, of which the text tower keeps 32-77; the syntax mask tags every word of
# it (~0.1 s per 4 KB: a 10 MB caption took 80 s).
MAX_CAPTION_BYTES = 8 << 10
MAX_IMAGE_PIXELS = 50_000_000     # width x height from the header; 50 MP is already absurd for web images
# Decoded bytes: a 512 px RGB image is 0.8 MB. The pixel cap alone lets a 7000 x 7000 16-bit PNG (381 KB on disk)
# through, whose decode and conversion to RGB took 0.9 GB; 64 MiB is a 4,700 px square RGB image.
MAX_IMAGE_BYTES = 64 << 20
