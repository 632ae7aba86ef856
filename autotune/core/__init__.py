"""The tuner's lowest layer: errors, token counts, the result record, hardware presets.

Imports nothing from the layers above (``oracle``, ``timing``, ``backends``, ``search``, ``outputs``, ``cli``);
see ``pyproject.toml``'s import-linter contracts."""
