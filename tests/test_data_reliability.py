"""Reliability of the data layer (issue 10): decompression bombs, missing sources, lazy sizes, real epoch counts."""
import json
import struct
import zlib

import pytest

from data_pipelines.image_decode import BadImage, open_image

from data_fixtures import jpeg_bytes, write_tar


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels (no pixel data: opening reads the header only)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def test_image_above_pils_own_limit_is_a_decompression_bomb():
    huge = png_header(20_000, 10_000)   # 200 MP: above PIL's 2 x 89.5 MP error threshold
    with pytest.raises(BadImage) as err:
        open_image(huge)
    assert err.value.reason == "decompression_bomb"


def test_max_image_pixels_above_pils_default_is_honoured():
    huge = png_header(20_000, 10_000)
    assert open_image(huge, max_pixels=300_000_000).size == (20_000, 10_000)
    with pytest.raises(BadImage) as err:
        open_image(huge, max_pixels=150_000_000)
    assert err.value.reason == "decompression_bomb" and "max_image_pixels=150000000" in str(err.value)


def test_shards_inspect_says_a_missing_path_is_missing(capsys):
    from data_pipelines.cli import main

    assert main(["inspect", "/missing/path", "--batches", "1"]) == 2
    err = capsys.readouterr().err
    assert "/missing/path" in err and "does not exist" in err and "Traceback" not in err
