"""Command-line tools (checkpoint conversion and inspection, plots, agent evaluation), installed as
``megatron_mimesis.tools`` with a ``mimesis-*`` console script each (setup.py); ``python tools/X.py`` works too."""
