"""What a search leaves behind and hands over: the output folder (``report``), exports for trainers
(``exporters``), plots, and the live progress display. Above ``autotune.search``; below the CLI."""
