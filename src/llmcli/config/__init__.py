"""Settings, typed and validated, in layers (flag > env > config file > model defaults >
built-in); the user's config.toml; XDG paths."""
