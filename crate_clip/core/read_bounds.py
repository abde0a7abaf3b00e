"""The defaults of what the shard readers (training and evaluation) read at most (docs/safety.md lists each bound):
a shard member, a caption, all the members of one sample together, the raw samples a shuffle buffer holds, the
shards one source may name, an image's pixels and its decoded bytes. A DataComp sample is a <=512 px JPEG (~40 KB),
a caption of a few hundred bytes and a small JSON, far below each of them; they exist for the shards that are not."""

MAX_MEMBER_BYTES = 64 << 20       # any tar member (data.max_member_bytes)
# A caption of 8 KB is ~2,000 tokens, of which the text tower keeps 32-77; the syntax mask tags every word of
# it (~0.1 s per 4 KB: a 10 MB caption took 80 s).
MAX_CAPTION_BYTES = 8 << 10
# All members of one sample together, each counted with its 512-byte header (data.max_sample_bytes): without it,
# 24 members of 60 MiB each (every one under the member cap) made one sample of 1.4 GB.
MAX_SAMPLE_BYTES = 64 << 20
# The raw samples one canonical stream's shuffle buffer holds, in member bytes (data.max_shuffle_buffer_bytes): with
# DataComp's samples the buffer's sample count binds first (2 shards of 10,000 x 36 KB = 720 MB at the most), but
# samples near the sample budget would otherwise make it shuffle_buffer x 64 MiB.
MAX_SHUFFLE_BUFFER_BYTES = 1 << 30
# Shards one source (a brace pattern, nshards.txt) may name, counted before anything is expanded: DataComp's largest
# pool (xlarge, 12.8B samples) is 1.28M shards of 10,000; a pattern of 10^9 names took 4.9 GB before a MemoryError.
MAX_SOURCE_SHARDS = 2_000_000
MAX_IMAGE_PIXELS = 50_000_000     # width x height from the header; 50 MP is already absurd for web images
# Decoded bytes: a 512 px RGB image is 0.8 MB. The pixel cap alone lets a 7000 x 7000 16-bit PNG (381 KB on disk)
# through, whose decode and conversion to RGB took 0.9 GB; 64 MiB is a 4,700 px square RGB image.
MAX_IMAGE_BYTES = 64 << 20
