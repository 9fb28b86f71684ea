"""EROFS format code: the on-disk structures, the image writer, the image reader."""
