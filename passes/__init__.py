"""Passes: one module per pass. Each registers its structured config on import and is named in
``configs/`` by ``_target_``; the pass manager imports nothing from here directly."""
