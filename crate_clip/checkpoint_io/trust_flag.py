"""The --trust-checkpoint opt-in's flag, help and warning: plain strings, so that every command builds its
parser (and answers --help) without importing torch (safe_unpickling.py, which applies the opt-in, does)."""

TRUST_FLAG = "--trust-checkpoint"
TRUST_HELP = ("unpickle checkpoint and weights files without the allow-list (they can run code): only for files "
              "you trust, e.g. your own checkpoints of an earlier version (docs/safety.md)")
TRUST_WARNING = (f"[warn] {TRUST_FLAG}: checkpoint and weights files are unpickled without the allow-list; a file "
                 "from elsewhere can run code with it (docs/safety.md)")
