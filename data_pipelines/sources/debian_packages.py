"""The Debian packages holding the real local data the demo and the tests use: the one list `make demo` and
`make test` install (the Makefile reads it by running this file) and the demo names when one is missing.

    python3 data_pipelines/sources/debian_packages.py     # prints the package names, space-separated
"""
DEBIAN_PACKAGES = {
    "fashion_mnist": "dataset-fashion-mnist",   # the demo's images; most tests
    "emoji_images": "fonts-noto-color-emoji",   # `crate-clip shards emoji` and its test
    "emoji_names": "unicode-data",              # the emoji captions; skipped tests without it
    "wordnet": "wordnet-base",                  # the syntax text mask's part-of-speech source without NLTK
}

if __name__ == "__main__":
    print(" ".join(DEBIAN_PACKAGES.values()))
