"""The image sources: a directory, a tar stream, an OCI layout or docker archive, a registry."""
