"""The run directory: its file layout and small files, its lease, the frozen run spec, user paths, the attempts."""
